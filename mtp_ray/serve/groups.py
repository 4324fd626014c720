"""GroupClient: how the ingress reaches the engine groups (the group deployment's replicas).

A request is admitted by some group within the queue timeout or gets a 503 naming the cause: a group that cannot
serve answers GroupUnavailable at once (serve/routing.py steers new requests away from it) and the request is sent
again, to whichever group Serve picks next, until one admits it or the time is up. A request whose group fails
after admitting it but before its first token is sent again the same way; one that already streamed tokens ends
with the group's error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.runtime.group_monitor import GroupFailed, GroupUnavailable
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
    def __init__(self, handle, queue_s: float, retry_after_s: int, on_resend: Callable[[], None] = lambda: None,
                 max_resends: int = 3):
        self.handle = handle
        self.queue_s, self.retry_after_s, self.max_resends = queue_s, retry_after_s, max_resends
        self.on_resend = on_resend  # a request is sent again because its group could not serve it (metrics)

    def unavailable_error(self, cause: BaseException | str) -> ApiError:
        text = first_line(cause_of(cause)) if isinstance(cause, BaseException) else cause
        return ApiError(503, f"no engine group can serve the request right now: {text}",
                        headers={"Retry-After": str(self.retry_after_s)})

    async def admit(self, prompt: list[int], params: SamplingParams):
        """A response generator whose group has admitted the request (its first item, the empty admission delta,
        is consumed here). Raises ApiError 503 (with Retry-After) when no group admits it within queue_s."""
        deadline = time.monotonic() + self.queue_s
        cause: BaseException | str = f"none admitted the request within {self.queue_s:g}s"
        delay = 0.05
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.unavailable_error(cause)
            gen = self.handle.options(stream=True).stream.remote(prompt, params, None)
            try:
                first = await asyncio.wait_for(gen.__anext__(), left)
            except asyncio.TimeoutError:
                gen.cancel()
                raise self.unavailable_error(cause) from None
            except asyncio.CancelledError:  # the client went away while it was being admitted: abort it there too
                gen.cancel()
                raise
            except Exception as e:
                gen.cancel()
                if not unavailable(e):
                    raise
                cause = e
                self.on_resend()
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(2 * delay, 0.5)
                continue
            assert isinstance(first, StepOutput) and not first.new_token_ids, "the admission delta comes first"
            return gen

    async def open(self, prompt: list[int], params: SamplingParams) -> GroupStream:
        """A request admitted by some group (or ApiError 503): its deltas through `GroupStream.deltas`."""
        return GroupStream(self, prompt, params, await self.admit(prompt, params))


class GroupStream:
    """One admitted request's deltas; sent again (to whichever group admits it) when its group fails before the
    first token."""

    def __init__(self, client: GroupClient, prompt: list[int], params: SamplingParams, gen):
        self.client, self.prompt, self.params, self.gen = client, prompt, params, gen
        self.resends = 0

    def cancel(self) -> None:
        """Stop it: Serve cancels the group's generator, which aborts the request on its rank."""
        if self.gen is not None:
            self.gen.cancel()

    async def deltas(self) -> AsyncIterator[StepOutput]:
        got_tokens = False
        while True:
            if self.gen is None:
                self.gen = await self.client.admit(self.prompt, self.params)
            try:
                async for out in self.gen:
                    got_tokens = got_tokens or bool(out.new_token_ids)
                    yield out
                return
            except asyncio.CancelledError:
                self.cancel()
                raise
            except Exception as e:
                if got_tokens or not unavailable(e) or self.resends >= self.client.max_resends:
                    raise
                self.resends += 1
                self.client.on_resend()
                self.gen = None
