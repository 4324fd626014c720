"""Admissions: the ingress replica's requests to admit, in as few Serve calls as possible (serve/cluster/groups.py says
why), and the abort of one admitted request at its rank."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mtp_ray.runtime.batcher import CallBatcher, detached
from mtp_ray.runtime.group_monitor import GroupFailed, GroupUnavailable
from mtp_ray.runtime.messages import Admission, AdmitItem
from mtp_ray.serve.cluster.failures import first_line

log = logging.getLogger("mtp_ray.ingress")

GROUPS_SEEN_S = 30.0  # a group that admitted nothing for this long no longer counts for splitting bursts
# a group that refused a request is avoided this long (serve/cluster/routing.py); by then its routing stats say so
AVOID_S = 2.0


def recent(stamps: dict[str, float], age_s: float) -> dict[str, float]:
    """`stamps` (group -> when, time.monotonic()) without the entries older than age_s, dropped from it too."""
    now = time.monotonic()
    for g in [g for g, t in stamps.items() if now - t > age_s]:
        del stamps[g]
    return stamps


def abort_at_rank(adm: Admission, count: Callable[[str], None]) -> None:
    """Abort one admitted request on its rank (its admission call may carry others: it stays open). Counted in
    the ingress's metrics: ingress_abort_calls_total, ingress_abort_errors_total."""
    async def send() -> None:
        count("ingress_abort_calls_total")
        try:
            await adm.worker.abort.remote(adm.request_id)
        except Exception as e:  # the rank is gone: its requests went with it
            count("ingress_abort_errors_total")
            log.info("abort of %s on rank %d: %s", adm.request_id, adm.rank, first_line(e))

    detached(send())  # not a child of the request being cancelled (runtime/batcher.py: detached)


class Admissions:
    """Requests to admit, in as few Serve calls as possible (a CallBatcher): the first at once, those that arrive
    after it together in the next, gap_s later (server.admission_gap_ms; 0: once the call in flight answered). A
    call stays open while its requests run (the group ends it); a request whose submitter stopped waiting is not
    sent, or aborted if it was admitted meanwhile. Structured-output requests go alone (the group compiles their
    grammar before answering)."""

    def __init__(self, send: Callable[[list[AdmitItem], tuple[str, ...]], Any], count: Callable[[str], None],
                 gap_s: float = 0.02):
        self.send = send  # items, groups to avoid -> Serve's response generator of GroupDeployment.admit_batch
        self.count = count  # the ingress's metrics
        self.refused: dict[str, float] = {}  # group -> when it last refused a request as unable to serve
        # groups that admitted requests lately -> when: a burst is split into a call per group, each routed to the group
        # with the fewest requests (serve/cluster/routing.py; a group not seen yet, e.g. just scaled up, has none, so
        # the next call goes there); one call put a whole burst on one group of two
        self.groups: dict[str, float] = {}
        self.batcher = CallBatcher(self._call, gap_s=gap_s or None, orphan=self._orphan, ways=self._ways)

    def _ways(self) -> int:
        return max(1, len(recent(self.groups, GROUPS_SEEN_S)))

    def submit(self, item: AdmitItem) -> asyncio.Future:
        """A future of the item's result: its Admission, or the exception that refused it."""
        if item.params.structured_outputs is not None:  # a batcher of its own: a call carrying it alone, at once
            return CallBatcher(self._call, orphan=self._orphan).submit(item)
        return self.batcher.submit(item)

    def _call(self, items: list[AdmitItem]) -> Awaitable[list[Admission | Exception]]:
        """One Serve call, issued now (the batcher calls this as the call leaves); awaiting the result gives its
        answer, the call's first message (a result per item)."""
        self.count("ingress_admission_calls_total")
        return self._answer(self.send(items, tuple(recent(self.refused, AVOID_S))))

    async def _answer(self, call: Any) -> list[Admission | Exception]:
        """The call's first message; the call stays open in a task of its own."""
        try:
            results = await call.__anext__()
        except Exception:  # the call failed (no group, a group gone): every request gets the error
            call.cancel()
            raise
        detached(self._hold(call))
        now = time.monotonic()
        for r in results:
            if isinstance(r, Admission):
                self.groups[r.group_id] = now
            elif isinstance(r, (GroupUnavailable, GroupFailed)) and r.group_id is not None:  # (says which group)
                self.refused[r.group_id] = now
        return results

    def _orphan(self, result: Admission | Exception) -> None:
        if isinstance(result, Admission):  # its client went away or its queue time ran out meanwhile
            abort_at_rank(result, self.count)

    @staticmethod
    async def _hold(call: Any) -> None:
        """Held open until the group ends it, when its requests ended (closing it would abort them)."""
        try:
            async for _ in call:
                pass
        except Exception:  # the group failed: each request learns it from its rank's pulls
            pass
