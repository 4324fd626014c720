"""GroupMonitor: the engine group's health and faults. Per-rank pollers route each step's outputs to their requests'
sinks, a watchdog judges progress, and one failure path fails every in-flight request with a clear error, reports
each rank's last DPMeta, and restarts all ranks (or leaves the group failed for Serve to replace)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from mtp_ray.runtime.messages import unpack_step

if TYPE_CHECKING:
    from mtp_ray.config.engine import EngineConfig
    from mtp_ray.runtime.batcher import CallBatcher
    from mtp_ray.runtime.group_commands import GroupCommands
    from mtp_ray.runtime.sinks import Sink

log = logging.getLogger("mtp_ray.group")


class GroupFailed(RuntimeError):
    """The group failed (a rank died, a collective timed out, a lock-step check fired); it is restarting."""

    group_id: str | None = None  # set on a refused admission: the ingress's router avoids that group a while


class GroupUnavailable(RuntimeError):
    """No group can serve right now (starting, restarting or shut down)."""

    group_id: str | None = None  # set on a refused admission: the ingress's router avoids that group a while


class MonitoredGroup(Protocol):
    """What the monitor reads and drives of its group (runtime/group.py: EngineGroup): its ranks and requests, its
    state, its restart, and the counters its health report shows."""

    cfg: EngineConfig
    group_id: str
    dp: int
    workers: list  # the ranks' actor handles
    epoch: int  # bumps on every (re)start: pollers of an older epoch exit
    state: str
    ready: asyncio.Event
    restart_on_failure: bool
    commands: GroupCommands
    reqs: dict[str, tuple[int, Sink]]  # request id -> (rank, sink)
    load: list[int]
    adds: list[CallBatcher]
    admits: int
    admit_s: float
    abort_calls: list[int]
    abort_errors: list[int]
    max_model_len: int

    async def spawn(self) -> None: ...

    def kill_workers(self) -> None: ...

    def end(self, state: str) -> None: ...


class GroupMonitor:
    def __init__(self, group: MonitoredGroup):
        self.group = group
        dp = group.dp
        self.progress = [(0, time.monotonic())] * dp  # (step, when it last advanced) per rank
        self.last_poll: list[dict] = [{} for _ in range(dp)]  # each rank's last poll answer (health)
        self.restarts = 0
        self.last_failure: str | None = None
        # rank -> when a request's add to it went unanswered; the answer to a poll sent after that clears it.
        # Meanwhile the group refuses new requests at once (and tells Serve's router it cannot serve), so a request
        # sent again is not routed to the same stuck rank to wait out the ack time twice
        self.silent: dict[int, float] = {}

    def reset(self) -> None:
        """A (re)started group: every rank at step 0 now."""
        self.progress = [(0, time.monotonic())] * self.group.dp
        self.silent = {}

    def went_silent(self, rank: int) -> None:
        self.silent.setdefault(rank, time.monotonic())

    def check_answering(self, ack_s: float) -> None:
        """GroupUnavailable while a rank has not answered since a request's add to it went unanswered."""
        if self.silent:
            rank, since = min(self.silent.items(), key=lambda kv: kv[1])
            quiet = time.monotonic() - since + ack_s
            raise GroupUnavailable(f"rank {rank} of engine group {self.group.group_id} did not take a request "
                                   f"within {ack_s:g}s and has not answered for {quiet:.1f}s")

    async def poll(self, epoch: int, rank: int) -> None:
        """The rank's outputs to their sinks, its progress, its failure. A rank whose poll (an answer within 0.5 s)
        is not answered within timeouts.collective_s is stuck (a stopped process, a hung node): it fails the group
        even when idle; it was noticed only once a request reached it."""
        g = self.group
        worker, limit = g.workers[rank], g.cfg.timeouts.collective_s
        while g.epoch == epoch:
            sent = time.monotonic()
            try:
                res = await asyncio.wait_for(worker.poll.remote(0.5), limit)
            except asyncio.TimeoutError:
                if g.epoch == epoch:
                    await self.fail(epoch, f"rank {rank} did not answer the group's poll for {limit:g}s "
                                           "(timeouts.collective_s): its process is stopped or hung, or its node is "
                                           "unreachable")
                return
            except Exception as e:  # the actor died (RayActorError) or its node is gone
                if g.epoch == epoch:
                    await self.fail(epoch, f"rank {rank} died: {type(e).__name__}: {str(e).splitlines()[0]}")
                return
            if g.epoch != epoch:
                return
            self.last_poll[rank] = res
            if self.silent.get(rank, sent) < sent:  # answered a call made after it went silent
                del self.silent[rank]
            if res["step"] != self.progress[rank][0]:
                self.progress[rank] = (res["step"], time.monotonic())
            for msg in res["msgs"]:
                for out in unpack_step(msg)[1]:
                    entry = g.reqs.get(out.request_id)
                    if entry is not None:
                        entry[1].put(out)
            if res["error"]:
                await self.fail(epoch, res["error"])
                return

    async def watchdog(self) -> None:
        """Hung = requests are in flight but a rank's step counter has not moved for timeouts.progress_s."""
        g, limit = self.group, self.group.cfg.timeouts.progress_s
        while g.state != "stopped":
            await asyncio.sleep(1.0)
            if g.state != "ready" or not g.reqs:
                now = time.monotonic()
                self.progress = [(s, now) for s, _ in self.progress]
                continue
            for r, (step, since) in enumerate(self.progress):
                if time.monotonic() - since > limit:
                    await self.fail(g.epoch, f"rank {r} made no progress for {limit:.0f}s (step {step}) with "
                                             f"{len(g.reqs)} request(s) in flight")
                    break

    async def fail(self, epoch: int, reason: str) -> None:
        g = self.group
        if epoch != g.epoch or g.state != "ready":
            return
        restart = g.restart_on_failure and not g.commands.weights_updated
        # (Serve: failed at once, so that no admission waits for a group that will not serve again; it waited
        # queue_s while the report below was read, a 503 although another group could take the request)
        g.state = "restarting" if restart else "failed"
        g.ready.clear()
        self.last_failure = reason  # (what a refused admission names while the report is read)
        report = await self._rank_report()
        self.last_failure = f"{reason}\n{report}"
        log.error("engine group failed; %s\n%s", f"restarting all {g.dp} ranks" if restart else "not restarted",
                  self.last_failure)
        then = "the group is restarting" if g.restart_on_failure else "the group will be replaced"
        err = GroupFailed(f"engine group failed, request aborted; {then}. Cause: {reason}")
        for _, sink in list(g.reqs.values()):
            sink.fail(err)
        await self._tell_ranks(reason.splitlines()[0])
        g.epoch += 1
        g.kill_workers()
        if not restart:
            g.end("failed")
            if g.commands.weights_updated:  # a restart would reload the checkpoint: never other weights silently
                self.last_failure += "\nnot restarted: weights were updated since start (recreate the engine)"
            return
        self.restarts += 1
        try:
            await g.spawn()
        except Exception as e:  # leave the group unhealthy; check_health reports it
            g.end("failed")
            self.last_failure += f"\nrestart failed: {e}"
            log.exception("group restart failed")

    async def _tell_ranks(self, cause: str) -> None:
        """The live ranks hand the cause to their subscribers (the ingress's pulls) before they are killed: a stream
        on a rank that did not fail ends with what did (it read "rank N is gone" of its own rank)."""
        calls = [w.group_failed.remote(cause) for w in self.group.workers]
        try:  # (a dead rank answers with an error, a stopped one not at all)
            await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 1.0)
        except asyncio.TimeoutError:
            pass
        await asyncio.sleep(0.2)  # the woken pulls return before the kill

    async def _rank_report(self) -> str:
        lines = []
        for r, w in enumerate(self.group.workers):
            try:
                st = await asyncio.wait_for(w.stats.remote(), 3.0)
                lines.append(f"  rank {r}: step {self.progress[r][0]} wave {st['wave']} collectives "
                             f"{st['collectives']} last DPMeta: {st['last_meta']}")
            except Exception as e:
                lines.append(f"  rank {r}: unreachable ({type(e).__name__}); last poll step {self.progress[r][0]}")
        return "every rank's last state:\n" + "\n".join(lines)

    def health(self) -> dict:
        g = self.group
        return {"healthy": g.state == "ready", "state": g.state, "restarts": self.restarts,
                "silent_ranks": sorted(self.silent),
                "sleeping": g.commands.sleeping,
                "in_flight": len(g.reqs), "load": list(g.load), "last_failure": self.last_failure,
                "add_calls": [b.calls for b in g.adds],  # actor calls that carried new requests, per rank
                "admits": g.admits, "admit_s": g.admit_s,
                "abort_calls": list(g.abort_calls), "abort_errors": list(g.abort_errors),
                "max_model_len": g.max_model_len,
                "cache_config": {"block_size": g.cfg.cache.block_size, "num_gpu_blocks": g.num_blocks,
                                 "enable_prefix_caching": g.cfg.cache.prefix_caching,
                                 "gpu_memory_utilization": g.cfg.cache.memory_fraction},
                "ranks": [{"step": p.get("step", 0), "wave": p.get("wave", 0), "counters": p.get("counters", {}),
                           "collectives": p.get("collectives", 0), "num_running": p.get("num_running", 0),
                           "num_waiting": p.get("num_waiting", 0), "spec": p.get("spec", {}),
                           "kv_usage": p.get("kv_usage", 0.0), "num_preemptions": p.get("num_preemptions", 0),
                           "aborts": p.get("aborts", {}), "subscribers": p.get("subscribers", {}),
                           "prefix_cache": p.get("prefix_cache", {})}
                          for p in self.last_poll]}

    async def rank_stats(self) -> list[dict]:
        return list(await asyncio.gather(*[w.stats.remote() for w in self.group.workers]))
