"""Group commands as each rank runs them (on its engine thread, at the same step as every other rank)."""

from __future__ import annotations

from typing import Any

from mtp_ray.runtime.weight_sync import apply_update, make_group, receive, resolve


def run_command(worker, name: str, args: tuple) -> Any:
    core, runner, ctx = worker.core, worker.core.runner, worker.ctx
    if name == "sleep":
        level, in_flight = args
        aborted = core.abort_all() if in_flight == "abort" else 0
        if core.has_unfinished():
            raise ValueError("sleep: requests are still running (use in_flight='abort')")
        runner.sleep(level)
        ctx.barrier()
        return {"aborted": aborted, **runner.memory()}
    if name == "wake_up":
        runner.wake_up()
        ctx.barrier()
        core.warmup()  # re-warm in lock-step (graphs are recaptured here on GPU)
        ctx.barrier()
        return runner.memory()
    if name == "update_weights":
        return {"updated": apply_update(runner, resolve(args[0]))}
    if name == "init_weights_update_group":
        addr, port, rank_offset, world_size, group_name, backend = args
        store, pg = make_group(addr, port, rank_offset + worker.rank, world_size, group_name, backend)
        worker.update_groups[group_name] = (store, pg)
        return {"rank": rank_offset + worker.rank}
    if name == "update_weights_from_distributed":
        names, dtypes, shapes, group_name = args
        if group_name not in worker.update_groups:
            raise ValueError(f"unknown weight-update group {group_name!r}: call init_weights_update_group first")
        items = receive(worker.update_groups[group_name][1], names, dtypes, shapes, runner.device)
        return {"updated": apply_update(runner, items)}
    if name == "reset_prefix_cache":
        if core.has_unfinished():
            return False  # as vLLM: not while requests run
        runner.reset_caches()
        return True
    if name == "abort_all":
        return core.abort_all()
    if name == "memory":
        return runner.memory()
    raise ValueError(f"unknown group command {name!r}")
