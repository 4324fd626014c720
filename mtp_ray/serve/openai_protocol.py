"""OpenAI request parsing and validation (completions and chat), vLLM's extra sampling fields included.
Every problem is an ApiError with the OpenAI error body; nothing here touches the engine."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mtp_ray.engine.sampling_params import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.type = type_ or {400: "invalid_request_error", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
            status, "internal_error")
        self.code = code if code is not None else status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_DIGITS = re.compile(r"[0-9]+")  # str.isdigit() also takes "²", which int() refuses

# body field -> (SamplingParams field, accepted python types)
SAMPLING_FIELDS: dict[str, tuple[str, tuple]] = {
    "temperature": ("temperature", (int, float)), "top_p": ("top_p", (int, float)), "top_k": ("top_k", (int,)),
    "min_p": ("min_p", (int, float)), "seed": ("seed", (int,)), "n": ("n", (int,)),
    "repetition_penalty": ("repetition_penalty", (int, float)), "stop_token_ids": ("stop_token_ids", (list,)),
    "presence_penalty": ("presence_penalty", (int, float)), "frequency_penalty": ("frequency_penalty", (int, float)),
    "ignore_eos": ("ignore_eos", (bool,)), "min_tokens": ("min_tokens", (int,)),
    "skip_special_tokens": ("skip_special_tokens", (bool,)),
    "include_stop_str_in_output": ("include_stop_str_in_output", (bool,)),
}

@dataclass
class ParsedRequest:
    prompts: list[list[int]]  # one or more token-id prompts (completions may batch)
    prompt_texts: list[str | None]
    params: SamplingParams
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs in the response
    echo: bool = False  # completions: the prompt's text goes before each choice's text


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (config/server.py), checked before any engine work."""

    max_n: int = 64
    max_stop: int = 64
    max_prompts: int = 256
    max_prompt_chars: int | None = None  # a longer prompt string certainly exceeds max_model_len (not tokenised)


NO_LIMITS = Limits()


