"""EP backends: how a MoE layer's tokens reach the ranks that own their experts and come back.

Registry: "torch" (all_to_all_single over the group: gloo on CPU, NCCL on GPU; always available). "deepep" is
refused with a clear error until the GPU path brings it (it needs `import deep_ep` and a GPU to be tested)."""

from __future__ import annotations

from mtp_ray.dist.context import DistContext
from mtp_ray.layers.moe import ExpertDispatcher


def make_dispatcher(name: str, ctx: DistContext, hidden: int, top_k: int) -> ExpertDispatcher:
    if name == "torch":
        from mtp_ray.dist.ep.torch_a2a import TorchAllToAll

        return TorchAllToAll(ctx)
    if name == "deepep":
        try:
            import deep_ep  # noqa: F401
        except ImportError as e:
            raise ValueError("parallel.ep_backend 'deepep' needs the deep_ep package, which is not installed; "
                             "use ep_backend 'torch'") from e
        # DeepEP's kernels are GPU-only and its API differs across releases (V1 Buffer, V2 ElasticBuffer): the
        # backend lands with the GPU path, where it can be run and tested (see README, status).
        raise ValueError("parallel.ep_backend 'deepep' is not available in this build yet; use ep_backend 'torch'")
    raise ValueError(f"ep_backend must be 'torch' or 'deepep', got {name!r}")
