"""EP backends: how a MoE layer's tokens reach the ranks that own their experts and come back.

Registry: "torch" (all_to_all_single over the group: gloo on CPU, NCCL on GPU; always available) and "deepep"
(DeepEP kernels, only when `import deep_ep` works)."""

from __future__ import annotations

from mtp_ray.dist.context import DistContext
from mtp_ray.layers.moe import ExpertDispatcher


def make_dispatcher(name: str, ctx: DistContext, hidden: int, top_k: int) -> ExpertDispatcher:
    if name == "torch":
        from mtp_ray.dist.ep.torch_a2a import TorchAllToAll

        return TorchAllToAll(ctx)
    if name == "deepep":
        from mtp_ray.dist.ep.deepep import DeepEPDispatcher

        return DeepEPDispatcher(ctx, hidden, top_k)
    raise ValueError(f"ep_backend must be 'torch' or 'deepep', got {name!r}")
