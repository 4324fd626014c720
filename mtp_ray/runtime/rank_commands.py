"""Group commands as one rank runs them: on its engine thread, at the same step as every other rank (the worker
runs `RankCommands.run` when the gathered DPMeta says every rank holds the command)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mtp_ray.engine.core import EngineCore
from mtp_ray.engine.weight_sync import apply_update, check_update, make_group, receive, resolve
from mtp_ray.model.loader import WeightLoader
from mtp_ray.parallel.context import DistContext
from mtp_ray.runtime.messages import GroupCommand


class RankCommands:
    def __init__(self, core: EngineCore, ctx: DistContext, rank: int):
        self.core, self.ctx, self.rank = core, ctx, rank
        self.update_groups: dict[str, tuple[Any, Any]] = {}  # weight-update group name -> (TCPStore, process group)

    def run(self, cmd: GroupCommand) -> Any:
        handler = getattr(self, f"_{cmd.name}", None)
        if handler is None:
            raise ValueError(f"unknown group command {cmd.name!r}")
        return handler(*cmd.args)

    def _sleep(self, level: int, in_flight: str) -> dict:
        core, runner = self.core, self.core.runner
        aborted = core.abort_all() if in_flight == "abort" else 0
        if core.has_unfinished():
            raise ValueError("sleep: requests are still running (use in_flight='abort')")
        runner.sleep(level)
        core.invalidate_prefixes()  # the caches are gone
        self.ctx.barrier()
        return {"aborted": aborted, **runner.memory()}

    def _wake_up(self) -> dict:
        self.core.runner.wake_up()
        self.ctx.barrier()
        self.core.warmup()  # re-warm in lock-step (graphs are recaptured here on GPU)
        self.ctx.barrier()
        return self.core.runner.memory()

    def _update_weights(self, items: Any) -> dict:
        return self._all_or_none(lambda loader: resolve(items, loader.owns))

    def _all_or_none(self, fetch: Callable[[WeightLoader], list]) -> dict:
        """A weight update every rank takes or none does: each rank fetches and checks its part, the ranks agree
        on the outcome, then each copies its part (`fetched`: the tensors this rank took)."""
        loader = self.core.runner.weight_loader()
        items: list = []
        err = None
        try:
            items = fetch(loader)
            check_update(loader, items)
        except Exception as e:  # (every rank must reach the agreement, whatever failed here)
            err = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        err = self.ctx.agree_error(err)
        if err is not None:
            raise ValueError(err)
        fetched = apply_update(loader, items)
        self.core.invalidate_prefixes()  # KV and states computed with the old weights
        return {"updated": len(items), "fetched": fetched}

    def _init_weights_update_group(self, addr: str, port: int, rank_offset: int, world_size: int, group_name: str,
                                   backend: str) -> dict:
        self.update_groups[group_name] = make_group(addr, port, rank_offset + self.rank, world_size, group_name,
                                                    backend)
        return {"rank": rank_offset + self.rank}

    def _update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list, group_name: str) -> dict:
        if group_name not in self.update_groups:
            raise ValueError(f"unknown weight-update group {group_name!r}: call init_weights_update_group first")
        pg = self.update_groups[group_name][1]
        return self._all_or_none(lambda loader: receive(pg, names, dtypes, shapes, self.core.runner.device))

    def _reset_prefix_cache(self) -> bool:
        if self.core.has_unfinished():
            return False  # as vLLM: not while requests run
        self.core.runner.reset_caches()
        self.core.invalidate_prefixes()
        return True

    def _abort_all(self) -> int:
        return self.core.abort_all()

    def _memory(self) -> dict:
        return self.core.runner.memory()
