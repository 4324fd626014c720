"""The EngineGroup as a Ray Serve deployment: one replica == one DP x EP group, its ranks placed on the replica's
placement-group bundles (bundle 0 holds the replica itself). Serve's health check fails when a rank is dead or
the group failed, so Serve replaces the whole group; Serve's request cancellation aborts the request on its rank.
Through a DeploymentHandle it offers the same RL methods as the rollout actor (generate, sleep, wake_up,
update_weights, ...), plus `admit_batch` for the HTTP ingress and `stream` for handle users who stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import ray

from mtp_ray.config.engine import EngineConfig
from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.rl.engine import RolloutEngine
from mtp_ray.runtime.group import EngineGroup
from mtp_ray.runtime.group_monitor import GroupFailed, GroupUnavailable
from mtp_ray.runtime.messages import Admission, AdmitItem
from mtp_ray.serve.cluster.metrics import group_snapshot
from mtp_ray.serve.cluster.metrics_hub import HubReporter
from mtp_ray.serve.cluster.routing import GROUP, IN_FLIGHT, STAMP
from mtp_ray.serve.cluster.scaling import REQUESTS_IN_FLIGHT


class GroupDeployment(RolloutEngine):
    async def __init__(self, engine: dict, deploy: int = 0):  # Serve runs async constructors
        self.cfg = EngineConfig.from_dict(engine)
        pg = ray.util.get_current_placement_group()
        self._attach(EngineGroup(self.cfg, pg, bundle_offset=1 if pg is not None else 0, restart_on_failure=False))
        await self.start()
        self._posted = asyncio.Lock()  # posted_command: one at a time
        # this group's counters and gauges to the application's metrics hub, once a second, and the commands
        # posted for every group (serve/cluster/broadcast.py: the admin routes) back from it
        self.reporter = HubReporter("group", self.group.group_id, lambda: group_snapshot(self.group.monitor.health()),
                                    deploy, self.posted_command)
        self.reporter.start()

    async def posted_command(self, name: str, args: dict) -> dict:
        """A command an ingress posted for every group (serve/cluster/broadcast.py). Asleep, sleep does nothing; awake,
        wake_up does nothing (as vLLM's); reset_prefix_cache fails while requests run (as vLLM's)."""
        cmds = self.group.commands
        async with self._posted:  # one at a time: two /sleep calls at once, the second sees the group asleep
            if name == "sleep" and not cmds.sleeping:
                await self.sleep(args.get("level", 1), args.get("in_flight", "abort"))
            elif name == "wake_up" and cmds.sleeping:
                await self.wake_up()
            elif name == "reset_prefix_cache" and not await self.reset_prefix_cache():
                raise RuntimeError("requests are running (the prefix cache is reset only with none running)")
            return {"sleeping": cmds.sleeping}

    async def stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
                     ) -> AsyncIterator[StepOutput]:
        """The request's StepOutputs: first an empty one once a rank holds it, then one per engine step with new tokens,
        or several steps' coalesced when the consumer falls behind (call with handle.options(stream=True)); params as
        validated by the ingress."""
        async for out in self.group.generate(prompt_ids, params, request_id, announce=True):
            yield out

    async def admit_batch(self, items: list[AdmitItem], subscriber: str, avoid: tuple[str, ...] = ()
                          ) -> AsyncIterator[list[Admission | Exception]]:
        """The HTTP ingress's entry (handle.options(stream=True)): the requests that reached one ingress replica since
        its previous admission call (serve/cluster/admissions.py: Admissions), in one call (`EngineGroup.admit_batch`):
        one result each, an Admission (the ingress replica `subscriber` then pulls its outputs from that rank itself,
        runtime/outboxes.py) or the error that refused it. The call stays open until they all ended; cancelling it
        aborts those still running. Params as validated by the ingress. `avoid` is for Serve's router
        (serve/cluster/routing.py): groups that refused this ingress's requests lately; this group was not one, or none
        other could be chosen. A refusal says which group refused, for the ingress's next `avoid`."""
        if self.group.commands.sleeping:  # refused at once, whatever set_asleep_policy says (that is the RL
            # handle's): the ingress tries the other groups and answers a 503 naming this cause after queue_s
            refusal = GroupUnavailable("the engine group is asleep (POST /wake_up, or the handle's wake_up)")
            refusal.group_id = self.group.group_id
            yield [refusal] * len(items)
            return
        async for results in self.group.admit_batch(items, subscriber):
            for r in results:
                if isinstance(r, (GroupUnavailable, GroupFailed)):
                    r.group_id = self.group.group_id
            yield results

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (serve/cluster/scaling.py): requests in flight on this group. Serve's own
        count is of open calls, and one admission call carries a burst of requests."""
        return {REQUESTS_IN_FLIGHT: float(len(self.group.reqs))}

    async def record_routing_stats(self) -> dict:
        """Read by Serve's request router (serve/cluster/routing.py) every second: a group that cannot serve (failed,
        restarting, or a rank that did not take a request and has not answered since) is passed over while another
        can; and how many requests it holds, for the router's least-requests choice."""
        return {"serving": self.group.state == "ready" and not self.group.monitor.silent
                and not self.group.commands.sleeping,
                IN_FLIGHT: len(self.group.reqs), STAMP: time.time(), GROUP: self.group.group_id}

    async def info(self) -> dict:
        mc = self.group.model_config
        return {"max_model_len": self.group.max_model_len, "vocab_size": mc.vocab_size, "model": self.cfg.model,
                "max_logprobs": self.cfg.max_logprobs,
                "dp": self.cfg.parallel.dp, "k": self.cfg.spec.k, "eos_token_ids": list(mc.eos_token_ids)}

    async def check_health(self) -> None:
        h = self.group.monitor.health()
        if h["state"] in ("failed", "stopped"):
            raise RuntimeError(f"engine group unhealthy ({h['state']}): {h['last_failure']}")
