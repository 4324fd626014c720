"""From a parsed request to its HTTP answer: every choice admitted by a group (or a beam search run first), then
streamed as server-sent events or gathered into one body; a request of another API (the Responses API, Anthropic's
Messages) has its front convert either, and its errors keep that API's shape."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse

from mtp_ray.serve.cluster.groups import GroupClient
from mtp_ray.serve.cluster.metrics import Metrics
from mtp_ray.serve.http.beams import beam_streams
from mtp_ray.serve.http.choices import ChoiceRunner
from mtp_ray.serve.openai.bodies import choice_params, final_response, sse_stream
from mtp_ray.serve.openai.choice import new_choices
from mtp_ray.serve.openai.errors import ApiError
from mtp_ray.serve.openai.request import ParsedRequest
from mtp_ray.serve.openai.streaming import ChunkWriter


class Front(Protocol):
    """Another API served through the chat route: the chat answer -> its own (serve/apis/responses_out.py: Shell,
    serve/apis/anthropic.py: Messages)."""

    def whole(self, chat: dict) -> dict: ...

    def convert(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]: ...


class Answerer:
    def __init__(self, groups: GroupClient, runner: ChoiceRunner, metrics: Metrics, tok, serving, model_name: str):
        self.groups, self.runner, self.metrics = groups, runner, metrics
        self.tok, self.serving, self.model_name = tok, serving, model_name

    async def respond(self, req: ParsedRequest, chat: bool, info: dict, t_in: float, front: Front | None,
                      refused: Callable[[ApiError], Response]) -> Response:
        """The answer to a parsed and checked request; info: the group's model facts; refused: an error's answer
        (counted, in the route's shape)."""
        self.metrics.admitted(req.params.n, req.params.max_tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices = new_choices(req, self.tok, self.serving)
        t0 = time.monotonic()
        self.metrics.hist["ingress_parse_seconds"].observe(t0 - t_in)
        # every choice admitted by a group before the response starts: a 503 is a status, not an SSE error event
        try:
            if req.beam is not None:  # the whole search runs first (serve/http/beams.py), as vLLM's
                opened = await beam_streams(self.groups, req, info)
            else:
                opened = await self.groups.open_each([(c.prompt, choice_params(req.params, c.index))
                                                      for c in choices])
        except asyncio.CancelledError:  # the client went away (those admitted were aborted)
            self.metrics.count("request_aborted_total")
            raise
        except Exception as e:
            return refused(e if isinstance(e, ApiError) else self.groups.classify(e))
        self.metrics.hist["ingress_admit_seconds"].observe(time.monotonic() - t0)
        streams = dict(zip((c.index for c in choices), opened, strict=True))
        if req.stream:
            w = ChunkWriter(rid, self.model_name, req, choices, chat, self.tok)
            chunks = self.runner.events(w, choices, streams, t0)
            return StreamingResponse(front.convert(chunks) if front else sse_stream(chunks),
                                     media_type="text/event-stream")
        try:
            await asyncio.gather(*[self.runner.drive(c, streams[c.index], None, t0) for c in choices])
        except Exception as e:
            return refused(e if isinstance(e, ApiError) else self.groups.classify(e))
        out = final_response(rid, self.model_name, chat, choices, req, self.tok)
        return JSONResponse(front.whole(out) if front else out)
