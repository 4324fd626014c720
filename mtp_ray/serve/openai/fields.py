"""Strict request fields: every field of a request is honoured, accepted as harmless to ignore, or a 400 naming it.

A silently ignored field changes what the client gets without telling it (a typo such as "temprature" would sample
at temperature 1), so unknown fields are refused, with the nearest known name as a hint; one set to null changes
nothing and is taken as absent (clients send options they leave unset as null).
"""

from __future__ import annotations

import difflib

from mtp_ray.serve.openai.errors import bad

# honoured by both endpoints: OpenAI's sampling fields and vLLM's / SGLang's extras
_COMMON = {
    "model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "stop", "seed", "logit_bias",
    "presence_penalty", "frequency_penalty", "logprobs", "response_format",
    # vLLM sampling extras
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
    "include_stop_str_in_output", "spaces_between_special_tokens", "prompt_logprobs", "allowed_token_ids",
    "logprob_token_ids", "return_token_ids", "return_tokens_as_token_ids", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "add_special_tokens", "truncate_prompt_tokens", "truncation_side", "use_beam_search", "echo", "priority",
    "bad_words", "length_penalty", "cache_salt",
    # SGLang extras
    "regex", "ebnf", "json_schema", "stop_regex", "no_stop_trim",
}
# accepted and ignored: they cannot change the generated text (bookkeeping, caching hints, routing; SGLang's request
# id, metric labels and DP-rank hints)
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "prompt_cache_retention", "safety_identifier", "request_id", "prediction", "verbosity", "modalities", "rid",
           "custom_labels", "data_parallel_rank", "routed_dp_rank"}
# other servers' fields, accepted at their neutral value (null, or the one given) and refused by name at any other:
# SGLang's extras (its clients send return_hidden_states false), lmdeploy's client (every body has "kwargs": {})
NEUTRAL: dict[str, tuple] = {
    "kwargs": ({},), "return_hidden_states": (False,), "return_routed_experts": (False,),
    "return_cached_tokens_details": (False,), "return_meta_info": (False,), "lora_path": (), "session_params": (),
    "extra_key": (), "bootstrap_host": (), "bootstrap_port": (), "bootstrap_room": (),
}
# (also lmdeploy's names: min_new_tokens for min_tokens, and on completions chat's max_completion_tokens)
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "suffix", "prompt_embeds", "min_new_tokens",
                               "max_completion_tokens"}
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "include_reasoning", "reasoning_effort",
    "separate_reasoning", "stream_reasoning", "chat_template", "documents", "functions", "function_call", "audio",
    "web_search_options", "mm_processor_kwargs", "min_new_tokens",
}
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "chat_template_kwargs", "tools", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}

# known names that are refused with a reason, rather than honoured (checked by the parsers: value-dependent)
REFUSED = {
    "chat_template": "a chat template from the request is not accepted (the server's template renders every "
                     "request); set engine.tokenizer or server.chat_template",
    "documents": "'documents' (retrieval-augmented templates) is not supported",
    "functions": "'functions' is deprecated: send 'tools'",
    "function_call": "'function_call' is deprecated: send 'tool_choice'",
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "mm_processor_kwargs": "this model takes text only",
    "guided_whitespace_pattern": "'guided_whitespace_pattern' is not supported (JSON is generated in json.dumps' "
                                 "layout)",
}


# a field of the other endpoint that means the same here (the nearest spelling would point elsewhere)
SAME = {"max_completion_tokens": "max_tokens", "max_output_tokens": "max_tokens"}


def check_fields(body: dict, known: set[str]) -> None:
    """400 naming the first unknown field (with the nearest known name), or the first known one that is refused."""
    for key in body:
        if key in IGNORED:
            continue
        if key in NEUTRAL:
            if body[key] is not None and not any(body[key] == v and type(body[key]) is type(v) for v in NEUTRAL[key]):
                as_ = " or ".join(map(repr, (None, *NEUTRAL[key])))
                raise bad(f"'{key}' is not supported (accepted only as {as_})", key)
            continue
        if key not in known:
            if body[key] is None:  # a null field is as if absent (clients send unset options as null)
                continue
            near = [SAME[key]] if SAME.get(key) in known else \
                difflib.get_close_matches(key, sorted(known | IGNORED), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise bad(f"unknown field '{key}'{hint}", key)
        if key in REFUSED and body[key] is not None:
            raise bad(REFUSED[key], key)
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise bad("only text output is supported: 'modalities' must be [\"text\"]", "modalities")
    if body.get("priority") not in (None, 0):
        raise bad("request priorities are not supported (scheduling is first come, first served)", "priority")
    if not flag(body, "spaces_between_special_tokens", True):
        raise bad("'spaces_between_special_tokens': false is not supported", "spaces_between_special_tokens")
    if body.get("stream_options") is not None and not flag(body, "stream"):
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")


_BOOL_WORDS = {"true": True, "t": True, "yes": True, "y": True, "on": True, "1": True,
               "false": False, "f": False, "no": False, "n": False, "off": False, "0": False}


def flag(body: dict, key: str, default: bool = False) -> bool:
    """A boolean field (absent or null: the default). Also what pydantic's lax mode reads as one, as vLLM's and
    SGLang's request models do: 0 / 1 and "true" / "false" ("yes", "on", ...) in any case."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[v.strip().lower()]
    raise bad(f"'{key}' must be a boolean", key)


def unicode_text(s: str, field: str) -> str:
    """A string a tokenizer can take and a response can echo: UTF-8 encodable (JSON can carry lone surrogates, which
    UTF-8 cannot); 400 naming the field."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"'{field}' is not valid Unicode text (a lone surrogate at position {e.start})", field) from None
    return s
