"""The device side of prefix caching around a step (design.md 10.1): GDN state snapshots restored into the slots
of requests admitted on a cached prefix, before the forward; taken inside a prefill piece by the forward itself
(`plan_snapshots`), or after it from requests whose piece ended at a snapshot point. Device work in stream order
(`ModelRunner.copy_states`, the GDN layers), so a later step that restores a snapshot reads it complete."""

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


def plan_snapshots(sched: list[Scheduled], blocks: BlockManager) -> None:
    """Snapshot points strictly inside a step's prefill pieces: their blocks are named now (this forward writes
    their KV before any later step reads it) and each new snapshot's state slot goes into `Scheduled.snapshots`,
    for the GDN layers to fill in this forward. Called once the step's batch is final."""
    blocks.index.begin_step()
    for s in sched:
        req, start = s.req, s.req.num_computed
        if s.verify or not req.snap_points:
            continue
        for p in req.snap_points:
            if start < p < start + s.num_new:
                slot = blocks.publish(req, p)
                if slot is not None:
                    s.snapshots.append((p - start, slot))


def publish_prefixes(sched: list[Scheduled], blocks: BlockManager, runner: ModelRunner) -> None:
    """Requests whose prefill piece just ended at one of their snapshot points: their full blocks before it are
    named in the prefix cache and their GDN state there is snapshotted (after the step's forward)."""
    pairs = []
    for s in sched:
        req = s.req
        if req.snap_points and req.num_computed in req.snap_points and not s.completes_prefill and not s.verify:
            slot = blocks.publish(req, req.num_computed)
            if slot is not None:
                pairs.append((req.state_slots[0], slot))
    runner.copy_states(pairs)
