"""GroupClient: how the ingress reaches the engine groups (the group deployment's replicas).

Admission is a call to a group (`GroupDeployment.admit`, routed by Serve); the request's outputs then come from
its rank straight to this replica (serve/delivery.py). A request is admitted by some group within the queue
timeout or gets a 503 naming the cause: a group that cannot serve answers GroupUnavailable at once
(serve/routing.py steers new requests away from it) and the request is sent again, to whichever group Serve picks
next, until one admits it or the time is up. A request whose group fails after admitting it but before its first
token is sent again the same way; one that already streamed tokens ends with the group's error."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.runtime.group_monitor import GroupFailed, GroupUnavailable
from mtp_ray.runtime.messages import Admission, RequestError
from mtp_ray.serve.delivery import Deliveries
from mtp_ray.serve.errors import ApiError

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


class GroupClient:
    def __init__(self, handle, queue_s: float, retry_after_s: int, count: Callable[[str], None] = lambda _: None,
                 max_resends: int = 3, stream_interval_s: float = 0.0):
        self.handle = handle
        self.streaming = handle.options(stream=True)  # (made once: options() builds a new handle each call)
        self.deliveries = Deliveries(stream_interval_s)
        self.queue_s, self.retry_after_s, self.max_resends = queue_s, retry_after_s, max_resends
        self.count = count  # metrics: request_retried_total (sent again: its group could not serve it)

    def unavailable_error(self, cause: BaseException | str) -> ApiError:
        text = first_line(cause_of(cause)) if isinstance(cause, BaseException) else cause
        return ApiError(503, f"no engine group can serve the request right now: {text}",
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
            call = self.streaming.admit.remote(prompt, params, rid, self.deliveries.subscriber)
            try:
                adm = await asyncio.wait_for(call.__anext__(), left)
            except asyncio.TimeoutError:
                self._abandon(rid, call)
                raise self.unavailable_error(cause) from None
            except asyncio.CancelledError:  # the client went away while it was being admitted: abort it there too
                self._abandon(rid, call)
                raise
            except Exception as e:
                self._abandon(rid, call)
                if not unavailable(e):
                    raise
                cause = e
                self.count("request_retried_total")
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(2 * delay, 0.5)
                continue
            assert isinstance(adm, Admission) and adm.request_id == rid
            self.deliveries.attach(adm)
            return Admitted(adm, call, queue)

    def _abandon(self, rid: str, call) -> None:
        """Serve cancels the admission call: the group aborts the request if its rank took it already."""
        self.deliveries.drop(rid)
        call.cancel()

    async def open(self, prompt: list[int], params: SamplingParams) -> GroupStream:
        """A request admitted by some group (or ApiError 503): its deltas through `GroupStream.deltas`."""
        return GroupStream(self, prompt, params, await self.admit(prompt, params))


@dataclass
class Admitted:
    """An admitted request on the ingress side: where it runs, the group's call that stays open while it runs
    (cancelling it aborts the request), the queue its deltas arrive in."""

    adm: Admission
    call: Any  # Serve's DeploymentResponseGenerator of GroupDeployment.admit
    queue: asyncio.Queue


class GroupStream:
    """One admitted request's deltas; sent again (to whichever group admits it) when its group fails before the
    first token."""

    def __init__(self, client: GroupClient, prompt: list[int], params: SamplingParams, admitted: Admitted):
        self.client, self.prompt, self.params = client, prompt, params
        self.cur: Admitted | None = admitted
        self.resends = 0

    def cancel(self) -> None:
        """Stop it: Serve cancels the group's admission call, which aborts the request on its rank."""
        if self.cur is not None:
            cur, self.cur = self.cur, None
            self.client.deliveries.drop(cur.adm.request_id)
            cur.call.cancel()

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
                if got_tokens or not unavailable(e) or self.resends >= self.client.max_resends:
                    raise
                self.resends += 1
                self.client.count("request_retried_total")
                self.cur = None
