"""GroupClient: how the ingress reaches the engine groups (the group deployment's replicas).

Admission is a call to a group (`GroupDeployment.admit_batch`, routed by Serve) carrying every request that reached
this replica since its previous admission call left, server.admission_gap_ms before (`Admissions`, a runtime/batcher.py
CallBatcher: a Serve call costs ~1.5 ms of routing and replica work, so a burst of 128 calls took ~160-250 ms
where one call carrying them takes 5 ms, bench/serve_calls.py); the requests' outputs then come from their ranks
straight to this replica (serve/delivery.py). A request is admitted by some group within the queue
timeout or gets a 503 naming the cause: a group that cannot serve answers GroupUnavailable at once
(serve/routing.py steers new requests away from it) and the request is sent again, to whichever group Serve picks
next, until one admits it or the time is up. A request whose group fails after admitting it but before its first
token is sent again the same way; one that already streamed tokens ends with the group's error."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.runtime.batcher import CallBatcher, detached
from mtp_ray.runtime.group_monitor import GroupFailed, GroupUnavailable
from mtp_ray.runtime.messages import Admission, AdmitItem, RequestError
from mtp_ray.serve.delivery import Deliveries
from mtp_ray.serve.errors import ApiError

log = logging.getLogger("mtp_ray.ingress")

GROUPS_SEEN_S = 30.0  # a group that admitted nothing for this long no longer counts for splitting bursts
# a group that refused a request is avoided this long (serve/routing.py); by then its routing stats say so
AVOID_S = 2.0
# a group that cannot serve right now: failed or restarting, a rank or the group replica gone, Serve without a replica
UNAVAILABLE = (GroupFailed, GroupUnavailable, RayActorError, ActorUnavailableError, DeploymentUnavailableError,
               ReplicaUnavailableError)


def cause_of(e: BaseException) -> BaseException:
    """An exception raised in the group replica arrives as a RayTaskError whose `cause` is the original."""
    return e.cause if isinstance(e, RayTaskError) and e.cause is not None else e


def first_line(e: BaseException) -> str:
    """The cause in one line (a group failure's first line names the rank and what happened; the lines after it
    are the per-rank report, which goes to the logs and /health)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def unavailable(e: BaseException) -> bool:
    return isinstance(cause_of(e), UNAVAILABLE)


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
        # groups that admitted requests lately -> when: a burst is split into a call per group, each routed to the
        # group with the fewest requests (serve/routing.py; a group not seen yet, e.g. just scaled up, has none, so
        # the next call goes there); one call put a whole burst on one group of two
        self.groups: dict[str, float] = {}
        self.batcher = CallBatcher(self._call, gap_s=gap_s or None, orphan=self._orphan, ways=self._ways)

    def _ways(self) -> int:
        now = time.monotonic()
        for g in [g for g, t in self.groups.items() if now - t > GROUPS_SEEN_S]:
            del self.groups[g]
        return max(1, len(self.groups))

    def submit(self, item: AdmitItem) -> asyncio.Future:
        """A future of the item's result: its Admission, or the exception that refused it."""
        if item.params.structured_outputs is not None:  # a batcher of its own: a call carrying it alone, at once
            return CallBatcher(self._call, orphan=self._orphan).submit(item)
        return self.batcher.submit(item)

    def _call(self, items: list[AdmitItem]) -> Awaitable[list[Admission | Exception]]:
        """One Serve call, issued now (the batcher calls this as the call leaves); awaiting the result gives its
        answer, the call's first message (a result per item)."""
        self.count("ingress_admission_calls_total")
        now = time.monotonic()
        for g in [g for g, t in self.refused.items() if now - t > AVOID_S]:
            del self.refused[g]
        return self._answer(self.send(items, tuple(self.refused)))

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


