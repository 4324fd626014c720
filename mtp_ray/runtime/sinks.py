"""Where a request's per-step rows go once the group's poll loop has unpacked them.

StreamSink: one StepOutput per step for a consumer that streams (HTTP, `EngineGroup.generate`). Collector: the rows
are appended in the poll loop itself and the consumer wakes once, when the request finishes (the rollout handle
returns whole results). Why: with 256 sequences per rank every step wakes 256 streaming coroutines; at dp = 2 that
is ~4 ms of the group process's CPU per ~8 ms step (`bench/dp.py`), against ~0.3 ms appended in place.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from mtp_ray.runtime.messages import Row, row_output


class Sink(Protocol):
    def put_row(self, row: Row) -> None: ...

    def fail(self, err: BaseException) -> None: ...


class StreamSink:
    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()  # StepOutput, or the exception that ends the request

    def put_row(self, row: Row) -> None:
        self.queue.put_nowait(row_output(row))

    def fail(self, err: BaseException) -> None:
        self.queue.put_nowait(err)


class Collector:
    """A whole request: token ids and their log-probs in order, and its last row (finish reason, stop reason,
    MTP stats). `done` resolves when the request finished, or raises what ended it."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []
        self.last: Row | None = None
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def put_row(self, row: Row) -> None:
        self.token_ids += row[1]
        self.log_probs += row[2]
        if row[4]:  # finished
            self.last = row
            if not self.done.done():
                self.done.set_result(None)

    def fail(self, err: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(err)

    @property
    def finish_reason(self) -> str | None:
        return self.last[5] if self.last is not None else None

    @property
    def stop_reason(self) -> int | str | None:
        return self.last[6] if self.last is not None else None

    @property
    def spec(self) -> dict | None:
        return self.last[8] if self.last is not None else None
