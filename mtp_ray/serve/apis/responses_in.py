"""The Responses API's request side (`POST /v1/responses`): a Responses request -> the chat completion body that
generates it (input items -> messages, instructions -> a system message, text.format -> response_format, flat
function tools -> chat tools); every field honoured or refused by name (serve/apis/responses_out.py answers it)."""

from __future__ import annotations

import json

from mtp_ray.serve.openai.chat_request import EFFORTS
from mtp_ray.serve.openai.errors import bad
from mtp_ray.serve.openai.field_table import names
from mtp_ray.serve.openai.fields import check_fields, flag

_PASSED = names("responses", "pass")  # to the chat body as they are (field_table.py)
# `include` values: the message text's log-probs (honoured), encrypted reasoning (nothing is encrypted here: the
# reasoning items carry their text, so there is nothing to add)
_INCLUDES = {"message.output_text.logprobs", "reasoning.encrypted_content"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def chat_body(body: dict) -> dict:
    """A Responses request -> the chat completion body that generates it (400 naming the field it cannot take)."""
    check_fields(body, "responses")  # (truncation: "disabled" only)
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(v, str) and v in _INCLUDES for v in include):
        raise bad(f"'include' takes {sorted(_INCLUDES)} (no other output is made here)", "include")
    out = {k: body[k] for k in _PASSED if body.get(k) is not None}
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= 20):
        raise bad("'top_logprobs' must be an integer from 0 to 20", "top_logprobs")
    if "message.output_text.logprobs" in include or top:
        out.update(logprobs=True, top_logprobs=top or 0)
    out["messages"] = ([{"role": "system", "content": _text(body["instructions"], "instructions")}]
                       if body.get("instructions") is not None else []) + _messages(body.get("input"))
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    fmt = text_format(body)
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
            if reasoning["effort"] not in EFFORTS:
                raise bad(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}", "reasoning")
            # asking for an effort asks for reasoning: thinking on unless "none" (the chat side turns it off) or
            # chat_template_kwargs says otherwise (the chat route passes the effort to the template only, as vLLM's)
            out["reasoning_effort"] = reasoning["effort"]
            kw = body.get("chat_template_kwargs")
            if reasoning["effort"] != "none" and (kw is None or isinstance(kw, dict)):
                out["chat_template_kwargs"] = {"enable_thinking": True, **(kw or {})}
    if flag(out, "stream"):
        out["stream_options"] = {"include_usage": True}
    return out


def _text(value, param: str) -> str:
    if not isinstance(value, str):
        raise bad(f"'{param}' must be a string", param)
    return value


def _content(content, where: str) -> str:
    """A message item's content or a tool output (`where`, for the 400): a string or text parts (input_text,
    output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"{where} must be a string or a list of input_text parts (this model takes text only)",
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
            msgs.append({"role": ROLES[it["role"]], "content": _content(it.get("content"), f"input[{i}].content")})
        elif kind == "function_call" and all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                          "arguments": it["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(it.get("call_id"), str):
            out = it.get("output")
            # a string, or parts (input_text; an image or file part is refused as text-only); other JSON as text
            text = _content(out, f"input[{i}].output") if isinstance(out, (str, list)) else json.dumps(out)
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": text})
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":  # (a client that assumes store: true sends earlier items by id)
            raise bad(f"input[{i}]: this server stores no items: send the item itself, not an item_reference",
                      "input")
        else:
            raise bad(f"input[{i}]: expected a message (role user, assistant, system or developer), a "
                      f"function_call, function_call_output or reasoning item", "input")
    return msgs


def text_format(body: dict):
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
