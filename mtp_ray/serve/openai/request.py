"""OpenAI request parsing and validation (completions and chat), vLLM's extra sampling fields included.
Every problem is an ApiError with the OpenAI error body; nothing here touches the engine."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mtp_ray.beam_search import BeamSearchParams
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.serve.openai.beam_request import beam_request
from mtp_ray.serve.openai.errors import bad
from mtp_ray.serve.openai.field_table import SAMPLING_FIELDS
from mtp_ray.serve.openai.fields import flag, unicode_text
from mtp_ray.serve.openai.limits import NO_LIMITS, Limits, for_body, prompt_text
from mtp_ray.serve.openai.structured import constraint

ALL = "the whole vocabulary"  # what logprobs -1 asks for (vLLM's)
_DIGITS = re.compile(r"[0-9]+")  # str.isdigit() also takes "²", which int() refuses


@dataclass
class ParsedRequest:
    prompts: list[list[int]]  # one or more token-id prompts (completions may batch)
    prompt_texts: list[str | None]
    params: SamplingParams
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs in the response
    echo: bool = False  # the prompt's text goes before each choice's text
    continuous_usage: bool = False  # usage in every stream chunk
    prompt_details: bool = False  # usage.prompt_tokens_details (cached tokens) in the response's whole usage
    return_token_ids: bool = False  # prompt_token_ids / token_ids in the response
    tokens_as_ids: bool = False  # logprob tokens as "token_id:<id>"
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the prompt's log-probs in the response
    drop_output: bool = False  # echo with max_tokens 0: the prompt only (one token is generated and dropped)
    stop_regex: list[str] = field(default_factory=list)  # SGLang's: a match ends the output like a stop string
    beam: BeamSearchParams | None = None  # use_beam_search (serve/openai/beam_request.py): n beams instead of n samples
    chat: Any = None  # chat_request.ChatOptions for chat completions


NO_TOKENIZER = ("this model has no tokenizer files: send prompts as token ids to /v1/completions and read 'token_ids' "
                "in the response, or set engine.tokenizer to a tokenizer directory")


def ids_only(req: ParsedRequest) -> None:
    """A model without a tokenizer: the response carries token ids (its text stays empty, logprob tokens are
    "token_id:<id>"); what needs text is refused rather than silently never matching."""
    if req.params.stop:
        raise bad("'stop' strings need a tokenizer and this model has none: use 'stop_token_ids'", "stop")
    if req.stop_regex:
        raise bad("'stop_regex' needs a tokenizer and this model has none: use 'stop_token_ids'", "stop_regex")
    if req.params.structured_outputs is not None:
        raise bad("structured outputs need a tokenizer and this model has none", "structured_outputs")
    if req.params.bad_words:
        raise bad("'bad_words' need a tokenizer and this model has none", "bad_words")
    req.return_token_ids = req.tokens_as_ids = True


def _check_type(body: dict, key: str, types: tuple) -> Any:
    if types == (bool,):  # as pydantic's lax mode reads a boolean (fields.flag)
        return flag(body, key)
    v = body[key]
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
    if not ok:
        raise bad(f"'{key}' must be of type {' or '.join(t.__name__ for t in types)}, got {type(v).__name__}", key)
    return v


def sampling_params(body: dict, max_tokens_key: str, logprobs: int | None, limits: Limits = NO_LIMITS,
                    tool_schema: dict | None = None) -> SamplingParams:
    kw: dict[str, Any] = {k: v for k, v in limits.defaults.items() if k != "max_tokens"}
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
        kw["stop"] = [unicode_text(s, "stop") for s in stop if s]
    words = kw.get("bad_words")  # (each is matched against the output at every step: bounded as stop strings are)
    if isinstance(words, list) and len(words) > limits.max_stop:
        raise bad(f"'bad_words' may hold at most {limits.max_stop} words, got {len(words)}", "bad_words")
    n = kw.get("n")
    if n is not None and n > limits.max_n:
        raise bad(f"'n' must be at most {limits.max_n}, got {n}", "n")
    bias = body.get("logit_bias")
    if bias is not None:  # JSON keys are strings: {"token id": bias}
        if not isinstance(bias, dict):
            raise bad("'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", "logit_bias")
        wrong = [k for k in bias if not (isinstance(k, str) and _DIGITS.fullmatch(k.strip()))]
        if wrong:
            raise bad(f"'logit_bias' keys must be token ids; not token ids: {', '.join(map(repr, wrong[:8]))}",
                      "logit_bias")
        kw["logit_bias"] = {int(k): v for k, v in bias.items()}
    _refuse_unsupported(body)
    if logprobs is not None:
        kw["logprobs"] = logprobs
    if body.get("no_stop_trim") is not None:  # SGLang's name for include_stop_str_in_output
        kw["include_stop_str_in_output"] = _check_type(body, "no_stop_trim", (bool,))
    kw["structured_outputs"] = constraint(body, tool_schema)
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


def _stream_opts(body: dict, force_usage: bool) -> tuple[bool, bool, bool]:
    """-> (stream, include_usage, continuous_usage); force_usage: both, whatever the request says (vLLM's
    --enable-force-include-usage)."""
    stream = flag(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad("'stream_options' must be an object with include_usage and continuous_usage_stats",
                  "stream_options")
    if force_usage and stream:
        return True, True, True
    usage = flag(opts, "include_usage")  # continuous_usage_stats only adds to include_usage (vLLM)
    return stream, usage, usage and flag(opts, "continuous_usage_stats")


def int_field(body: dict, key: str, lo: int, hi: int | None = None, minus_one: str | None = None) -> int | None:
    """An integer field in lo..hi, or also -1 where minus_one says what it means (a 400 naming the field)."""
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or (v < lo and not (minus_one and v == -1)) or (
            hi is not None and v > hi):
        raise bad(f"'{key}' must be an integer " + (f"in {lo}..{hi}" if hi is not None else f">= {lo}")
                  + (f" or -1 ({minus_one})" if minus_one else ""), key)
    return v


def parse_common(body: dict, prompts: list[list[int]], texts: list[str | None], max_tokens_key: str,
                 top_logprobs: int | None, limits: Limits, tool_schema: dict | None = None,
                 prompt_logprobs: int | None = None) -> ParsedRequest:
    """The fields completions and chat share -> ParsedRequest (prompts already tokenised)."""
    stream, usage, continuous = _stream_opts(body, limits.force_usage)
    truncate = int_field(body, "truncate_prompt_tokens", 1, minus_one="the context length")
    if truncate == -1:
        truncate = limits.max_model_len
    side = body.get("truncation_side", "left")
    if side not in ("left", "right"):
        raise bad("'truncation_side' must be \"left\" or \"right\"", "truncation_side")
    if truncate is not None:  # left: keep the last tokens; right: the first
        prompts = [p[-truncate:] if side == "left" else p[:truncate] for p in prompts]
        texts = [None] * len(texts)
    plp = int_field(body, "prompt_logprobs", 0, minus_one=ALL)  # (the engine's max_logprobs caps it)
    if plp and stream:  # (as vLLM: a stream has no place for them)
        raise bad("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs")
    params = sampling_params(body, max_tokens_key, top_logprobs, limits, tool_schema)
    wants = [x for x in (plp, prompt_logprobs) if x is not None]
    want_plp = -1 if -1 in wants else max(wants, default=None)  # (-1: all of them)
    if want_plp is not None:
        params.prompt_logprobs = want_plp
    stop_regex = body.get("stop_regex")
    if stop_regex is not None:
        stop_regex = [stop_regex] if isinstance(stop_regex, str) else stop_regex
        if not isinstance(stop_regex, list) or not all(isinstance(r, str) and r for r in stop_regex):
            raise bad("'stop_regex' must be a regular expression or a list of them", "stop_regex")
        for r in stop_regex:
            try:
                re.compile(r)
            except re.error as e:
                raise bad(f"'stop_regex' {r!r} is not a valid regular expression: {e}", "stop_regex") from None
    beam = beam_request(body, params, limits.defaults) if flag(body, "use_beam_search") else None
    if beam is None and body.get("length_penalty") not in (None, 1, 1.0):
        raise bad("'length_penalty' applies to beam search only (use_beam_search: true)", "length_penalty")
    return ParsedRequest(prompts, texts, params, stream, usage, top_logprobs, continuous_usage=continuous,
                         prompt_details=limits.prompt_details,
                         return_token_ids=flag(body, "return_token_ids"),
                         tokens_as_ids=flag(body, "return_tokens_as_token_ids", limits.tokens_as_ids),
                         prompt_logprobs=plp,
                         stop_regex=stop_regex or [], beam=beam)


def parse_completion(body: dict, tokenizer, limits: Limits = NO_LIMITS) -> ParsedRequest:
    """tokenizer None (a model without tokenizer files): token-id prompts only, token ids out (ids_only)."""
    if body.get("prompt_embeds") not in (None, [], ""):
        raise bad("'prompt_embeds' is not supported: send the prompt as text or token ids", "prompt_embeds")
    p = body.get("prompt")
    if p is None or p == [] or p == "":  # (vLLM's words: its clients and tests match them)
        raise bad("Either prompt or prompt_embeds must be provided and non-empty: send 'prompt' as text or token "
                  "ids ('prompt_embeds' is not supported)", "prompt")
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
    special = flag(body, "add_special_tokens")
    limits = for_body(limits, body)
    prompts, texts = [], []
    for it in items:
        if isinstance(it, str):
            if tokenizer is None:
                raise bad(NO_TOKENIZER, "prompt")
            ids = tokenizer.encode(prompt_text(it, "prompt", limits), add_special_tokens=special)
            texts.append(it)
        elif isinstance(it, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in it):
            ids = list(it)
            texts.append(None)
        else:
            raise bad("each prompt must be a string or a list of integer token ids", "prompt")
        if not ids:
            raise bad("prompt must not be empty", "prompt")
        prompts.append(ids)
    lp = int_field(body, "logprobs", 0, minus_one=ALL)
    echo = flag(body, "echo")
    drop = False
    if body.get("max_tokens") == 0:  # vLLM: the prompt only, with echo (lm-eval's scoring requests)
        if not echo:
            raise bad("'max_tokens' must be at least 1 (0 only with 'echo')", "max_tokens")
        body = {**body, "max_tokens": 1}
        drop = True
    req = parse_common(body, prompts, texts, "max_completion_tokens", lp, limits,  # (lmdeploy sends that here too)
                       prompt_logprobs=lp if echo and lp is not None else None)
    req.echo, req.drop_output = echo, drop
    if tokenizer is None:
        ids_only(req)
    else:
        req.params.update_from_tokenizer(tokenizer)  # bad_words -> token sequences, as vLLM's
    return req
