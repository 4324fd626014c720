"""What a rank builds before its loop starts: its place in the collective group, the EP dispatcher for its expert
shard and the DP sync over them, and the EngineCore on top (runtime/worker.py: RankWorker.init)."""

from __future__ import annotations

import torch

from mtp_ray.config.engine import EngineConfig
from mtp_ray.config.model import ModelConfig
from mtp_ray.engine.core import EngineCore
from mtp_ray.engine.runner import resolve_device, resolve_dtype
from mtp_ray.parallel.context import DistContext, expert_ranges
from mtp_ray.parallel.ep import make_dispatcher
from mtp_ray.parallel.sync import DPSync


def join_and_build(cfg: EngineConfig, rank: int, world: int, addr: str, port: int
                   ) -> tuple[DistContext, EngineCore, tuple[int, int], torch.device]:
    """Join the collective group at addr:port (rank 0's rendezvous), then build this rank's engine over its experts
    -> (the context, the engine, its expert range, its device). Nothing runs a forward yet (warmup is next)."""
    device = resolve_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(0)  # Ray exposes the bundle's one GPU as device 0
    mc = ModelConfig.from_pretrained(cfg.model)
    ctx = DistContext(rank, world, mc.num_experts, device, cfg.timeouts.collective_s,
                      inject_ep_flip=cfg.parallel.inject_ep_flip_rank == rank,
                      check_collectives=cfg.parallel.check_collectives)
    ctx.init(addr, port)
    expert_range = expert_ranges(ctx.num_experts, world)[rank]
    # the most tokens a rank feeds a global decode forward that may be a graph: largest graph batch x (k + 1)
    graphs, max_seqs = cfg.graphs, cfg.scheduler.max_num_seqs
    seqs = max(graphs.batch_sizes(max_seqs)) if graphs.enabled else max_seqs
    dispatch = make_dispatcher(cfg.parallel.ep_backend, ctx, mc.hidden_size, resolve_dtype(cfg, device),
                               seqs * (1 + cfg.spec.k))
    bounded = getattr(dispatch, "ll_max_tokens", 0)  # DeepEP: fixed low-latency buffers; torch: unbounded
    sync = DPSync(ctx, draft_gathers=cfg.parallel.draft_gathers, group_turns=cfg.parallel.group_turns,
                  ll_max_tokens=bounded)
    return ctx, EngineCore(cfg, expert_range, dispatch, sync), expert_range, device
