"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: a request becomes a chat completion body (input
items -> messages, instructions -> a system message, text.format -> response_format, flat function tools -> chat
tools), and the chat answer becomes a Response: a reasoning item, a message item, function_call items, usage in
the Responses names; streamed, the chat chunks become the Responses events (response.created ... response.completed).

Stateless: nothing is stored, so `previous_response_id`, `conversation` and `background` are refused (send the
whole conversation in `input`); every other field is honoured or refused by name, as on the other routes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from mtp_ray.serve.chat_output import call_dropped
from mtp_ray.serve.errors import bad
from mtp_ray.serve.fields import flag

# accepted and ignored, as on the chat route (serve/fields.py IGNORED), plus the Responses API's own bookkeeping
_IGNORED = {"metadata", "store", "user", "service_tier", "prompt_cache_key", "safety_identifier", "truncation"}
# passed to the chat body as they are: the Responses API's own, and the sampling extras vLLM and SGLang take here too
_PASSED = {"model", "temperature", "top_p", "parallel_tool_calls", "stream", "seed", "top_k", "min_p", "stop",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos",
           "min_tokens", "logit_bias"}
_MAPPED = {"input", "instructions", "max_output_tokens", "text", "tools", "tool_choice", "reasoning", "include"}
_REFUSED = {
    "previous_response_id": "this server stores no responses: send the whole conversation in 'input'",
    "conversation": "this server stores no conversations: send the whole conversation in 'input'",
    "background": "background responses are not supported",
    "prompt": "prompt templates are not supported",
}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def front(body: dict, model: str) -> tuple[dict, Shell]:
    """A Responses request -> (its chat body, the Shell that answers it)."""
    return chat_body(body), Shell(body, model)


def chat_body(body: dict) -> dict:
    """A Responses request -> the chat completion body that generates it (400 naming the field it cannot take)."""
    for key, value in body.items():
        if key in _REFUSED and value not in (None, False):
            raise bad(_REFUSED[key], key)
        if key not in _IGNORED | _PASSED | _MAPPED | set(_REFUSED):
            raise bad(f"unknown field '{key}'", key)
    if body.get("truncation") not in (None, "disabled"):
        raise bad("'truncation' must be \"disabled\": a prompt longer than the context is a 400", "truncation")
    if body.get("include"):
        raise bad("'include' is not supported (no output beyond text, reasoning and function calls)", "include")
    out = {k: body[k] for k in _PASSED if body.get(k) is not None}
    out["messages"] = ([{"role": "system", "content": _text(body["instructions"], "instructions")}]
                       if body.get("instructions") is not None else []) + _messages(body.get("input"))
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    fmt = _text_format(body)
    if fmt is not None:
        out["response_format"] = _format(fmt)
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise bad("'tools' must be a list of function tools", "tools")
        out["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                      "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None and (out.get("tools") or choice not in ("auto", "none")):  # the Responses API's default
        out["tool_choice"] = choice  # is "auto" with or without tools; chat takes a choice only beside tools
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary"}:
            raise bad("'reasoning' takes {\"effort\": ...}", "reasoning")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    if flag(out, "stream"):
        out["stream_options"] = {"include_usage": True}
    return out


def _text(value, param: str) -> str:
    if not isinstance(value, str):
        raise bad(f"'{param}' must be a string", param)
    return value


def _content(content, i: int) -> str:
    """A message item's content: a string or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"input[{i}].content must be a string or a list of input_text parts (this model takes text only)",
              "input")


def _messages(items) -> list[dict]:
    """input: a string (one user message) or items: messages, function calls and their outputs (reasoning items of
    earlier turns are dropped, as the chat template drops earlier turns' reasoning)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    msgs: list[dict] = []
    for i, it in enumerate(items):
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message" and isinstance(it.get("role"), str) and it["role"] in ROLES:
            msgs.append({"role": ROLES[it["role"]], "content": _content(it.get("content"), i)})
        elif kind == "function_call" and all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                          "arguments": it["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(it.get("call_id"), str):
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            continue
        else:
            raise bad(f"input[{i}]: expected a message (role user, assistant, system or developer), a "
                      f"function_call or a function_call_output item", "input")
    return msgs


def _text_format(body: dict):
    """text.format (a non-object `text` is returned as it is, for _format to refuse)."""
    text = body.get("text")
    return text.get("format") if isinstance(text, dict) else text


def _format(fmt) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise bad("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
              "\"name\": ..., \"schema\": {...}}", "text")


def _tool(t, i: int) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
        raise bad(f"tools[{i}]: only function tools ({{\"type\": \"function\", \"name\": ..., \"parameters\": ...}}) "
                  f"are supported", "tools")
    return {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                             if t.get(k) is not None}}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens_details": {
                "reasoning_tokens": (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)}}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [_text_part(text)]}


