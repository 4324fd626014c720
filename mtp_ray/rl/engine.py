"""RolloutEngine: an engine group behind a Ray actor handle that any actor can call (verl / OpenRLHF style)."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from mtp_ray.config.engine import EngineConfig
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.serve.group import EngineGroup

STOP_REASON = {"stop": "completed", "length": "length", "abort": "aborted"}


class RolloutEngine:
    def __init__(self, config: EngineConfig | dict, placement_group=None, bundle_offset: int = 0):
        cfg = config if isinstance(config, EngineConfig) else EngineConfig.from_dict(config)
        self.group = EngineGroup(cfg, placement_group, bundle_offset)
        self._started: asyncio.Task | None = None

    async def start(self) -> dict:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self.group.start())
        await self._started
        return self.group.health()

    async def generate(self, prompt_token_ids: list[int] | list[list[int]], sampling_params: dict | None = None
                       ) -> dict | list[dict]:
        """One prompt (list of ids) -> one result; a batch (list of lists) -> a list of results, in order."""
        await self.start()
        params = SamplingParams.from_dict(dict(sampling_params or {}))
        if prompt_token_ids and all(isinstance(p, list) for p in prompt_token_ids):
            return list(await asyncio.gather(*[self._one(p, params) for p in prompt_token_ids]))
        return await self._one(prompt_token_ids, params)

    async def _one(self, ids: list[int], params: SamplingParams) -> dict:
        if params.n != 1:
            raise ValueError("n must be 1 per prompt on the rollout handle (repeat the prompt instead)")
        toks: list[int] = []
        lps: list[float] = []
        last: Any = None
        async for out in self.group.generate(ids, params):
            toks += out.new_token_ids
            lps += out.new_logprobs
            last = out
        return {"token_ids": toks, "log_probs": lps, "stop_reason": STOP_REASON.get(last.finish_reason, "completed"),
                "finish_reason": last.finish_reason, "spec": last.spec}

    async def health(self) -> dict:
        return self.group.health()

    async def get_stats(self) -> dict:
        await self.start()
        return {"health": self.group.health(), "ranks": await self.group.rank_stats()}

    async def worker_handles(self) -> list:
        await self.start()
        return list(self.group.workers)

    async def shutdown(self) -> None:
        await self.group.shutdown()


def launch_engine(config: EngineConfig | dict, placement_group=None, bundle_offset: int = 0, name: str | None = None):
    """Create the engine actor inside the current Ray job and wait until its group serves; returns the handle."""
    actor = ray.remote(RolloutEngine).options(num_cpus=0, max_concurrency=1000, name=name)
    handle = actor.remote(config, placement_group, bundle_offset)
    ray.get(handle.start.remote())
    return handle
