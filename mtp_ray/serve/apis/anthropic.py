"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat path, as vLLM, SGLang
and lmdeploy serve it: a request becomes a chat completion body (system -> a system message, content blocks ->
messages, tool_use / tool_result blocks -> tool calls and tool messages, tools and tool_choice -> chat's, thinking ->
enable_thinking), and the chat answer becomes a Message: thinking, text and tool_use blocks, Anthropic's stop_reason
and usage; streamed, the chat chunks become its events (message_start ... message_stop).

Stateless and text only: image / document blocks and server tools are refused by name, as unknown fields are.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from mtp_ray.serve.openai.errors import ApiError, bad
from mtp_ray.serve.openai.field_table import names
from mtp_ray.serve.openai.fields import check_fields
from mtp_ray.serve.openai.ids import new_id

# HTTP status -> Anthropic's error type
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_STOP = {"length": "max_tokens", "tool_calls": "tool_use"}  # chat finish_reason -> stop_reason (else end_turn)


def error_response(e: ApiError) -> JSONResponse:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}, the HTTP status kept."""
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def front(body: dict, model: str) -> tuple[dict, Messages]:
    """A Messages request -> (its chat body, the Messages that answers it)."""
    return chat_body(body), Messages(model)


def chat_body(body: dict, count_only: bool = False) -> dict:
    """A Messages request -> the chat completion body that generates it (400 naming the field it cannot take);
    count_only: count_tokens' request (no max_tokens, no sampling)."""
    route = "count_tokens" if count_only else "messages"
    check_fields(body, route)
    out = {k: body[k] for k in names(route, "pass") if body.get(k) is not None}
    if not count_only:
        if body.get("max_tokens") is None:  # (required by the API: no default to fall back on)
            raise bad("'max_tokens' is required", "max_tokens")
        out["max_completion_tokens"] = body["max_tokens"]
        stop = body.get("stop_sequences")
        if stop is not None:
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise bad("'stop_sequences' must be a list of strings", "stop_sequences")
            out["stop"] = stop
        if out.get("stream"):  # usage in every chunk: message_start names the input tokens, message_delta the rest
            out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    out["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise bad("'tools' must be a list of tools", "tools")
        out["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    out.update(_tool_choice(body.get("tool_choice"), bool(out.get("tools"))))
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
            raise bad("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": n}, {\"type\": \"adaptive\"} or "
                      "{\"type\": \"disabled\"}", "thinking")
        out["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}  # (the budget is not enforced)
    out.update(_output_config(body.get("output_config")))
    if out["messages"][-1]["role"] == "assistant":  # a prefill: the answer continues it
        out.update(add_generation_prompt=False, continue_final_message=True)
    return out


def _output_config(cfg) -> dict:
    """output_config: format (a JSON schema) -> response_format; effort -> the template's reasoning_effort."""
    if cfg is None:
        return {}
    if not isinstance(cfg, dict) or set(cfg) - {"effort", "format"}:
        raise bad("'output_config' takes effort and format", "output_config")
    out = {}
    fmt = cfg.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    effort = cfg.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "xhigh", "max"):
            raise bad("'output_config.effort' must be low, medium, high, xhigh or max", "output_config")
        out["reasoning_effort"] = "xhigh" if effort == "max" else effort
    return out


def _text(block, where: str) -> str:
    if isinstance(block, str):
        return block
    if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
        return block["text"]
    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
    raise bad(f"{where}: a {kind!r} block is not supported here (this model takes text only)", where.split("[")[0])


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, list):
        return [{"role": "system", "content": "".join(_text(b, "system") for b in system)}]
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    raise bad("'system' must be a string or a list of text blocks", "system")


def _messages(msgs) -> list[dict]:
    """Messages of text / tool_use / tool_result (/ thinking: dropped, as the template drops earlier turns'
    reasoning) blocks -> chat messages."""
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out: list[dict] = []
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad(f"messages[{i}]: 'role' must be \"user\" or \"assistant\"", "messages")
        blocks = m.get("content")
        blocks = [{"type": "text", "text": blocks}] if isinstance(blocks, str) else blocks
        if not isinstance(blocks, list):
            raise bad(f"messages[{i}]: 'content' must be a string or a list of content blocks", "messages")
        text, calls = [], []
        for b in blocks:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            if kind == "tool_use" and role == "assistant" and isinstance(b.get("name"), str):
                calls.append({"id": str(b.get("id") or new_id("toolu")), "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and role == "user" and isinstance(b.get("tool_use_id"), str):
                content = b.get("content")
                content = "".join(_text(c, f"messages[{i}]") for c in content) if isinstance(content, list) \
                    else "" if content is None else _text(content, f"messages[{i}]")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content})
            else:
                text.append(_text(b, f"messages[{i}]"))
        if text or calls or not blocks:
            out.append({"role": role, "content": "".join(text) if text or not calls else None,
                        **({"tool_calls": calls} if calls else {})})
    return out


def _tool(t, i: int) -> dict:
    if (not isinstance(t, dict) or t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str)
            or not isinstance(t.get("input_schema"), dict)):
        raise bad(f"tools[{i}]: only client tools ({{\"name\": ..., \"input_schema\": {{...}}}}) are supported",
                  "tools")
    fn = {"name": t["name"], "parameters": t["input_schema"]}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice, has_tools: bool) -> dict:
    """{"type": auto | any | tool | none} -> chat's tool_choice (and parallel_tool_calls)."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    names = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "tool" and isinstance(choice.get("name"), str):
        picked: str | dict = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in names:
        picked = names[kind]
    else:
        raise bad("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                  "{\"type\": \"tool\", \"name\": ...}", "tool_choice")
    if not has_tools:
        return {} if picked in ("auto", "none") else {"tool_choice": picked}  # (chat refuses a forced one: no tools)
    out = {"tool_choice": picked}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _usage(u: dict) -> dict:
    """Anthropic counts the prompt tokens read from the cache apart from input_tokens."""
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _stop(finish: str | None, stop_reason, called: bool) -> tuple[str, str | None]:
    """chat finish_reason, vLLM's stop_reason (the stop string that ended it) and whether a tool_use block came ->
    (stop_reason, stop_sequence); a named call ends "stop" on chat (as OpenAI's) but is tool_use here."""
    if finish == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish == "stop" and called:
        return "tool_use", None
    return _STOP.get(finish or "", "end_turn"), None


def _tool_use(call: dict) -> dict | None:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        return None  # (a call cut short is no call)
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {"value": args}}


