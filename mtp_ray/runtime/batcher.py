"""CallBatcher: items bound for one callee, sent in as few calls as possible; `detached`: a task whose actor calls
belong to no request.

The first item goes out at once; items that arrive while a call is in flight go together in the next call (no
timer, so an idle engine sees no added latency). Why: a Ray actor task costs the rank process ~0.3 ms of
GIL-holding CPU, time its engine thread loses; `python bench/submit.py` (2-core dev machine): a burst of 512
requests as 512 `add` calls took 139-163 ms of the rank's CPU, through this batcher 2-9 ms. Its users: the group's
`add_many` calls to its ranks (runtime/group.py: one result for the whole call), the ingress's admission calls to
the groups (serve/cluster/admissions.py: Admissions; a result per item, a result nobody waits for any more
aborted, calls server.admission_gap_ms apart: a Serve call costs more than the group's part of an admission).

An idle batcher's call is issued inside `submit` itself, not from a task made there: such a task runs a whole
event-loop pass later, behind every request handler that pass runs (on the H200 host, 128 arriving requests: ~50 ms
a pass, so the first admission left with the burst's last request instead of its first, and the engine sat idle
meanwhile).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


def detached(coro: Coroutine) -> asyncio.Task:
    """`coro` as a task outside the calling request's Ray task context. Ray records each actor call as a child of the
    request (the actor task) it was made in, and cancelling a request (Serve does, ray.cancel with recursive=True,
    when a client goes away or a stop string ends a stream) cancels its children that have not run yet: the abort the
    request's own clean-up sends to its rank (lost so in ~1 of 12 disconnects: the rank decoded on to max_tokens), or
    a batched call carrying other requests. Ray keeps that context in a contextvar; a fresh Context has none."""
    task = contextvars.Context().run(asyncio.get_running_loop().create_task, coro)
    _LIVE.add(task)  # the loop holds tasks weakly: a fire-and-forget one could be collected before it ran
    task.add_done_callback(_LIVE.discard)
    return task


_LIVE: set[asyncio.Task] = set()


class CallBatcher:
    """Items in as few `send` calls as possible: the first at once, those that arrive while a call is in flight
    together in the next. `send(items)` issues the call when called (a Ray `.remote()`, or a coroutine function:
    then when awaited) and returns an awaitable of None (every item's result is None) or one result per item; an
    exception it raises is every item's. An item whose future is done before its call leaves (its submitter
    stopped waiting) is not sent; `orphan` gets the result of one that was sent meanwhile (to undo it).
    `gap_s`: the next call leaves gap_s after the one before, returned or not (where a call costs more than it
    carries: fewer, fuller calls, and a slow call holds nothing back); None: the next leaves when the one in flight
    returned. `ways()`: how many calls a batch is split into, sent together (callees behind a router: each call may
    go to another one)."""

    def __init__(self, send: Callable[[list[Any]], Awaitable[list[Any] | None]],
                 gap_s: float | None = None, orphan: Callable[[Any], None] | None = None,
                 ways: Callable[[], int] | None = None):
        self.send = send  # called with every pending item; looked up per call (a restarted group's new actor)
        self.gap_s = gap_s
        self.orphan = orphan
        self.ways = ways
        self.pending: list[tuple[Any, asyncio.Future]] = []
        self.busy = False
        self.calls = 0  # calls made (tests, stats)

    def submit(self, item: Any) -> asyncio.Future:
        """A future of `item`'s result, set once a call carrying it returned (its exception if that call raised).
        Cancelling it (or the task awaiting it) drops the item if its call has not left yet; on an idle batcher
        the call has left when this returns."""
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((item, fut))
        if not self.busy:
            self.busy = True
            try:
                first = self._leave()
            except BaseException:  # (send's Exceptions are the items'; anything else is the submitter's, at once)
                self.busy = False
                raise
            detached(self._drain(first))  # its calls may carry other requests: no one request's cancel may cancel it
        return fut

    def _leave(self) -> asyncio.Task | None:
        """One call with every pending item still wanted (or `ways()` calls sharing them), issued now; the task that
        hands out their results."""
        batch, self.pending = [p for p in self.pending if not p[1].done()], []
        if not batch:  # (their submitters all stopped waiting)
            return None
        n = min(len(batch), max(1, self.ways() if self.ways is not None else 1))
        settles = []
        for part in (batch[i::n] for i in range(n)):
            self.calls += 1
            try:  # issued outside the submitting request's Ray task context, as a detached task's would be
                answer = contextvars.Context().run(self.send, [item for item, _ in part])
            except Exception as e:
                answer = _raise(e)
            settles.append(self._settle(part, answer))
        return detached(settles[0] if n == 1 else _all(settles))

    async def _drain(self, call: asyncio.Task | None) -> None:
        """After the first call: the next ones, each with whatever queued meanwhile, until none queued."""
        try:
            while True:
                if self.gap_s is not None:
                    await asyncio.sleep(self.gap_s)
                elif call is not None:
                    await call  # (never raises: _settle hands its errors to the items)
                if not self.pending:
                    return
                call = self._leave()
        finally:
            self.busy = False

    async def _settle(self, batch: list[tuple[Any, asyncio.Future]], answer: Awaitable) -> None:
        try:
            results = await answer
        except Exception as e:  # every item of the failed call gets the error; later ones still go
            for _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, f), r in zip(batch, itertools.repeat(None) if results is None else results):
            if not f.done():
                f.set_result(r)
            elif self.orphan is not None:  # its submitter stopped waiting while the call was in flight
                self.orphan(r)


async def _raise(e: Exception) -> None:
    raise e


async def _all(coros: list[Coroutine]) -> None:
    await asyncio.gather(*coros)