def _call_item(call: dict) -> dict:
    """A chat tool call -> a function_call item."""
    return {"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def _items(reasoning: str | None, content: str | None, calls: list[dict], status: str) -> list[dict]:
    return (([_reasoning_item(_id("rs"), reasoning)] if reasoning else [])
            + ([_message_item(_id("msg"), content, status)] if content else []) + [_call_item(c) for c in calls])


class Shell:
    """The fields of a Response that echo the request, and its id and time."""

    def __init__(self, body: dict, model: str):
        self.id, self.created = _id("resp"), int(time.time())
        self.body, self.model = body, model

    def response(self, status: str, output: list[dict], usage: dict | None, finish: str | None = None) -> dict:
        b = self.body
        fmt = _text_format(b)  # (chat_body refused a text that is no object)
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "model": self.model, "output": output, "usage": usage,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                "parallel_tool_calls": b.get("parallel_tool_calls", True), "tool_choice": b.get("tool_choice", "auto"),
                "tools": b.get("tools") or [], "text": {"format": fmt or {"type": "text"}},
                "reasoning": b.get("reasoning"), "metadata": b.get("metadata"), "previous_response_id": None,
                "store": False, "truncation": "disabled", "user": b.get("user")}

    def convert(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """A chat stream -> the Responses events."""
        return Events(self).convert(chunks)

    def whole(self, chat: dict) -> dict:
        """A chat completion -> the Response."""
        c = chat["choices"][0]
        msg, finish = c["message"], c["finish_reason"]
        output = _items(msg.get("reasoning"), msg.get("content"), msg.get("tool_calls") or [], _status(finish))
        return self.response(_status(finish), output, _usage(chat["usage"]), finish)


class Events:
    """A chat completion stream (its chunks as dicts) -> the Responses stream's events, in order: each output item
    opened, its deltas, closed, before the next; the last event response.completed (or .incomplete) with usage."""

    def __init__(self, shell: Shell):
        self.shell, self.seq = shell, 0
        self.output: list[dict] = []  # closed items
        self.open: dict | None = None  # the item being streamed: {"kind", "id", "text"}
        self.finish: str | None = None

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def opening(self) -> list[str]:
        r = self.shell.response("in_progress", [], None)
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _start(self, kind: str) -> list[str]:
        out = self._close() if self.open is not None and self.open["kind"] != kind else []
        if self.open is not None:
            return out
        self.open = {"kind": kind, "id": _id("rs" if kind == "reasoning" else "msg"), "text": ""}
        i, item_id = len(self.output), self.open["id"]
        if kind == "reasoning":
            return out + [self._event("response.output_item.added", output_index=i, item={
                "id": item_id, "type": "reasoning", "summary": [], "content": []})]
        return out + [
            self._event("response.output_item.added", output_index=i, item={
                "id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}),
            self._event("response.content_part.added", item_id=item_id, output_index=i, content_index=0,
                        part=_text_part(""))]

    def _delta(self, kind: str, text: str) -> list[str]:
        out = self._start(kind)
        assert self.open is not None
        self.open["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self._event(name, item_id=self.open["id"], output_index=len(self.output), content_index=0,
                                  delta=text, **extra)]

    def _close(self) -> list[str]:
        o, self.open = self.open, None
        if o is None:
            return []
        i, text = len(self.output), o["text"]
        if o["kind"] == "reasoning":
            item = _reasoning_item(o["id"], text)
            out = [self._event("response.reasoning_text.done", item_id=o["id"], output_index=i, content_index=0,
                               text=text)]
        elif o["kind"] == "call":  # (closed by the next item, or at the end: a call cut short is incomplete)
            item = {**o["item"], "arguments": text, "status": "incomplete" if self._call_cut() else "completed"}
            out = [self._event("response.function_call_arguments.done", item_id=o["id"], output_index=i,
                               name=item["name"], arguments=text)]
        else:
            item = _message_item(o["id"], text, _status(self.finish))
            out = [self._event("response.output_text.done", item_id=o["id"], output_index=i, content_index=0,
                               text=text, logprobs=[]),
                   self._event("response.content_part.done", item_id=o["id"], output_index=i, content_index=0,
                               part=item["content"][0])]
        self.output.append(item)
        return out + [self._event("response.output_item.done", output_index=i, item=item)]

    def _call(self, call: dict) -> list[str]:
        """A chat tool-call delta: a new call (it has an id) opens a function_call item; one without an id carries
        more arguments of the open call (a forced tool_choice's arguments, streamed as generated). Closed by the next
        item or the end."""
        out: list[str] = []
        if "id" in call:
            out = self._close()
            item = {**_call_item(call), "arguments": ""}
            self.open = {"kind": "call", "id": item["id"], "text": "", "item": item}
            out.append(self._event("response.output_item.added", output_index=len(self.output),
                                   item={**item, "status": "in_progress"}))
        args = call["function"].get("arguments") or ""
        if not args:
            return out
        assert self.open is not None and self.open["kind"] == "call", "arguments without a call"
        self.open["text"] += args
        return out + [self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=len(self.output), delta=args)]

    def _call_cut(self) -> bool:
        """The response ended with a forced call cut short (call_dropped): at max_output_tokens, or a `required`
        one by a stop (it ends "tool_calls" when whole)."""
        choice = self.shell.body.get("tool_choice", "auto")
        return call_dropped("named" if isinstance(choice, dict) else choice,
                            self.finish if self.finish in ("length", "stop") else None)

    def chunk(self, chunk: dict) -> list[str]:
        """One chat chunk -> its events (the usage chunk closes the response)."""
        if "error" in chunk:
            self.finish = "error"
            return [self._event("error", code=chunk["error"].get("code"), message=chunk["error"]["message"],
                                param=chunk["error"].get("param"))]
        out: list[str] = []
        for c in chunk.get("choices") or []:
            d = c.get("delta") or {}
            if d.get("reasoning"):
                out += self._delta("reasoning", d["reasoning"])
            if d.get("content"):
                out += self._delta("message", d["content"])
            for call in d.get("tool_calls") or []:
                out += self._call(call)
            self.finish = c.get("finish_reason") or self.finish
        if chunk.get("usage") is not None and not chunk.get("choices"):
            out += self._close()
            status, output = _status(self.finish), self.output
            if self._call_cut():  # a forced call cut short is no call: the final Response is the whole one's (no
                output = [o for o in output if o["type"] != "function_call"]  # function_call item), though its
                # arguments were streamed as generated
            out.append(self._event(f"response.{status}", response=self.shell.response(
                status, output, _usage(chunk["usage"]), self.finish)))
        return out

    async def convert(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """The chat route's chunks -> the Responses events (no [DONE]: the Responses stream ends with its last
        event)."""
        for e in self.opening():
            yield e
        async for body in chunks:
            for e in self.chunk(body):
                yield e
