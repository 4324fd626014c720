"""EP dispatchers on gloo ranks without Ray: spawned processes, one per rank, each with the same full experts and its
own shard of them (what a group's ranks hold), reporting back through a queue."""

from __future__ import annotations

import torch


def rank_setup(rank: int, world: int, port: int, e: int, h: int, inter: int):
    """Inside a spawned rank: join the gloo group -> (DistContext, all e experts identical on every rank, this
    rank's shard of them, ctx.expert_range)."""
    from mtp_ray.layers.moe import Experts
    from mtp_ray.parallel.context import DistContext

    torch.set_num_threads(1)
    ctx = DistContext(rank, world, e, torch.device("cpu"), 60.0)
    ctx.init("127.0.0.1", port)
    g = torch.Generator().manual_seed(0)
    full = Experts(h, inter, 0, e)
    with torch.no_grad():
        full.gate_up_proj.copy_(torch.randn(e, 2 * inter, h, generator=g) * h**-0.5)
        full.down_proj.copy_(torch.randn(e, h, inter, generator=g) * inter**-0.5)
    start, end = ctx.expert_range
    mine = Experts(h, inter, start, end)
    with torch.no_grad():
        mine.gate_up_proj.copy_(full.gate_up_proj[start:end])
        mine.down_proj.copy_(full.down_proj[start:end])
    return ctx, full, mine


def run_ranks(target, world: int, timeout: float = 120.0) -> list[tuple]:
    """target(rank, world, port, queue) in `world` spawned processes; each puts one tuple starting with its rank
    (and ending with an error repr or None). Returns them sorted by rank."""
    import torch.multiprocessing as mp

    from mtp_ray.parallel.context import free_port

    mpc = mp.get_context("spawn")
    queue, port = mpc.Queue(), free_port()
    procs = [mpc.Process(target=target, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(30)
    return results
