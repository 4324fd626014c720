"""The chunks of one streamed response, as dicts: the opening chunks (chat roles, echoed prompts), a chunk per
choice's progress (text or parsed chat delta, log-probs, token ids, the finish), the closing usage chunk. They are
serialized once, at the edge: as server-sent events of the route (bodies.sse_stream), or turned into another
stream's events first (the Responses API: serve/apis/responses_out.py, Events)."""

from __future__ import annotations

import dataclasses
import time

from mtp_ray.serve.openai.bodies import chunk, usage
from mtp_ray.serve.openai.chat_output import ChatDelta
from mtp_ray.serve.openai.choice import Choice
from mtp_ray.serve.openai.logprob_sections import Render
from mtp_ray.serve.openai.request import ParsedRequest


class ChunkWriter:
    def __init__(self, rid: str, model: str, req: ParsedRequest, choices: list[Choice], chat: bool, tok):
        self.rid, self.model, self.req, self.choices, self.chat = rid, model, req, choices, chat
        self.created = int(time.time())
        self.r = Render(tok, req)
        # echo with logprobs: the prompt's log-probs arrive with the first output, so its echo chunk waits for it
        self.echo_lp = req.echo and req.top_logprobs is not None

    def _event(self, body: dict) -> dict:
        if self.req.continuous_usage:  # vLLM's continuous_usage_stats: usage so far in every chunk
            body["usage"] = usage(self.req, self.choices, whole=False)
        return body

    def _chunk(self, c: Choice, **kw) -> dict:
        return chunk(self.rid, self.model, self.created, c, self.r, **kw)

    def opening(self) -> list[dict]:
        out = [self._event(self._chunk(c, role=True)) for c in self.choices] if self.chat else []
        for c in self.choices:  # echo: the prompt's text (chat: the continued message) first
            if c.echo and not self.echo_lp:
                out.append(self._event(self._chunk(c, text=c.echo,
                                                   delta=ChatDelta(content=c.echo) if self.chat else None)))
        return out

    def progress(self, c: Choice) -> list[dict]:
        """A choice advanced (or ended): its chunk, if there is anything to say."""
        out, req = [], self.req
        if self.echo_lp and c.echo:
            body = self._chunk(c, text=c.echo, logprobs=False)  # the prompt's; the output's follow
            body["choices"][0]["logprobs"], c.lp_offset = self.r.completion_logprobs(
                dataclasses.replace(c, token_ids=[], logprobs=[], top=[]), 0, 0, True)
            c.echo = ""
            out.append(self._event(body))
        done = c.finish_reason is not None
        text = "" if req.drop_output else c.detok.delta(done)
        delta = c.chat.feed(text, done, c.cut) if c.chat is not None else None
        lp_due = req.top_logprobs is not None and c.pending_logprobs and not req.drop_output
        has = (bool(delta.content or delta.reasoning or delta.tool_calls or delta.tool_args) if delta is not None
               else bool(text))
        if has or lp_due or (done and not c.sent_finish):
            out.append(self._event(self._chunk(c, text=text, delta=delta)))
        return out

    def closing(self) -> list[dict]:
        if not self.req.include_usage:
            return []
        return [{"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": [], "usage": usage(self.req, self.choices)}]
