"""Deliveries: an ingress replica's end of the direct streams (runtime/outboxes.py, docs/design.md "Streams").

The replica is one subscriber. For every rank that holds some of its requests it runs one long-poll loop
(`RankWorker.pull`); a pull carries every step since the last for all of those requests, and each request gets
its outputs merged into one delta per pull. So the per-token path is rank -> ingress, one actor call per step (or
fewer, under load: then each pull carries several steps and each stream gets fewer, larger chunks), and never a
Ray object per request per step. A rank that dies or fails ends its requests with GroupFailed (a request that had no
tokens yet is sent again to another group by serve/cluster/groups.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from ray.exceptions import RayActorError

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.runtime.batcher import detached
from mtp_ray.runtime.group_monitor import GroupFailed
from mtp_ray.runtime.messages import Admission, unpack_step

log = logging.getLogger("mtp_ray.ingress")
PULL_S = 1.0  # a pull waits at most this long for its first message (the rank drops a subscriber silent for 10 s)
# streams on one rank from which its pulls are spaced by the stream interval: below it every step goes out as soon
# as the rank has it (a single stream's time per token is the engine's step, not the interval)
SPACED_STREAMS = 8


async def settled(worker, e: BaseException, tries: int = 5) -> BaseException:
    """The error of a call to the dead rank made later: the call in flight when it died may fail before Ray knows
    why (no "because ..." in its text); a later one carries the cause, once Ray has it (a second or so on a busy
    machine)."""
    for _ in range(tries):
        if not isinstance(e, RayActorError) or "dead because" in str(e):
            break
        await asyncio.sleep(0.5)
        try:
            await asyncio.wait_for(worker.__ray_ready__.remote(), 2.0)
            break  # (alive after all: the pull failed otherwise)
        except RayActorError as later:
            e = later
        except Exception:
            break
    return e


def rank_gone(rank: int, group: str, e: BaseException) -> str:
    """Why a rank's pull failed, in one line. Its ranks die with the group replica that owns them: Serve kills a
    replica it stops (a scale-down, an update, the app deleted) once graceful_shutdown_timeout_s passed, and Ray
    says the owner's exit was intended; a replica that crashed reads otherwise."""
    text = str(e)
    if "owner has died" in text and "INTENDED" in text:
        return (f"engine group {group} was stopped before this request ended: Serve stops a group that is scaled "
                f"down, updated or deleted once its running requests end or its graceful_shutdown_timeout_s passed "
                f"(args.group.graceful_shutdown_timeout_s)")
    first = (text.strip().splitlines() or [""])[0]
    owner = " (the group replica that owns it died)" if "owner has died" in text else ""
    return f"rank {rank} of engine group {group} is gone{owner}: {type(e).__name__}: {first}"


class Deliveries:
    def __init__(self, interval_s: float = 0.0) -> None:
        self.interval_s = interval_s  # server.stream_interval_ms: the least time from one pull of a rank to the next
        self.subscriber = uuid.uuid4().hex  # this replica, to the ranks
        self.queues: dict[str, asyncio.Queue] = {}  # request id -> its deltas (StepOutput) or the exception ending it
        self.by_source: dict[str, set[str]] = {}  # Admission.source -> its requests here
        self.loops: dict[str, asyncio.Task] = {}  # Admission.source -> its pull loop
        self.pulls = 0  # pulls made (stats, tests)

    def expect(self, rid: str) -> asyncio.Queue:
        """Before the request is admitted: its outputs may come in a pull that starts before admission returns."""
        q = self.queues[rid] = asyncio.Queue()
        return q

    def attach(self, adm: Admission) -> None:
        """The request is on `adm.worker`: pull from that rank while it holds any of our requests."""
        if adm.request_id not in self.queues:
            return  # dropped meanwhile (the client went away)
        self.by_source.setdefault(adm.source, set()).add(adm.request_id)
        if adm.source not in self.loops:
            self.loops[adm.source] = detached(self._loop(adm.source, adm.worker, adm.rank))

    def drop(self, rid: str) -> None:
        self.queues.pop(rid, None)
        for rids in self.by_source.values():
            rids.discard(rid)

    async def _loop(self, source: str, worker, rank: int) -> None:
        rids = self.by_source[source]
        try:
            while rids:
                started = time.monotonic()
                try:
                    res = await worker.pull.remote(self.subscriber, PULL_S)
                except Exception as e:  # the rank died, or its group was torn down
                    self._fail(source, GroupFailed(rank_gone(rank, source.split("/")[0], await settled(worker, e))))
                    return
                self.pulls += 1
                self._dispatch(res["msgs"])
                if res["error"] or res["stopped"]:
                    why = (res["error"] or "stopped").splitlines()[0]
                    self._fail(source, GroupFailed(f"engine group failed, request aborted. Cause: {why}"))
                    return
                if self.interval_s and len(rids) >= SPACED_STREAMS:  # the next pull brings the steps meanwhile
                    await asyncio.sleep(self.interval_s - (time.monotonic() - started))
        finally:
            self.loops.pop(source, None)
            if not self.by_source.get(source):
                self.by_source.pop(source, None)

    def _dispatch(self, msgs: list[bytes]) -> None:
        merged: dict[str, StepOutput] = {}
        for msg in msgs:
            for out in unpack_step(msg)[1]:
                prev = merged.get(out.request_id)
                if prev is None:
                    merged[out.request_id] = out
                elif not prev.finished:  # (nothing follows a request's end)
                    merged[out.request_id] = prev.then(out)
        for rid, out in merged.items():
            q = self.queues.get(rid)
            if q is not None:
                q.put_nowait(out)

    def _fail(self, source: str, err: BaseException) -> None:
        for rid in self.by_source.pop(source, set()):
            q = self.queues.get(rid)
            if q is not None:
                q.put_nowait(err)
        log.warning("%s", err)
