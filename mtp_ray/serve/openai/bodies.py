"""The OpenAI bodies built from choices (serve/openai/choice.py): a response, a stream chunk, usage; the SSE
events they go out as."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator

from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.serve.openai.chat_output import ChatDelta, call_id
from mtp_ray.serve.openai.choice import Choice
from mtp_ray.serve.openai.logprob_sections import Render
from mtp_ray.serve.openai.request import ParsedRequest


def usage(req: ParsedRequest, choices: list[Choice], whole: bool = True) -> dict:
    """The usage section; whole: the response's or its last chunk's, with the prompt's details and the reasoning
    token count (which scans the output), as vLLM's; not whole: a chunk's usage so far (continuous usage stats)."""
    n_prompt = sum(len(p) for p in req.prompts)
    n_gen = 0 if req.drop_output else sum(len(c.token_ids) for c in choices)
    out = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
    # per prompt, the most any of its n samples found cached (0: caching off); in a chunk's usage once known
    if req.prompt_details and (whole or any(c.cached_tokens is not None for c in choices)):
        n = req.params.n  # choices i * n .. i * n + n - 1 are prompt i's (new_choices)
        per_prompt = [max((c.cached_tokens or 0) for c in choices[i : i + n]) for i in range(0, len(choices), n)]
        out["prompt_tokens_details"] = {"cached_tokens": sum(per_prompt)}
    if whole and choices and choices[0].chat is not None and choices[0].chat.parses_reasoning:  # as OpenAI
        thought = 0 if req.drop_output else sum(c.reasoning_tokens() for c in choices)
        out["completion_tokens_details"] = {"reasoning_tokens": thought}
        out["reasoning_tokens"] = thought  # SGLang's name for it (its clients read usage.reasoning_tokens)
    return out


def _tool_calls(calls, first: int = 0, stream: bool = False) -> list[dict]:
    return [{**({"index": first + i} if stream else {}), "id": call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


def _finish(c: Choice, has_calls: bool) -> str | None:
    if (has_calls and c.finish_reason == "stop" and c.chat is not None and c.chat.opts.tool_choice != "named"
            and not c.chat.no_call(c.cut)):  # (a streamed call cut by a stop string: no call after all)
        return "tool_calls"
    return c.finish_reason


def chunk(rid: str, model: str, created: int, c: Choice, r: Render, text: str = "", role: bool = False,
          delta: ChatDelta | None = None, logprobs: bool = True) -> dict:
    """A stream chunk of one choice: its new text (or, for chat, the parsed delta) and the log-probs not yet sent
    (logprobs=False: they wait for the next chunk)."""
    req, chat = r.req, delta is not None or role
    lp = None
    if logprobs and req.top_logprobs is not None and c.pending_logprobs:
        if chat:
            lp = r.chat_logprobs(c, c.sent_lp)
        else:
            lp, c.lp_offset = r.completion_logprobs(c, c.sent_lp, c.lp_offset, False)
        c.sent_lp = len(c.logprobs)
    finish = None
    if c.finish_reason is not None and not c.sent_finish and not role:
        finish, c.sent_finish = c.finish_reason, True
    body: dict = {"index": c.index}
    if chat:
        if role:
            d: dict = {"role": "assistant", "content": ""}
        else:
            d = {}
            if delta.reasoning:
                d["reasoning"] = d["reasoning_content"] = delta.reasoning  # vLLM's name, and the older one
            if delta.content or not (delta.reasoning or delta.tool_calls or delta.tool_args):
                d["content"] = delta.content
            calls = []
            if delta.tool_args:  # the open call's next arguments: its index only (OpenAI's stream format)
                calls.append({"index": c.calls_sent - 1, "function": {"arguments": delta.tool_args}})
            if delta.tool_calls:
                calls += _tool_calls(delta.tool_calls, c.calls_sent, stream=True)
                c.calls_sent += len(delta.tool_calls)
            if calls:
                d["tool_calls"] = calls
        if c.chat is not None and c.chat.parses_reasoning:
            # SGLang's clients read every delta's reasoning_content unguarded, vLLM's tests add up whatever a
            # present reasoning / reasoning_content holds: "" beside content, and no `reasoning` key there
            d.setdefault("reasoning_content", "")
        body.update(delta=d, logprobs=lp, finish_reason=finish if finish is None else _finish(c, c.calls_sent > 0))
    else:
        body.update(text=text, logprobs=lp, finish_reason=finish)
    if finish is not None:
        body["stop_reason"], body["matched_stop"] = c.stop_reason, c.matched_stop
    top: dict = {}
    if req.return_token_ids and role:  # chat: the prompt's ids at the top of a choice's first (role) chunk (vLLM)
        top["prompt_token_ids"] = c.prompt
    elif req.return_token_ids:
        if c.sent_ids == 0 and not chat:
            body["prompt_token_ids"] = c.prompt  # the first chunk of a choice (vLLM)
        body["token_ids"] = c.token_ids[max(c.sent_ids, 0) :]
        c.sent_ids = len(c.token_ids) or -1  # -1: the prompt ids went out
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [body], **top}


def final_response(rid: str, model: str, chat: bool, choices: list[Choice], req: ParsedRequest, tok) -> dict:
    r = Render(tok, req)
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        text = "" if req.drop_output else c.detok.text
        if chat:
            lp = r.chat_logprobs(c, 0) if req.top_logprobs is not None else None
            cut = c.cut
            reasoning, content, calls = c.chat.whole(text, cut) if c.chat is not None else (None, text, [])
            if c.echo:
                content = c.echo + (content or "")
            if calls and content is None and c.chat is not None and c.chat.opts.tool_choice == "named":
                content = ""  # vLLM: a named call's message has empty content
            # every field of the openai client's message, as vLLM's (its test_invocations compares the client's
            # model_dump with the JSON); tool_calls [] without calls (a forced call cut short too, as vLLM's tests ask)
            msg: dict = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                         "audio": None, "function_call": None, "tool_calls": _tool_calls(calls)}
            # vLLM's name and the older one, null when not split off (SGLang's clients read the key unguarded)
            msg["reasoning"] = msg["reasoning_content"] = reasoning
            body = {"index": c.index, "message": msg, "logprobs": lp, "finish_reason": _finish(c, bool(calls)),
                    "stop_reason": c.stop_reason, "matched_stop": c.matched_stop}
        else:
            lp = None
            if req.top_logprobs is not None:
                if req.drop_output:
                    c = dataclasses.replace(c, token_ids=[], logprobs=[], top=[])
                lp = r.completion_logprobs(c, 0, 0, req.echo)[0]
            body = {"index": c.index, "text": c.echo + text, "logprobs": lp, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason, "matched_stop": c.matched_stop,
                    "prompt_logprobs": r.prompt_logprobs(c)}
            body["prompt_token_ids"] = c.prompt if req.return_token_ids else None
        body["token_ids"] = ([] if req.drop_output else c.token_ids) if req.return_token_ids else None
        out.append(body)
    resp = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage(req, choices), "service_tier": None,
            "system_fingerprint": None}  # (null fields of the openai client's models, as vLLM's: see msg above)
    if chat:
        resp["metadata"] = resp["moderation"] = None
        first = min(choices, key=lambda c: c.index)
        resp["prompt_logprobs"] = r.prompt_logprobs(first)
        resp["prompt_token_ids"] = first.prompt if req.return_token_ids else None
    return resp


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """A streamed completion's chunks as the route's server-sent events, to `data: [DONE]`. A stream's closing
    events (a chunk whose every choice finished, the usage chunk) are held and go out with what follows them, which
    comes at once: each write is one message through Serve's proxy (~0.6 ms of CPU in the ingress and the proxy
    together, whatever its size, on a 2-core probe), so a request's end takes one write instead of up to three."""
    held = ""
    async for body in chunks:
        event = sse_event(body)
        if _closing(body):
            held += event
            continue
        yield held + event
        held = ""
    yield held + "data: [DONE]\n\n"


def _closing(body: dict) -> bool:
    """A chunk after which the stream ends (n = 1) or only other choices' chunks follow: every choice in it
    finished, or it is the usage chunk (no choices)."""
    choices = body.get("choices")
    if not isinstance(choices, list):
        return False
    if not choices:
        return "usage" in body
    return all(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices)


def choice_params(p: SamplingParams, index: int) -> SamplingParams:
    """One choice's own request (n = 1; SamplingParams.child: seeds seed, seed + 1, ...)."""
    return p.child(index)
