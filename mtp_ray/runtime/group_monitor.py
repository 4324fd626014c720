"""Group health and faults, mixed into EngineGroup: the per-rank pollers that route output rows to requests, the
progress watchdog, and the one failure path (fail every in-flight request with a clear error, report each rank's
last DPMeta, restart all ranks or leave the group failed for Serve to replace)."""

from __future__ import annotations

import asyncio
import logging
import time

from mtp_ray.runtime.messages import unpack_rows

log = logging.getLogger("mtp_ray.group")


class GroupFailed(RuntimeError):
    """The group failed (a rank died, a collective timed out, a lock-step check fired); it is restarting."""


class GroupUnavailable(RuntimeError):
    """No group can serve right now (starting, restarting or shut down)."""


class GroupMonitor:
    """Mixed into EngineGroup (which owns workers, reqs, progress, last_poll, epoch, state and _spawn)."""

    async def _poll(self, epoch: int, rank: int) -> None:
        worker = self.workers[rank]
        while self.epoch == epoch:
            try:
                res = await worker.poll.remote(0.5)
            except Exception as e:  # the actor died (RayActorError) or its node is gone
                if self.epoch == epoch:
                    await self._fail(epoch, f"rank {rank} died: {type(e).__name__}: {str(e).splitlines()[0]}")
                return
            if self.epoch != epoch:
                return
            self.last_poll[rank] = res
            if res["step"] != self.progress[rank][0]:
                self.progress[rank] = (res["step"], time.monotonic())
            for msg in res["msgs"]:
                for row in unpack_rows(msg)[1]:
                    entry = self.reqs.get(row[0])
                    if entry is not None:
                        entry[1].put_row(row)
            if res["error"]:
                await self._fail(epoch, res["error"])
                return

    async def _watchdog(self) -> None:
        """Hung = requests are in flight but a rank's step counter has not moved for timeouts.progress_s."""
        while self.state != "stopped":
            await asyncio.sleep(1.0)
            if self.state != "ready" or not self.reqs:
                now = time.monotonic()
                self.progress = [(s, now) for s, _ in self.progress]
                continue
            for r, (step, since) in enumerate(self.progress):
                if time.monotonic() - since > self.cfg.timeouts.progress_s:
                    await self._fail(self.epoch, f"rank {r} made no progress for {self.cfg.timeouts.progress_s:.0f}s "
                                                 f"(step {step}) with {len(self.reqs)} request(s) in flight")
                    break

    async def _fail(self, epoch: int, reason: str) -> None:
        if epoch != self.epoch or self.state != "ready":
            return
        self.state = "restarting"
        self._ready.clear()
        report = await self._rank_report()
        self.last_failure = f"{reason}\n{report}"
        log.error("engine group failed; restarting all %d ranks\n%s", self.dp, self.last_failure)
        then = "the group is restarting" if self.restart_on_failure else "the group will be replaced"
        err = GroupFailed(f"engine group failed, request aborted; {then}. Cause: {reason}")
        for _, sink in list(self.reqs.values()):
            sink.fail(err)
        self.epoch += 1
        self._kill_workers()
        if self.weights_updated:  # a restart would reload the checkpoint: never serve other weights silently
            self.state = "failed"
            self.last_failure += "\nnot restarted: weights were updated since start (recreate the engine)"
            return
        if not self.restart_on_failure:
            self.state = "failed"
            return
        self.restarts += 1
        try:
            await self._spawn()
        except Exception as e:  # leave the group unhealthy; check_health reports it
            self.state = "failed"
            self.last_failure += f"\nrestart failed: {e}"
            log.exception("group restart failed")

    async def _rank_report(self) -> str:
        lines = []
        for r, w in enumerate(self.workers):
            try:
                st = await asyncio.wait_for(w.stats.remote(), 3.0)
                lines.append(f"  rank {r}: step {self.progress[r][0]} wave {st['wave']} collectives "
                             f"{st['collectives']} last DPMeta: {st['last_meta']}")
            except Exception as e:
                lines.append(f"  rank {r}: unreachable ({type(e).__name__}); last poll step {self.progress[r][0]}")
        return "every rank's last state:\n" + "\n".join(lines)

    def health(self) -> dict:
        return {"healthy": self.state == "ready", "state": self.state, "restarts": self.restarts,
                "sleeping": self.sleeping,
                "in_flight": len(self.reqs), "load": list(self.load), "last_failure": self.last_failure,
                "add_calls": [b.calls for b in self.adds],  # actor calls that carried new requests, per rank
                "abort_calls": list(self.abort_calls), "abort_errors": list(self.abort_errors),
                "max_model_len": self.max_model_len,
                "ranks": [{"step": p.get("step", 0), "wave": p.get("wave", 0), "counters": p.get("counters", {}),
                           "collectives": p.get("collectives", 0), "num_running": p.get("num_running", 0),
                           "num_waiting": p.get("num_waiting", 0), "spec": p.get("spec", {}),
                           "aborts": p.get("aborts", {})}
                          for p in self.last_poll]}

    async def rank_stats(self) -> list[dict]:
        return list(await asyncio.gather(*[w.stats.remote() for w in self.workers]))
