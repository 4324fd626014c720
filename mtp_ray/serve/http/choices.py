"""ChoiceRunner: drives each choice of a response through its deltas (metrics, detokenisation, stop strings,
early aborts) and turns a streamed response's progress into its chunks. One choice (most requests)
goes from its deltas to chunks in the response's own task; n > 1 choices run as tasks feeding one queue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from mtp_ray.serve.cluster.groups import GroupStream
from mtp_ray.serve.cluster.metrics import Metrics
from mtp_ray.serve.openai.choice import Choice
from mtp_ray.serve.openai.errors import ApiError
from mtp_ray.serve.openai.streaming import ChunkWriter


class ChoiceRunner:
    def __init__(self, metrics: Metrics, classify: Callable[[BaseException], ApiError]):
        self.metrics = metrics
        self.classify = classify  # engine-side exceptions -> the HTTP error (Ingress.classify)

    async def advance(self, c: Choice, stream: GroupStream, t0: float) -> AsyncIterator[None]:
        """Runs one choice to its end, yielding after each delta it took in (text, log-probs, the finish)."""
        last, counted = t0, False
        self.metrics.running += 1
        deltas = stream.deltas()
        try:
            async for out in deltas:
                now = time.monotonic()
                if out.new_token_ids:
                    if not c.token_ids:
                        self.metrics.ttft.observe(now - t0)
                    else:
                        self.metrics.itl.observe((now - last) / len(out.new_token_ids))
                    last = now
                c.add(out)
                if c.detok.stopped_by is not None and not out.finished:
                    c.finish_reason, c.stop_reason = "stop", c.detok.stopped_by
                    stream.cancel()  # aborts the request on its rank
                yield
                if c.finish_reason is not None:
                    break
            self.metrics.e2e.observe(time.monotonic() - t0)
            self.metrics.finished(len(c.prompt), len(c.token_ids), c.spec, c.finish_reason, c.timings)
            counted = True
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (the stream aborts its request)
            self.metrics.count("request_aborted_total")
            raise
        finally:
            if not counted:  # aborted or failed: its tokens were computed and sent all the same (vLLM counts them)
                self.metrics.tokens(len(c.prompt), len(c.token_ids))
            self.metrics.running -= 1
            await deltas.aclose()  # a consumer that stopped early: the request is aborted on its rank

    async def drive(self, c: Choice, stream: GroupStream, queue: asyncio.Queue | None, t0: float) -> None:
        """Runs one choice to its end; with a queue, puts the choice there after each delta."""
        async for _ in self.advance(c, stream, t0):
            if queue is not None:
                queue.put_nowait(c)

    async def events(self, w: ChunkWriter, choices: list[Choice], streams: dict[int, GroupStream], t0: float
                     ) -> AsyncIterator[dict]:
        """A streamed response's chunks (dicts, serialized by the caller); an error after the response started is an
        error chunk (its status in the body)."""
        try:
            for event in w.opening():
                yield event
            if len(choices) == 1:  # (most requests) its deltas straight to events: no task and queue in between
                c = choices[0]
                one = self.advance(c, streams[c.index], t0)
                try:
                    async for _ in one:
                        for event in w.progress(c):
                            yield event
                finally:
                    await one.aclose()
            else:
                async for event in self._interleaved(w, choices, streams, t0):
                    yield event
            for event in w.closing():
                yield event
        except Exception as e:
            err = e if isinstance(e, ApiError) else self.classify(e)
            self.metrics.count(f'request_failed_total{{status="{err.status}"}}')
            yield err.body()

    async def _interleaved(self, w: ChunkWriter, choices: list[Choice], streams: dict[int, GroupStream], t0: float):
        """n > 1: every choice driven by a task of its own, their chunks in the order the deltas arrive."""
        queue: asyncio.Queue = asyncio.Queue()

        async def drive(c: Choice) -> None:
            try:
                await self.drive(c, streams[c.index], queue, t0)
                queue.put_nowait(("done", c))
            except Exception as e:
                queue.put_nowait(("error", e))

        tasks = [asyncio.create_task(drive(c)) for c in choices]
        live = len(choices)
        try:
            while live:
                item = await queue.get()
                if isinstance(item, tuple):
                    kind, val = item
                    if kind == "error":
                        raise val
                    live -= 1
                    c = val
                else:
                    c = item
                for event in w.progress(c):
                    yield event
        finally:
            for t in tasks:
                t.cancel()