class Messages:
    """One Messages request: its id and model; the chat answer -> the Message, or its stream's events."""

    def __init__(self, model: str):
        self.id, self.model = new_id("msg"), model
        self.index = -1  # the content block being streamed
        self.open: str | None = None  # its kind: thinking, text, tool_use
        self.finish: str | None = None
        self.stop_reason = None
        self.started = False
        self.called = False  # a tool_use block was streamed

    def message(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def whole(self, chat: dict) -> dict:
        """A chat completion -> the Message."""
        c = chat["choices"][0]
        msg = c["message"]
        blocks = ([{"type": "thinking", "thinking": msg["reasoning"], "signature": ""}] if msg.get("reasoning")
                  else []) + ([{"type": "text", "text": msg["content"]}] if msg.get("content") else [])
        blocks += [b for b in map(_tool_use, msg.get("tool_calls") or []) if b is not None]
        called = any(b["type"] == "tool_use" for b in blocks)
        return self.message(blocks, _stop(c["finish_reason"], c.get("stop_reason"), called), _usage(chat["usage"]))

    @staticmethod
    def _event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=self.index)]

    def _block(self, kind: str, start: dict | None = None) -> list[str]:
        """Open a block of this kind (closing another; a tool_use block always opens anew)."""
        if self.open == kind and start is None:
            return []
        out = self._close()
        self.index += 1
        self.open = kind
        block = start or ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                          else {"type": "text", "text": ""})
        return out + [self._event("content_block_start", index=self.index, content_block=block)]

    def chunk(self, chunk: dict) -> list[str]:
        """One chat chunk -> its events."""
        if "error" in chunk:
            return [self._event("error", error={"type": "api_error", "message": chunk["error"]["message"]})]
        out: list[str] = []
        # message_start comes with the first chunk past the chat's role chunk, which precedes the engine's word on
        # the prompt's cached tokens (the start's usage would differ from the end's)
        cs = chunk.get("choices") or []
        opening = bool(cs) and not any(c.get("finish_reason") or any((c.get("delta") or {}).get(k) for k in (
            "reasoning", "content", "tool_calls")) for c in cs)
        if not self.started and chunk.get("usage") is not None and not opening:
            self.started = True
            out.append(self._event("message_start", message=self.message([], (None, None), {
                **_usage({**chunk["usage"], "completion_tokens": 0})})))
        for c in chunk.get("choices") or []:
            d = c.get("delta") or {}
            if d.get("reasoning"):
                out += self._block("thinking") + [self._event("content_block_delta", index=self.index, delta={
                    "type": "thinking_delta", "thinking": d["reasoning"]})]
            if d.get("content"):
                out += self._block("text") + [self._event("content_block_delta", index=self.index, delta={
                    "type": "text_delta", "text": d["content"]})]
            for call in d.get("tool_calls") or []:
                if "id" in call:
                    self.called = True
                    out += self._block("tool_use", {"type": "tool_use", "id": call["id"],
                                                    "name": call["function"]["name"], "input": {}})
                if call["function"].get("arguments"):
                    out.append(self._event("content_block_delta", index=self.index, delta={
                        "type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
            if c.get("finish_reason"):
                self.finish, self.stop_reason = c["finish_reason"], c.get("stop_reason")
        if chunk.get("usage") is not None and not chunk.get("choices"):  # the last chunk: the whole usage
            stop_reason, stop_sequence = _stop(self.finish, self.stop_reason, self.called)
            out += self._close() + [
                self._event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            usage=_usage(chunk["usage"])),
                self._event("message_stop")]
        return out

    async def convert(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """The chat route's chunks -> the Messages events (no [DONE]: the stream ends with message_stop)."""
        async for body in chunks:
            for e in self.chunk(body):
                yield e
