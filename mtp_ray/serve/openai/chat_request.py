"""Chat completions requests: messages (tool calls and tool results in the history), tools and tool_choice, the
chat template's options (chat_template_kwargs, add_generation_prompt, continue_final_message), and what the
response's parsers need to know (ChatOptions)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from mtp_ray.engine.chat_content import content_text
from mtp_ray.serve.openai.fields import unicode_text
from mtp_ray.serve.openai.limits import NO_LIMITS, Limits, for_body, prompt_text
from mtp_ray.serve.openai.request import ALL, NO_TOKENIZER, ParsedRequest, bad, flag, int_field, parse_common
from mtp_ray.serve.openai.structured import tool_call_schema
from mtp_ray.serve.parsers.reasoning import THINK_CLOSE, THINK_OPEN, opens_reasoning

# template arguments a request may not set through chat_template_kwargs: the server sets them
_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "return_dict",
             "add_generation_prompt", "continue_final_message", "tokenizer_kwargs", "return_assistant_tokens_mask"}


@dataclass
class ChatOptions:
    """How a chat response is read back: reasoning split off, tool calls parsed (auto) or forced by a grammar."""

    tools: list[dict] | None = None
    tool_choice: str = "none"  # "none" | "auto" | "required" | "named"
    tool_name: str | None = None  # the named function
    opens_reasoning: bool = False  # the prompt ends inside a <think> block
    reasoning: bool = False  # split reasoning_content off the text (a reasoning parser is configured)
    include_reasoning: bool = True  # vLLM's include_reasoning: false drops it from the response
    echo: str = ""  # echo: the final assistant message's content, which the reply continues (vLLM)
    stream_reasoning: bool = True  # SGLang's: false streams the reasoning as one delta once it has ended
    parallel_tool_calls: bool = True  # false: one call at most (forced: by the grammar; auto: the first parsed)


@dataclass(frozen=True)
class ChatServing:
    """The server's chat settings (config/server.py)."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # the <think> / </think> token ids where each is one token of the vocabulary: usage counts reasoning tokens
    think_ids: tuple[int, int] | None = None


def think_ids(tok) -> tuple[int, int] | None:
    """The ids of <think> and </think> where the tokenizer has each as one token (None: it has not, or no
    tokenizer)."""
    if tok is None:
        return None
    ids = [tok.encode(tag, add_special_tokens=False) for tag in (THINK_OPEN, THINK_CLOSE)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def _content(c: Any, i: int, limits: Limits) -> str:
    try:
        text = content_text(c, f"messages[{i}].content")
    except ValueError as e:
        raise bad(str(e), "messages") from None
    return "" if text is None else prompt_text(text, "messages", limits)


def _tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's tool_calls, arguments as an object where they are one (templates iterate them)."""
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad(f"messages[{i}].tool_calls: each call needs a function with a 'name'", "messages")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
                args = parsed if isinstance(parsed, dict) else args
            except ValueError:
                pass  # not JSON: the template renders the string as it is
        elif not isinstance(args, dict):
            raise bad(f"messages[{i}].tool_calls: arguments must be a JSON string or an object", "messages")
        out.append({"id": c.get("id"), "type": "function", "function": {"name": unicode_text(f["name"], "messages"),
                                                                        "arguments": args}})
    return out


def messages(msgs: Any, limits: Limits) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    clean, chars = [], 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        role = unicode_text(m["role"], "messages")  # any role goes to the template, which may refuse it (vLLM)
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content(m.get("content"), i, limits)}
        if m.get("tool_calls") not in (None, []):  # ([]: a reply of ours sent back as history)
            if role != "assistant":
                raise bad(f"messages[{i}]: only assistant messages carry tool_calls", "messages")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = unicode_text(m[key], "messages")
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if isinstance(reasoning, str) and role == "assistant":
            msg["reasoning_content"] = unicode_text(reasoning, "messages")
        clean.append(msg)
        chars += len(msg["content"])
        if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:  # before the template runs
            raise bad(f"'messages' are too long: {chars} characters of content (through messages[{i}]) are more "
                      "tokens than the model's context holds", "messages")
    return clean


