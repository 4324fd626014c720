"""The one table of request fields: per field name, how each route treats it (fields.check_fields applies it).

Routes: completions, chat, tokenize, detokenize (the OpenAI / vLLM routes); responses, messages, count_tokens
(Anthropic's token count), generate (SGLang's /generate) and sampling_params (its `sampling_params` object). A rule
is one of:

  take     honoured by this route's parser (serve/openai/: request.py, chat_request.py, tokenize.py)
  pass     an adapter (serve/apis/) passes it on as it is to the route it translates to: responses and messages to
           chat, generate and sampling_params to completions (sampling_params under `to`, SGLang's name -> chat's)
  map      the adapter reads it and builds what it means
  ignore   accepted; cannot change the text (bookkeeping, caching hints, routing)
  neutral  accepted at null and the values listed, else a 400 ("not supported", or the row's reason)
  refuse   a known name refused with a reason (at any value but null and the values listed)

A route that names no rule for a field does not know it: a 400 naming the field, with the route's nearest name as a
hint. Value checks (types, ranges, ...) stay with the parsers; a neutral value is the one place this table does one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

ROUTES = ("completions", "chat", "tokenize", "detokenize", "responses", "messages", "count_tokens", "generate",
          "sampling_params")
_SHORT = {"cmpl": "completions", "chat": "chat", "tok": "tokenize", "detok": "detokenize", "resp": "responses",
          "msgs": "messages", "count": "count_tokens", "gen": "generate", "sp": "sampling_params"}
TAKEN = ("take", "pass", "map")  # the kinds of a field a route uses


@dataclass(frozen=True)
class Rule:
    kind: str  # take | pass | map | ignore | neutral | refuse
    values: tuple = ()  # neutral / refuse: the values accepted besides null (same type; 0 also as 0.0)
    why: str | None = None  # refuse (neutral optionally): the 400's message


@dataclass(frozen=True)
class Field:
    name: str
    rules: Mapping[str, Rule]  # route -> its rule; a route not in it does not know the field
    sampling: tuple[str, tuple[type, ...]] | None = None  # completions / chat: (SamplingParams field, accepted types)
    to: str | None = None  # sampling_params: the completion field it is passed on as (else its own name)


TAKE, PASS, MAP, IGNORE = Rule("take"), Rule("pass"), Rule("map"), Rule("ignore")


def neutral(*values, why: str | None = None) -> Rule:
    return Rule("neutral", values, why)


def refuse(why: str, *values) -> Rule:
    return Rule("refuse", values, why)


def row(name: str, cc: Rule | None = None, *, oai: Rule | None = None, sampling=None, to: str | None = None,
        **routes: Rule) -> Field:
    """One field: cc its rule on completions and chat, oai on those and tokenize / detokenize, and one route each by
    its short name (cmpl, chat, tok, detok, resp, msgs, count, gen, sp; these override)."""
    rules = dict.fromkeys(("completions", "chat", "tokenize", "detokenize"), oai) if oai else {}
    rules.update(dict.fromkeys(("completions", "chat"), cc) if cc else {})
    rules.update({_SHORT[k]: r for k, r in routes.items()})
    return Field(name, MappingProxyType(rules), sampling, to)


NUM, INT, BOOL, LIST = (int, float), (int,), (bool,), (list,)
TEXT_ONLY = "this model takes text only"
_NO_PRIORITY = "request priorities are not supported (scheduling is first come, first served)"

# (rows with `sampling` in the order they are read: a later one wins, min_new_tokens over min_tokens)
_ROWS = (
    # the prompt, the model, streaming, the output's length
    row("model", TAKE, tok=TAKE, detok=TAKE, resp=PASS, msgs=PASS, count=PASS),
    row("prompt", cmpl=TAKE, tok=TAKE, resp=refuse("prompt templates are not supported")),
    row("messages", chat=TAKE, tok=TAKE, msgs=MAP, count=MAP),
    row("tokens", detok=TAKE),
    row("input", resp=MAP), row("instructions", resp=MAP), row("system", msgs=MAP, count=MAP),
    row("text", gen=MAP, resp=MAP), row("input_ids", gen=MAP), row("sampling_params", gen=MAP),
    row("stream", TAKE, resp=PASS, msgs=PASS, gen=MAP),
    row("stream_options", TAKE, resp=IGNORE),
    row("max_tokens", TAKE, msgs=MAP),
    row("max_completion_tokens", TAKE),  # (lmdeploy sends it to completions too)
    row("max_output_tokens", resp=MAP),
    row("max_new_tokens", sp=PASS, to="max_tokens"),
    # sampling (`sampling`: request.py reads them, SAMPLING_FIELDS below)
    # (Messages passes the sampling fields of the API's older versions)
    row("temperature", TAKE, resp=PASS, msgs=PASS, sp=PASS, sampling=("temperature", NUM)),
    row("top_p", TAKE, resp=PASS, msgs=PASS, sp=PASS, sampling=("top_p", NUM)),
    row("top_k", TAKE, resp=PASS, msgs=PASS, sp=PASS, sampling=("top_k", INT)),
    row("min_p", TAKE, resp=PASS, sp=PASS, sampling=("min_p", NUM)),
    row("seed", TAKE, resp=PASS, sampling=("seed", INT)),
    row("sampling_seed", sp=PASS, to="seed"),
    row("n", TAKE, sp=PASS, sampling=("n", INT)),
    row("repetition_penalty", TAKE, resp=PASS, sp=PASS, sampling=("repetition_penalty", NUM)),
    row("stop_token_ids", TAKE, resp=PASS, sp=PASS, sampling=("stop_token_ids", LIST)),
    row("presence_penalty", TAKE, resp=PASS, sp=PASS, sampling=("presence_penalty", NUM)),
    row("frequency_penalty", TAKE, resp=PASS, sp=PASS, sampling=("frequency_penalty", NUM)),
    row("ignore_eos", TAKE, resp=PASS, sp=PASS, sampling=("ignore_eos", BOOL)),
    row("min_tokens", TAKE, resp=PASS, sampling=("min_tokens", INT)),
    row("min_new_tokens", TAKE, sp=PASS, to="min_tokens", sampling=("min_tokens", INT)),  # (lmdeploy's, SGLang's)
    row("skip_special_tokens", TAKE, sp=PASS, sampling=("skip_special_tokens", BOOL)),
    row("include_stop_str_in_output", TAKE, sampling=("include_stop_str_in_output", BOOL)),
    row("allowed_token_ids", TAKE, sampling=("allowed_token_ids", LIST)),
    row("logprob_token_ids", TAKE, sampling=("logprob_token_ids", LIST)),
    row("bad_words", TAKE, sampling=("bad_words", LIST)),
    row("cache_salt", TAKE, gen=PASS, sampling=("cache_salt", (str,))),
    row("stop", TAKE, resp=PASS, sp=PASS),
    row("stop_sequences", msgs=MAP),
    row("stop_regex", TAKE, sp=PASS), row("no_stop_trim", TAKE, sp=PASS),
    row("spaces_between_special_tokens", TAKE, sp=PASS),  # (true only: fields.check_fields)
    row("logit_bias", TAKE, resp=PASS, sp=PASS),
    row("priority", neutral(0, why=_NO_PRIORITY), gen=PASS),
    row("use_beam_search", TAKE), row("length_penalty", TAKE), row("echo", TAKE), row("best_of", cmpl=TAKE),
    row("suffix", cmpl=TAKE), row("prompt_embeds", cmpl=TAKE),
    row("stream_interval", sp=IGNORE),  # (the server's own interval applies)
    row("custom_params", sp=neutral()), row("structural_tag", sp=neutral()),
    # log-probs, token ids
    row("logprobs", TAKE), row("top_logprobs", chat=TAKE, resp=MAP), row("prompt_logprobs", TAKE),
    row("return_token_ids", TAKE), row("return_tokens_as_token_ids", TAKE), row("return_token_strs", tok=TAKE),
    row("include", resp=MAP), row("return_logprob", gen=MAP), row("logprob_start_len", gen=MAP),
    row("top_logprobs_num", gen=MAP), row("return_text_in_logprobs", gen=MAP),
    row("return_prompt_token_ids", gen=MAP),
    row("token_ids_logprob", gen=refuse("'token_ids_logprob' is not supported")),
    # constraints (structured.py)
    row("response_format", TAKE), row("structured_outputs", TAKE), row("guided_json", TAKE),
    row("guided_regex", TAKE), row("guided_choice", TAKE), row("guided_grammar", TAKE),
    row("guided_decoding_backend", TAKE),  # (the engine is always llguidance)
    row("guided_whitespace_pattern", refuse("'guided_whitespace_pattern' is not supported (JSON is generated in "
                                            "json.dumps' layout)")),
    row("regex", TAKE, sp=PASS), row("ebnf", TAKE, sp=PASS), row("json_schema", TAKE, sp=PASS),
    row("output_config", msgs=MAP),
    # the prompt's tokens
    row("add_special_tokens", TAKE, tok=TAKE), row("truncate_prompt_tokens", TAKE), row("truncation_side", TAKE),
    row("truncation", resp=neutral("disabled", why="'truncation' must be \"disabled\": a prompt longer than the "
                                                    "context is a 400")),
    # chat: tools, the template, reasoning
    row("tools", chat=TAKE, tok=TAKE, resp=MAP, msgs=MAP, count=MAP),
    row("tool_choice", chat=TAKE, resp=MAP, msgs=MAP, count=MAP),
    row("parallel_tool_calls", chat=TAKE, cmpl=IGNORE, tok=IGNORE, detok=IGNORE, resp=PASS),
    row("chat_template_kwargs", chat=TAKE, tok=TAKE, resp=PASS),
    row("add_generation_prompt", chat=TAKE, tok=TAKE), row("continue_final_message", chat=TAKE, tok=TAKE),
    row("include_reasoning", chat=TAKE), row("reasoning_effort", chat=TAKE), row("separate_reasoning", chat=TAKE),
    row("stream_reasoning", chat=TAKE), row("reasoning", resp=MAP), row("thinking", msgs=MAP, count=MAP),
    row("chat_template", chat=refuse("a chat template from the request is not accepted (the server's template "
                                     "renders every request); set engine.tokenizer or server.chat_template")),
    row("documents", chat=refuse("'documents' (retrieval-augmented templates) is not supported")),
    row("functions", chat=refuse("'functions' is deprecated: send 'tools'")),
    row("function_call", chat=refuse("'function_call' is deprecated: send 'tool_choice'")),
    row("audio", chat=refuse("audio output is not supported")),
    row("web_search_options", chat=refuse("web search is not supported")),
    row("mm_processor_kwargs", chat=refuse(TEXT_ONLY)),
    row("image_data", gen=refuse(TEXT_ONLY)), row("video_data", gen=refuse(TEXT_ONLY)),
    row("audio_data", gen=refuse(TEXT_ONLY)), row("input_embeds", gen=refuse("'input_embeds' is not supported")),
    row("custom_logit_processor", gen=refuse("custom logit processors are not supported")),
    row("modalities", oai=neutral(["text"], why="only text output is supported: 'modalities' must be [\"text\"]")),
    # bookkeeping, caching hints, routing: accepted and ignored (they cannot change the text)
    row("user", oai=IGNORE, resp=IGNORE), row("metadata", oai=IGNORE, resp=IGNORE, msgs=IGNORE),
    row("store", oai=IGNORE, resp=IGNORE), row("service_tier", oai=IGNORE, resp=IGNORE, msgs=IGNORE),
    row("prompt_cache_key", oai=IGNORE, resp=IGNORE), row("prompt_cache_retention", oai=IGNORE, resp=IGNORE),
    row("safety_identifier", oai=IGNORE, resp=IGNORE), row("request_id", oai=IGNORE),
    row("prediction", oai=IGNORE), row("verbosity", oai=IGNORE),
    row("max_tool_calls", resp=IGNORE),  # (a cap on built-in tool calls: there are none here)
    row("cache_control", msgs=IGNORE),  # (the prefix cache works without it)
    row("diagnostics", msgs=IGNORE), row("inference_geo", msgs=IGNORE),
    row("speed", msgs=IGNORE), row("user_profile_id", msgs=IGNORE), row("workspace_id", msgs=IGNORE),
    # SGLang's request id (read by /generate), metric labels, DP-rank hints
    row("rid", oai=IGNORE, gen=MAP), row("log_metrics", gen=IGNORE), row("custom_labels", oai=IGNORE, gen=PASS),
    row("data_parallel_rank", oai=IGNORE, gen=PASS), row("routed_dp_rank", oai=IGNORE, gen=PASS),
    # other servers' fields at their neutral value: SGLang's (its clients send return_hidden_states false), lmdeploy's
    # client (every body has "kwargs": {})
    row("kwargs", oai=neutral({})),
    row("return_hidden_states", oai=neutral(False), gen=PASS),
    row("return_routed_experts", oai=neutral(False), gen=PASS),
    row("return_cached_tokens_details", oai=neutral(False)), row("return_meta_info", oai=neutral(False)),
    row("lora_path", oai=neutral(), gen=PASS), row("extra_key", oai=neutral(), gen=PASS),
    row("bootstrap_host", oai=neutral(), gen=PASS), row("bootstrap_port", oai=neutral(), gen=PASS),
    row("bootstrap_room", oai=neutral(), gen=PASS),
    row("session_params", oai=neutral(), gen=refuse("sessions are not supported")),
    # what a stateless server cannot do
    row("previous_response_id", resp=refuse("this server stores no responses: send the whole conversation in "
                                            "'input'")),
    row("conversation", resp=refuse("this server stores no conversations: send the whole conversation in 'input'")),
    row("background", resp=refuse("background responses are not supported", False)),
    row("container", msgs=refuse("containers are not supported"), count=refuse("containers are not supported")),
    row("mcp_servers", msgs=refuse("MCP servers are not supported"), count=refuse("MCP servers are not supported")),
    row("context_management", msgs=refuse("context management is not supported"),
        count=refuse("context management is not supported")),
)
FIELDS: dict[str, Field] = {f.name: f for f in _ROWS}
if len(FIELDS) != len(_ROWS):
    raise ValueError(f"a field name has two rows: {sorted(n for n in FIELDS if [f.name for f in _ROWS].count(n) > 1)}")
BY_ROUTE: dict[str, dict[str, Rule]] = {r: {f.name: f.rules[r] for f in _ROWS if r in f.rules} for r in ROUTES}

# a field of another route that means the same here (the nearest spelling would point elsewhere): the first of these
# names the route knows is the hint
SAME = {"max_completion_tokens": ("max_tokens", "max_output_tokens", "max_new_tokens"),
        "max_output_tokens": ("max_tokens", "max_new_tokens"), "max_tokens": ("max_output_tokens", "max_new_tokens"),
        "max_new_tokens": ("max_tokens", "max_output_tokens"), "stop_sequences": ("stop",), "stop": ("stop_sequences",),
        "seed": ("sampling_seed",), "sampling_seed": ("seed",)}

# body field -> (SamplingParams field, accepted python types): completions' and chat's sampling fields
SAMPLING_FIELDS: dict[str, tuple[str, tuple]] = {f.name: f.sampling for f in _ROWS if f.sampling}


def names(route: str, *kinds: str) -> tuple[str, ...]:
    """The fields a route treats as one of these kinds (all it knows if none), in the table's order."""
    return tuple(n for n, r in BY_ROUTE[route].items() if not kinds or r.kind in kinds)


def renames(route: str) -> dict[str, str]:
    """The fields an adapter passes on -> their names in the body it builds."""
    return {n: FIELDS[n].to or n for n in names(route, "pass")}
