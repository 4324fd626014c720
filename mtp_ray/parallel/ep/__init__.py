"""EP backends: how a MoE layer's tokens reach the ranks that own their experts and come back.

Registry: "torch" (all_to_all_single over the group: gloo on CPU, NCCL on GPU; always available, the default) and
"deepep" (DeepEP's NVLink / low-latency kernels: GPU, bf16, needs `import deep_ep`)."""

from __future__ import annotations

import torch

from mtp_ray.layers.moe import ExpertDispatcher, local_dispatch
from mtp_ray.parallel.context import DistContext


def make_dispatcher(name: str, ctx: DistContext, hidden: int, dtype: torch.dtype, ll_max_tokens: int
                    ) -> ExpertDispatcher:
    """ll_max_tokens: the most tokens one rank feeds a low-latency (global decode) forward that may run as a graph:
    largest graph batch x (k + 1). A group of one owns every expert and computes them in place (no exchange with
    itself, no header syncs, the fused small-batch path), as a plain engine does: the backend is only checked."""
    if name not in ("torch", "deepep"):
        raise ValueError(f"ep_backend must be 'torch' or 'deepep', got {name!r}")
    if name == "deepep":
        try:
            import deep_ep  # noqa: F401
        except ImportError as e:
            raise ValueError("parallel.ep_backend 'deepep' needs the deep_ep package, which is not installed; "
                             "use ep_backend 'torch'") from e
        if ctx.num_experts % ctx.world:  # DeepEP owns experts in equal contiguous blocks
            raise ValueError(f"parallel.ep_backend 'deepep' needs num_experts ({ctx.num_experts}) divisible by "
                             f"parallel.dp ({ctx.world}); use ep_backend 'torch'")
        if ctx.device.type != "cuda" or dtype != torch.bfloat16:
            raise ValueError(f"parallel.ep_backend 'deepep' runs on CUDA in bfloat16 (got device {ctx.device.type}, "
                             f"dtype {str(dtype).removeprefix('torch.')}); use ep_backend 'torch'")
    if ctx.world == 1:
        return local_dispatch
    if name == "deepep":
        from mtp_ray.parallel.ep.deepep import DeepEPDispatcher

        return DeepEPDispatcher(ctx, hidden, ll_max_tokens)
    from mtp_ray.parallel.ep.torch_a2a import TorchAllToAll

    return TorchAllToAll(ctx)
