"""Where a request's per-step outputs go once the group's poll loop has unpacked them.

StreamSink: one StepOutput per step for a consumer that streams (`EngineGroup.generate`). Collector: the
outputs are appended in the poll loop itself and the consumer wakes once, when the request finishes (the rollout
handle returns whole results). Why: with 256 sequences per rank every step wakes 256 streaming coroutines; at
dp = 2 that is ~4 ms of the group process's CPU per ~8 ms step (`bench/dp.py`), against ~0.3 ms appended in place.
RemoteSink: a subscriber pulls the outputs from the rank itself (the HTTP ingress, runtime/outboxes.py); the
group only hears that the request ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from mtp_ray.engine.outputs import StepOutput


class Sink(Protocol):
    def put(self, out: StepOutput) -> None: ...

    def fail(self, err: BaseException) -> None: ...


class StreamSink:
    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()  # StepOutput, or the exception that ends the request
        self.ended = False  # its last output was taken, or what ended it was raised

    def put(self, out: StepOutput) -> None:
        self.queue.put_nowait(out)

    def fail(self, err: BaseException) -> None:
        self.queue.put_nowait(err)

    async def deltas(self) -> AsyncIterator[StepOutput]:
        """The request's outputs to its last: one per step, or, when the consumer falls behind (each delta a Serve
        stream item costs the replica CPU), everything that arrived since its last one in one delta, so that under
        load the stream carries fewer, larger deltas instead of a backlog. Raises what ended the request."""
        later: StepOutput | BaseException | None = None  # taken from the queue while coalescing, not yet handled
        while True:
            item, later = (later, None) if later is not None else (await self.queue.get(), None)
            while isinstance(item, StepOutput) and not item.finished and not self.queue.empty():
                nxt = self.queue.get_nowait()
                if isinstance(nxt, BaseException):
                    later = nxt  # the deltas before it go out first
                    break
                item = item.then(nxt)
            if isinstance(item, BaseException):
                self.ended = True
                raise item
            self.ended = item.finished
            yield item
            if item.finished:
                return


class Collector:
    """A whole request: token ids and their log-probs in order, and its last output (finish reason, stop reason,
    MTP stats, error). `done` resolves when the request finished, or raises what ended it."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []
        self.top_log_probs: list[dict[int, float]] = []  # per token, when the request asked for logprobs = n
        self.prompt_log_probs: list | None = None  # with prompt_logprobs: StepOutput.prompt_logprobs
        self.last: StepOutput | None = None
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def put(self, out: StepOutput) -> None:
        self.token_ids += out.new_token_ids
        self.log_probs += out.new_logprobs
        self.top_log_probs += out.new_top_logprobs
        if out.prompt_logprobs is not None and self.prompt_log_probs is None:
            self.prompt_log_probs = out.prompt_logprobs
        if out.finished:
            self.last = out
            if not self.done.done():
                self.done.set_result(None)

    def fail(self, err: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(err)


class RemoteSink:
    def __init__(self) -> None:
        self.ended = asyncio.Event()

    def put(self, out: StepOutput) -> None:
        if out.finished:
            self.ended.set()

    def fail(self, err: BaseException) -> None:  # the group failed: its ranks are killed, the subscriber's pulls fail
        self.ended.set()
