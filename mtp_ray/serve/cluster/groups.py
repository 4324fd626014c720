"""GroupClient: how the ingress reaches the engine groups (the group deployment's replicas).

Admission is a call to a group (`GroupDeployment.admit_batch`, routed by Serve) carrying every request that reached this
replica since its previous admission call left, server.admission_gap_ms before (serve/cluster/admissions.py, a
batcher.py CallBatcher: a Serve call costs ~1.5 ms of routing and replica work, so a burst of 128 calls took ~160-250 ms
where one call carrying them takes 5 ms, bench/serve_calls.py); the requests' outputs then come from their ranks
straight to this replica (serve/cluster/delivery.py). A request is admitted by some group within the queue timeout or
gets a 503 naming the cause: a group that cannot serve answers GroupUnavailable at once (serve/cluster/routing.py steers
new requests away from it) and the request is sent again, to whichever group Serve picks next, until one admits it or
the time is up. A request whose group fails after admitting it but before its first token is sent again the same way;
one that already streamed tokens ends with the group's error."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ray.exceptions import TaskCancelledError
from starlette.requests import ClientDisconnect

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.runtime.batcher import detached
from mtp_ray.runtime.messages import Admission, AdmitItem, ModelError, request_error
from mtp_ray.serve.cluster.admissions import Admissions, abort_at_rank
from mtp_ray.serve.cluster.delivery import Deliveries
from mtp_ray.serve.cluster.failures import cause_of, first_line, unavailable
from mtp_ray.serve.openai.errors import ApiError, bad

log = logging.getLogger("mtp_ray.ingress")

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
        # what a 503 names when no group took a request in time: the last group failure this replica saw (when, its
        # first line), and whether any group has answered it at all
        self.last_failure: tuple[float, str] | None = None
        self.seen_group = False

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
            raise self.unavailable_error(f"no engine group answered within {self.queue_s:g}s; {self.why_none()}"
                                         ) from None
        except Exception as e:
            if unavailable(e):
                raise self.unavailable_error(e) from None
            raise

    async def _ask_info(self) -> dict:
        info = await self.handle.info.remote()
        self.seen_group = True
        return info

    def why_none(self) -> str:
        """Why no group took a request: the last failure seen here, else that none is up yet, else that they are
        busy (the 503's cause, issue 64: "none admitted" alone sent operators to the logs)."""
        if self.last_failure is not None:
            return f"the last group failure seen here ({time.monotonic() - self.last_failure[0]:.0f}s ago): " \
                   f"{self.last_failure[1]}"
        if not self.seen_group:
            return "no engine group is up yet (starting, or waiting for resources)"
        return "every engine group is busy or restarting"

    def unavailable_error(self, cause: BaseException | str, mid_stream: bool = False) -> ApiError:
        """503 + Retry-After; mid_stream (tokens sent: it cannot go elsewhere): the failure's first line alone
        ("engine group failed, request aborted; ... Cause: rank 0 died: ...")."""
        text = first_line(cause_of(cause)) if isinstance(cause, BaseException) else cause
        if isinstance(cause, BaseException):
            self.last_failure = (time.monotonic(), text)
        return ApiError(503, text if mid_stream else f"no engine group can serve the request right now: {text}",
                        headers={"Retry-After": str(self.retry_after_s)})

    def classify(self, e: BaseException) -> ApiError:
        """Engine-side exceptions -> HTTP errors: bad input (ValueError, RequestError) 400, a group that cannot serve
        503 (first line of the cause: which rank, what happened), a client gone 499, the model's failure (ModelError)
        500 with its message, anything else 500 with a reference to the log."""
        if unavailable(e):
            return self.unavailable_error(e)
        cause = cause_of(e)
        if isinstance(cause, (ClientDisconnect, TaskCancelledError)):  # its client went away (Serve cancels it)
            return ApiError(499, "the client closed the request", type_="client_closed_request")
        if isinstance(cause, ValueError):
            return bad(first_line(cause), getattr(cause, "param", None))
        if isinstance(cause, ModelError):  # the model's output, not a fault of the server's: said as it is
            return ApiError(500, first_line(cause))
        ref = uuid.uuid4().hex[:12]  # the details go to the log, not to the client
        log.error("internal error %s: %s: %s", ref, type(cause).__name__, cause, exc_info=cause)
        return ApiError(500, f"internal error (reference {ref} in the server log)")

    async def admit(self, prompt: list[int], params: SamplingParams) -> Admitted:
        """The request admitted on some group's rank. Raises ApiError 503 (with Retry-After) when no group admits it
        within queue_s."""
        deadline = time.monotonic() + self.queue_s
        cause: BaseException | str = f"none admitted the request within {self.queue_s:g}s; {self.why_none()}"
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
            self.seen_group = True
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
                        if item.error is not None:  # the rank refused it (the caller's error) or the model failed
                            raise request_error(item)
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
