"""One choice's accumulated state and the OpenAI response / stream-chunk / error bodies built from it."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from mtp_ray.engine.detok import Detokenizer
from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.serve.openai_protocol import ApiError


@dataclass
class Choice:
    index: int
    prompt: list[int]
    detok: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list] = field(default_factory=list)  # per token: [[token id, logprob], ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spec: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)  # the engine's queue / prefill / decode / inference seconds
    sent_lp: int = 0  # logprob entries already streamed
    sent_finish: bool = False
    echo: str = ""  # the prompt's text, sent before the completion's (completions with echo)

    def add(self, out: StepOutput) -> None:
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.top += [list(t.items()) for t in out.new_top_logprobs]
        self.detok.add(out.new_token_ids)
        if out.finished and self.finish_reason is None:
            stopped = self.detok.stopped_by
            self.finish_reason = "stop" if stopped is not None else out.finish_reason
            self.stop_reason = stopped if stopped is not None else out.stop_reason
            self.spec = out.spec or {}
            self.timings = out.timings or {}

    @property
    def pending_logprobs(self) -> bool:
        return len(self.logprobs) > self.sent_lp


def _tok(tok, t: int) -> str:
    return tok.decode([t])


def completion_logprobs(c: Choice, tok, start: int, top_n: int, offset0: int) -> dict:
    toks = [_tok(tok, t) for t in c.token_ids[start : len(c.logprobs)]]
    offsets, off = [], offset0
    for s in toks:
        offsets.append(off)
        off += len(s)
    return {"tokens": toks, "token_logprobs": c.logprobs[start:],
            "top_logprobs": [{_tok(tok, t): lp for t, lp in top[:top_n]} for top in c.top[start:]],
            "text_offset": offsets}


def chat_logprobs(c: Choice, tok, start: int, top_n: int) -> dict:
    def entry(t: int, lp: float) -> dict:
        s = _tok(tok, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top[:top_n]]}
                        for t, lp, top in zip(c.token_ids[start:], c.logprobs[start:], c.top[start:])]}


def chunk(rid: str, model: str, created: int, chat: bool, c: Choice, text: str = "", role: bool = False,
          top_n: int | None = None, tok=None) -> dict:
    lp = None
    if top_n is not None and c.pending_logprobs and tok is not None:
        lp = chat_logprobs(c, tok, c.sent_lp, top_n) if chat else completion_logprobs(
            c, tok, c.sent_lp, top_n, len(c.detok.text) - len(text))
        c.sent_lp = len(c.logprobs)
    finish = None
    if c.finish_reason is not None and not c.sent_finish and not role:
        finish, c.sent_finish = c.finish_reason, True
    if chat:
        delta = {"role": "assistant", "content": ""} if role else {"content": text}
        body = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            body["stop_reason"] = c.stop_reason
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [body]}
    body = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}
    if finish is not None:
        body["stop_reason"] = c.stop_reason
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [body]}


def final_response(rid: str, model: str, chat: bool, choices: list[Choice], req, tok) -> dict:
    n_prompt = sum(len(p) for p in req.prompts)
    n_gen = sum(len(c.token_ids) for c in choices)
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        lp = None
        if req.top_logprobs is not None:
            lp = chat_logprobs(c, tok, 0, req.top_logprobs) if chat else completion_logprobs(
                c, tok, 0, req.top_logprobs, 0)
        if chat:
            out.append({"index": c.index, "message": {"role": "assistant", "content": c.detok.text},
                        "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        else:
            out.append({"index": c.index, "text": c.echo + c.detok.text, "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": out,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}}


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def choice_params(p: SamplingParams, index: int) -> SamplingParams:
    """One choice's own request (n = 1): a seeded request's choices draw from seed, seed + 1, ... (wrapping at
    2**64, so every seed the parameters accept stays valid)."""
    seed = p.seed if p.seed is None else p.seed + index % p.n
    return dataclasses.replace(p, n=1, seed=seed - 2**64 if seed is not None and seed >= 2**64 else seed)