class GroupClient:
    def __init__(self, handle, queue_s: float, retry_after_s: int, count: Callable[[str], None] = lambda _: None,
                 max_resends: int = 3, stream_interval_s: float = 0.0, admission_gap_s: float = 0.02):
        self.handle = handle
        self.streaming = handle.options(stream=True)  # (made once: options() builds a new handle each call)
        self.deliveries = Deliveries(stream_interval_s)
        self.admissions = Admissions(lambda items, avoid: self.streaming.admit_batch.remote(
            items, self.deliveries.subscriber, avoid=avoid), count, admission_gap_s)
        self.queue_s, self.retry_after_s, self.max_resends = queue_s, retry_after_s, max_resends
        self.count = count  # metrics: request_retried_total (sent again: its group could not serve it)
        self._info: asyncio.Future | None = None

    async def info(self) -> dict:
        """The group's model facts, asked once: a burst of first requests shares the one call. It is made from a
        task of its own (runtime/batcher.py: detached): made inside the first request, Serve would cancel it with
        that request when its client gives up, and every later request would get the cancellation. No group has
        answered within queue_s (none up yet: starting, or waiting for resources): ApiError 503 with Retry-After
        (the call goes on for the next request; a request used to wait with no bound)."""
        f = self._info
        if f is None or (f.done() and (f.cancelled() or f.exception() is not None)):  # none yet, or ask again
            f = self._info = detached(self._ask_info())
        try:
            return await asyncio.wait_for(asyncio.shield(f), self.queue_s)
        except asyncio.TimeoutError:
            raise self.unavailable_error(f"no engine group answered within {self.queue_s:g}s "
                                         "(starting, or waiting for resources)") from None
        except Exception as e:
            if unavailable(e):
                raise self.unavailable_error(e) from None
            raise

    async def _ask_info(self) -> dict:
        return await self.handle.info.remote()

    def unavailable_error(self, cause: BaseException | str, mid_stream: bool = False) -> ApiError:
        """503 + Retry-After; mid_stream (tokens sent: it cannot go elsewhere): the failure's first line alone
        ("engine group failed, request aborted; ... Cause: rank 0 died: ...")."""
        text = first_line(cause_of(cause)) if isinstance(cause, BaseException) else cause
        return ApiError(503, text if mid_stream else f"no engine group can serve the request right now: {text}",
                        headers={"Retry-After": str(self.retry_after_s)})

    async def admit(self, prompt: list[int], params: SamplingParams) -> Admitted:
        """The request admitted on some group's rank. Raises ApiError 503 (with Retry-After) when no group admits it
        within queue_s."""
        deadline = time.monotonic() + self.queue_s
        cause: BaseException | str = f"none admitted the request within {self.queue_s:g}s"
        delay = 0.05
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.unavailable_error(cause)
            rid = uuid.uuid4().hex
            queue = self.deliveries.expect(rid)
            try:  # (a timeout or a cancel also cancels the future: Admissions aborts the request if admitted)
                adm = await asyncio.wait_for(self.admissions.submit(AdmitItem(rid, prompt, params)), left)
                if isinstance(adm, Exception):  # the group refused this request
                    raise adm
            except asyncio.TimeoutError:
                self.deliveries.drop(rid)
                raise self.unavailable_error(cause) from None
            except asyncio.CancelledError:  # the client went away while it was being admitted
                self.deliveries.drop(rid)
                raise
            except Exception as e:
                self.deliveries.drop(rid)
                if not unavailable(e):
                    raise
                cause = e
                self.count("request_retried_total")
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(2 * delay, 0.5)
                continue
            assert isinstance(adm, Admission) and adm.request_id == rid
            self.deliveries.attach(adm)
            return Admitted(adm, queue)

    async def open(self, prompt: list[int], params: SamplingParams) -> GroupStream:
        """A request admitted by some group (or ApiError 503): its deltas through `GroupStream.deltas`."""
        return GroupStream(self, prompt, params, await self.admit(prompt, params))

    async def open_each(self, requests: list[tuple[list[int], SamplingParams]]) -> list[GroupStream]:
        """Every request admitted, or none: the first failure is raised once those admitted were aborted and the
        rest stopped (so is a cancel: the client went away)."""
        tasks = [asyncio.ensure_future(self.open(prompt, params)) for prompt, params in requests]
        try:
            opened = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:  # the client went away: abort those admitted, stop the rest
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is None:
                    t.result().cancel()
                else:
                    t.cancel()
            raise
        failed = next((e for e in opened if isinstance(e, BaseException)), None)
        if failed is not None:
            for s in opened:
                if isinstance(s, GroupStream):
                    s.cancel()
            raise failed
        return opened


@dataclass
class Admitted:
    """An admitted request on the ingress side: where it runs, the queue its deltas arrive in."""

    adm: Admission
    queue: asyncio.Queue


class GroupStream:
    """One admitted request's deltas; sent again (to whichever group admits it) when its group fails before the
    first token."""

    def __init__(self, client: GroupClient, prompt: list[int], params: SamplingParams, admitted: Admitted):
        self.client, self.prompt, self.params = client, prompt, params
        self.cur: Admitted | None = admitted
        self.resends = 0

    def cancel(self) -> None:
        """Stop it: aborted on its rank (the group sees it end there)."""
        if self.cur is not None:
            cur, self.cur = self.cur, None
            self.client.deliveries.drop(cur.adm.request_id)
            abort_at_rank(cur.adm, self.client.count)

    def _done(self) -> None:
        """It ended on its rank (or its rank is gone): nothing to abort; the group's call ends by itself."""
        if self.cur is not None:
            self.client.deliveries.drop(self.cur.adm.request_id)
            self.cur = None

    async def deltas(self) -> AsyncIterator[StepOutput]:
        """One delta per pull that brought it tokens (more merged when this consumer falls behind)."""
        got_tokens = False
        while True:
            if self.cur is None:
                self.cur = await self.client.admit(self.prompt, self.params)
            queue = self.cur.queue
            try:
                later: StepOutput | BaseException | None = None  # taken while merging, not yet handled
                while True:
                    item, later = (later, None) if later is not None else (await queue.get(), None)
                    while isinstance(item, StepOutput) and not item.finished and not queue.empty():
                        nxt = queue.get_nowait()
                        if isinstance(nxt, BaseException):
                            later = nxt  # the deltas before it go out first
                            break
                        item = item.then(nxt)
                    if isinstance(item, BaseException):
                        self._done()  # its rank is gone or failed: nothing to abort
                        raise item
                    got_tokens = got_tokens or bool(item.new_token_ids)
                    if item.finished:
                        self._done()
                        if item.error is not None:  # the rank refused it: the caller's error
                            raise RequestError(item.error)
                        yield item
                        return
                    yield item
            except asyncio.CancelledError:
                self.cancel()
                raise
            except GeneratorExit:
                self.cancel()
                raise
            except Exception as e:
                if got_tokens and unavailable(e):  # it cannot go elsewhere now: the failure itself
                    raise self.client.unavailable_error(e, mid_stream=True) from e
                if got_tokens or not unavailable(e) or self.resends >= self.client.max_resends:
                    raise
                self.resends += 1
                self.client.count("request_retried_total")
                self.cur = None
