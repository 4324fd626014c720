"""The EngineGroup as a Ray Serve deployment: one replica == one DP x EP group, its ranks placed on the replica's
placement-group bundles (bundle 0 holds the replica itself). Serve's health check fails when a rank is dead or
the group is restarting, and Serve's request cancellation aborts the request on its rank."""

from __future__ import annotations

import ray

from mtp_ray.config.engine import EngineConfig
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.serve.group import EngineGroup


class GroupDeployment:
    async def __init__(self, engine: dict):
        self.cfg = EngineConfig.from_dict(engine)
        pg = ray.util.get_current_placement_group()
        self.group = EngineGroup(self.cfg, pg, bundle_offset=1 if pg is not None else 0, restart_on_failure=False)
        await self.group.start()

    async def generate(self, prompt_ids: list[int], params: dict, request_id: str | None = None):
        """Streams one dict per engine step with new tokens (use handle.options(stream=True))."""
        async for out in self.group.generate(prompt_ids, SamplingParams.from_dict(params), request_id):
            yield {"token_ids": out.new_token_ids, "logprobs": out.new_logprobs,
                   "top_logprobs": [list(t.items()) for t in out.new_top_logprobs], "finished": out.finished,
                   "finish_reason": out.finish_reason, "stop_reason": out.stop_reason, "spec": out.spec}

    async def info(self) -> dict:
        mc = self.group.model_config
        return {"max_model_len": self.group.max_model_len, "vocab_size": mc.vocab_size, "model": self.cfg.model,
                "dp": self.cfg.parallel.dp, "k": self.cfg.spec.k}

    async def health(self) -> dict:
        return self.group.health()

    async def check_health(self) -> None:
        h = self.group.health()
        if not h["healthy"]:
            raise RuntimeError(f"engine group unhealthy ({h['state']}): {h['last_failure']}")