def _text(s: str, field: str) -> str:
    """A string the tokenizer can take: UTF-8 encodable (JSON can carry lone surrogates, which it cannot)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"'{field}' is not valid Unicode text (a lone surrogate at position {e.start})", field) from None
    return s


def _check_type(body: dict, key: str, types: tuple) -> Any:
    v = body[key]
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
    if not ok:
        raise bad(f"'{key}' must be of type {' or '.join(t.__name__ for t in types)}, got {type(v).__name__}", key)
    return v


def sampling_params(body: dict, max_tokens_key: str, logprobs: int | None, limits: Limits = NO_LIMITS
                    ) -> SamplingParams:
    kw: dict[str, Any] = {}
    for key, (field_name, types) in SAMPLING_FIELDS.items():
        if body.get(key) is not None:
            kw[field_name] = _check_type(body, key, types)
    for key in (max_tokens_key, "max_tokens"):
        if body.get(key) is not None:
            kw["max_tokens"] = _check_type(body, key, (int,))
            break
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("'stop' must be a string or a list of strings", "stop")
        if len(stop) > limits.max_stop:
            raise bad(f"'stop' may hold at most {limits.max_stop} strings, got {len(stop)}", "stop")
        kw["stop"] = [_text(s, "stop") for s in stop if s]
    n = kw.get("n")
    if n is not None and n > limits.max_n:
        raise bad(f"'n' must be at most {limits.max_n}, got {n}", "n")
    bias = body.get("logit_bias")
    if bias is not None:  # JSON keys are strings: {"token id": bias}
        if not isinstance(bias, dict) or not all(isinstance(k, str) and _DIGITS.fullmatch(k.strip()) for k in bias):
            raise bad("'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", "logit_bias")
        kw["logit_bias"] = {int(k): v for k, v in bias.items()}
    _refuse_unsupported(body)
    if logprobs is not None:
        kw["logprobs"] = logprobs
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise bad(str(e), getattr(e, "param", None)) from e


def _refuse_unsupported(body: dict) -> None:
    """OpenAI fields this server cannot honour are a 400, never silently ignored (that would change the output)."""
    if body.get("suffix"):
        raise bad("'suffix' is not supported", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of not in (1, body.get("n") or 1):
        raise bad("'best_of' other than n is not supported", "best_of")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("'response_format': structured output is not supported (only {\"type\": \"text\"})",
                  "response_format")
    if body.get("tools") and body.get("tool_choice", "auto") != "none":
        raise bad("tool calling is not supported: with 'tools', set tool_choice to 'none' (the tools are then "
                  "rendered into the prompt by the chat template and the reply is plain text)", "tool_choice")


def _stream_opts(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return stream, bool(opts.get("include_usage", False))


def parse_completion(body: dict, tokenizer, limits: Limits = NO_LIMITS) -> ParsedRequest:
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                                   for t in p)):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        items = p
    else:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                  "prompt")
    if len(items) > limits.max_prompts:
        raise bad(f"'prompt' may hold at most {limits.max_prompts} prompts, got {len(items)}", "prompt")
    prompts, texts = [], []
    for it in items:
        if isinstance(it, str):
            ids = tokenizer.encode(_prompt_text(it, "prompt", limits), add_special_tokens=False)
            texts.append(it)
        elif isinstance(it, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in it):
            ids = list(it)
            texts.append(None)
        else:
            raise bad("each prompt must be a string or a list of integer token ids", "prompt")
        if not ids:
            raise bad("prompt must not be empty", "prompt")
        prompts.append(ids)
    lp = body.get("logprobs")
    if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= 20):
        raise bad("'logprobs' must be an integer in 0..20", "logprobs")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad("'echo' must be a boolean", "echo")
    if echo and lp is not None:
        raise bad("'echo' with 'logprobs' is not supported (it needs the prompt's log-probs)", "echo")
    stream, usage = _stream_opts(body)
    return ParsedRequest(prompts, texts, sampling_params(body, "max_tokens", lp, limits), stream, usage, lp, echo)


def _prompt_text(s: str, field: str, limits: Limits) -> str:
    if limits.max_prompt_chars is not None and len(s) > limits.max_prompt_chars:
        raise bad(f"'{field}' is too long: {len(s)} characters are more tokens than the model's context holds",
                  field)
    return _text(s, field)


def parse_chat(body: dict, tokenizer, limits: Limits = NO_LIMITS) -> ParsedRequest:
    if body.get("echo"):
        raise bad("'echo' is not supported for chat completions", "echo")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            c = "".join(x["text"] for x in c)
        if c is None:
            c = ""
        if not isinstance(c, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        clean.append({"role": _text(m["role"], "messages"), "content": _prompt_text(c, "messages", limits)})
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad("'tools' must be a list of objects", "tools")
    try:
        text = tokenizer.apply_chat_template(clean, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template that rejects the roles / order
        raise bad(f"chat template failed: {e}", "messages") from e
    ids = tokenizer.encode(text, add_special_tokens=False)
    lp_on = body.get("logprobs", False)
    if not isinstance(lp_on, bool):
        raise bad("'logprobs' must be a boolean for chat completions", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
        raise bad("'top_logprobs' must be an integer in 0..20", "top_logprobs")
    n_top = (top or 0) if lp_on else None
    stream, usage = _stream_opts(body)
    params = sampling_params(body, "max_completion_tokens", n_top, limits)
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        params.max_tokens = None  # chat default: up to the context length
    return ParsedRequest([ids], [text], params, stream, usage, n_top)


def check_length(ids: list[int], params: SamplingParams, max_model_len: int) -> None:
    """vLLM's context-length rule: prompt + max_tokens must fit (max_tokens None: whatever is left)."""
    want = len(ids) + (params.max_tokens or 1)
    if len(ids) >= max_model_len or want > max_model_len:
        raise bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested {want} "
                  f"tokens ({len(ids)} in the prompt, {params.max_tokens or 1} in the completion). Please reduce "
                  f"the length of the prompt or the completion.", "max_tokens" if len(ids) < max_model_len
                  else "prompt")
