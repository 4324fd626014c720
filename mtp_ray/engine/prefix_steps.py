"""The device side of prefix caching around a step (design.md 10.1): GDN state snapshots restored into the slots
of requests admitted on a cached prefix, before the forward; taken from requests that reached a snapshot point,
after it. Both are device copies in stream order (`ModelRunner.copy_states`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtp_ray.engine.block_manager import BlockManager
    from mtp_ray.engine.runner import ModelRunner
    from mtp_ray.engine.scheduler import Scheduled


def restore_prefixes(sched: list[Scheduled], runner: ModelRunner) -> None:
    """Requests admitted on a cached prefix: their GDN state from the prefix's snapshot, before any forward reads
    it."""
    pairs = []
    for s in sched:
        if s.req.restore_from is not None:
            pairs.append((s.req.restore_from, s.req.state_slots[0]))
            s.req.restore_from = None
    runner.copy_states(pairs)


def publish_prefixes(sched: list[Scheduled], blocks: BlockManager, runner: ModelRunner) -> None:
    """Requests whose prefill just reached one of their snapshot points: their full blocks before it are named in
    the prefix cache and their GDN state there is snapshotted (after the step's forward)."""
    pairs = []
    for s in sched:
        req = s.req
        if req.snap_points and req.num_computed in req.snap_points and not s.completes_prefill and not s.verify:
            slot = blocks.publish(req, req.prefix_hashes[: req.num_computed // blocks.block_size])
            if slot is not None:
                pairs.append((req.state_slots[0], slot))
    runner.copy_states(pairs)