def _tools(body: dict) -> tuple[list[dict] | None, str, str | None]:
    tools = body.get("tools")
    if tools is not None and tools != []:
        ok = isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            and isinstance(t["function"].get("parameters", {}), dict) for t in tools)
        if not ok:
            raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}",
                      "tools")
    tools = tools or None
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none", None
    if tools is None:
        if choice == "none":  # nothing to call anyway (vLLM takes it too)
            return None, "none", None
        raise bad("When using `tool_choice`, `tools` must be set: 'tool_choice' other than \"none\" is only "
                  "allowed when 'tools' are given", "tool_choice")
    if choice in ("none", "auto", "required"):
        return tools, choice, None
    if (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        return tools, "named", choice["function"]["name"]
    raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
              "{\"name\": ...}}", "tool_choice")


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning_effort values


def template_kwargs(body: dict) -> dict:
    kw = body.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    reserved = sorted(set(kw) & _RESERVED)
    if reserved:
        raise bad(f"'chat_template_kwargs' may not set {reserved}: they are request fields", "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad(f"'reasoning_effort' must be one of {', '.join(EFFORTS)}", "reasoning_effort")
        # to the template; "none" also turns thinking off, unless chat_template_kwargs says (as vLLM's)
        kw = {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {}), **kw}
    return kw


def render_chat(body: dict, tokenizer, limits: Limits = NO_LIMITS) -> tuple[str, list[dict] | None, str, str | None]:
    """The prompt text from the chat template -> (text, tools, tool_choice kind, named function)."""
    if tokenizer is None:
        raise bad(NO_TOKENIZER, "messages")
    msgs = messages(body.get("messages"), limits)
    tools, choice, name = _tools(body)
    cont = flag(body, "continue_final_message", False)
    gen = flag(body, "add_generation_prompt", not cont)
    if cont and gen:
        raise bad("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                  "continue_final_message")
    if cont and msgs[-1]["role"] != "assistant":
        raise bad("'continue_final_message' needs an assistant message last", "continue_final_message")
    kwargs = template_kwargs(body)
    try:
        text = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False,
                                             continue_final_message=cont, **kwargs)
    except Exception as e:  # a template that rejects the roles / order
        raise bad(f"chat template failed: {e}", "messages") from e
    return text, tools, choice, name


def parse_chat(body: dict, tokenizer, limits: Limits = NO_LIMITS, serving: ChatServing = ChatServing()
               ) -> ParsedRequest:
    limits = for_body(limits, body)
    text, tools, choice, name = render_chat(body, tokenizer, limits)
    if choice == "auto" and serving.tool_call_parser is None:
        raise bad("\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set (vLLM's "
                  "words; here: set server.tool_call_parser to hermes or qwen3_coder), or send tool_choice \"none\"",
                  "tool_choice")
    parallel = flag(body, "parallel_tool_calls", True)
    schema, _ = tool_call_schema(tools or [], body.get("tool_choice") if choice != "auto" else None, parallel)
    ids = tokenizer.encode(text, add_special_tokens=flag(body, "add_special_tokens", False))
    lp_on = flag(body, "logprobs", False)
    top = body.get("top_logprobs")
    int_field(body, "top_logprobs", 0, minus_one=ALL)
    if top and not lp_on:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    req = parse_common(body, [ids], [text], "max_completion_tokens", (top or 0) if lp_on else None, limits,
                       tool_schema=schema)
    req.params.update_from_tokenizer(tokenizer)  # bad_words -> token sequences, as vLLM's
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        req.params.max_tokens = None  # chat default: up to the context length
    reasoning = serving.reasoning_parser is not None and flag(body, "separate_reasoning", True)
    so = req.params.structured_outputs
    if so is not None and serving.reasoning_parser is not None and opens_reasoning(text):
        # thinking on: the reasoning stays free, the answer after </think> is constrained (vLLM's behaviour)
        req.params.structured_outputs = dataclasses.replace(so, after=THINK_CLOSE)
    last = body["messages"][-1]
    echo = _content(last.get("content"), 0, limits) if flag(body, "echo", False) and last["role"] == "assistant" \
        else ""
    req.chat = ChatOptions(tools, choice, name, opens_reasoning(text), reasoning,
                           flag(body, "include_reasoning", True), echo, flag(body, "stream_reasoning", True), parallel)
    req.echo = bool(echo)
    return req
