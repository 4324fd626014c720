"""OpenAI completions and chat completions without Ray or HTTP: a fixed request body -> the ParsedRequest and
SamplingParams the engine gets (and the 400s naming a field); fixed engine outputs (StepOutput) -> the final body and
the stream's chunks, with log-probs, usage, token ids, reasoning and tool calls; /tokenize and the error body.
The bundled tiny model's tokenizer gives the text (tokens: "Hi" = [42, 75], "Hello world" = H|el|lo| wor|ld =
[42, 373, 331, 1203, 1138], 2 = <|im_end|>). (tests/test_serve_openai.py checks the same over HTTP.)"""

from __future__ import annotations

import json

import pytest

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.serve.http.http_app import error_response
from mtp_ray.serve.openai.bodies import final_response
from mtp_ray.serve.openai.chat_request import ChatServing, parse_chat
from mtp_ray.serve.openai.choice import new_choices
from mtp_ray.serve.openai.errors import ApiError
from mtp_ray.serve.openai.fields import check_fields
from mtp_ray.serve.openai.limits import Limits
from mtp_ray.serve.openai.request import parse_completion
from mtp_ray.serve.openai.streaming import ChunkWriter
from mtp_ray.serve.openai.tokenize import detokenize, tokenize
from tests.tiny_tokenizer import stable_ids, tokenizer

MODEL = "tiny"
END = 2  # <|im_end|>
PLAIN = ChatServing()  # no parsers: the text is the content
PARSERS = ChatServing(reasoning_parser="qwen3", tool_call_parser="qwen3_coder")  # (the tags are no single tokens)
USER = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def refused(fn, *args, **kw) -> tuple[int, str | None, str]:
    with pytest.raises(ApiError) as e:
        fn(*args, **kw)
    return e.value.status, e.value.param, e.value.message


def step(ids: list[int], lps: list[float] | None = None, tops: list[dict] | None = None, finish: str | None = None,
         **kw) -> StepOutput:
    """One engine delta of request "r" (finish: it ended, for that reason)."""
    lps = lps if lps is not None else [-0.5] * len(ids)
    return StepOutput("r", ids, lps, tops if tops is not None else [{} for _ in ids], finish is not None, finish, **kw)


def whole(req, steps: list[StepOutput], tok, chat: bool, serving: ChatServing = PLAIN,
          order: list[int] | None = None) -> dict:
    """The final body of a request whose choices took these deltas (order: which choice took each; all 0)."""
    choices = new_choices(req, tok, serving)
    for i, out in zip(order or [0] * len(steps), steps, strict=True):
        choices[i].add(out)
    body = final_response("cmpl-1", MODEL, chat, choices, req, tok)
    assert isinstance(body.pop("created"), int)
    return body


def streamed(req, steps: list[StepOutput], tok, chat: bool, serving: ChatServing = PLAIN) -> list[dict]:
    """The chunks of a streamed request of one choice that took these deltas (as ChoiceRunner.events writes them)."""
    choices = new_choices(req, tok, serving)
    w = ChunkWriter("cmpl-1", MODEL, req, choices, chat, tok)
    w.created = 1
    out = w.opening()
    for s in steps:
        choices[0].add(s)
        out += w.progress(choices[0])
    return out + w.closing()


# ---------------------------------------------------------------------------------------------------------------
# requests -> ParsedRequest / SamplingParams


def test_completion_fields_reach_the_sampling_params(tok):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "top_k": 3, "seed": 7, "logprobs": 1,
            "stop": "\n", "min_new_tokens": 1, "no_stop_trim": True, "logit_bias": {"5": 1, " 9": -100},
            "ignore_eos": "true", "stream": True, "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True}}
    check_fields(body, "completions")
    req = parse_completion(body, tok)
    assert (req.prompts, req.prompt_texts, req.stream, req.include_usage, req.continuous_usage, req.top_logprobs,
            req.echo, req.drop_output, req.return_token_ids, req.tokens_as_ids) == (
        [[42, 75]], ["Hi"], True, True, True, 1, False, False, False, False)
    assert req.params == SamplingParams(temperature=0.0, top_k=3, seed=7, max_tokens=3, stop=["\n"], logprobs=1,
                                        min_tokens=1, include_stop_str_in_output=True, ignore_eos=True,
                                        logit_bias={5: 1.0, 9: -100.0})


def test_completion_batch_echo_and_prompt_logprobs(tok):
    req = parse_completion({"prompt": ["Hi", [5, 6, 7]], "echo": True, "logprobs": 2, "n": 2,
                            "return_token_ids": True, "return_tokens_as_token_ids": True}, tok)
    assert (req.prompts, req.prompt_texts, req.echo, req.top_logprobs, req.params.n, req.params.logprobs,
            req.params.prompt_logprobs, req.params.max_tokens, req.return_token_ids, req.tokens_as_ids) == (
        [[42, 75], [5, 6, 7]], ["Hi", None], True, 2, 2, 2, 2, 16, True, True)
    # max_tokens 0 with echo: the prompt alone (one token generated and dropped, as vLLM's scoring requests)
    score = parse_completion({"prompt": [5, 6], "echo": True, "max_tokens": 0, "logprobs": 0}, tok)
    assert (score.drop_output, score.params.max_tokens, score.params.prompt_logprobs) == (True, 1, 0)


def test_completion_truncation_limits_and_server_switches(tok):
    limits = Limits(max_model_len=2, defaults={"temperature": 0.6, "top_p": 0.95, "max_tokens": 64},
                    force_usage=True, tokens_as_ids=True)
    req = parse_completion({"prompt": [1, 2, 3, 4], "truncate_prompt_tokens": -1, "stream": True}, tok, limits)
    assert (req.prompts, req.include_usage, req.continuous_usage, req.tokens_as_ids) == ([[3, 4]], True, True, True)
    assert (req.params.temperature, req.params.top_p, req.params.max_tokens) == (0.6, 0.95, 16)  # (max_tokens: capped
    right = parse_completion({"prompt": [1, 2, 3, 4], "truncate_prompt_tokens": 3,  # later, by cap_max_tokens)
                              "truncation_side": "right", "temperature": 1}, tok, limits)
    assert (right.prompts, right.params.temperature) == ([[1, 2, 3]], 1.0)


@pytest.mark.parametrize("body,param,message", [
    ({"temperature": "hot"}, "temperature", "'temperature' must be of type int or float, got str"),
    ({"n": True}, "n", "'n' must be of type int, got bool"),
    ({"n": 65}, "n", "'n' must be at most 64, got 65"),
    ({"stop": ["a"] * 65}, "stop", "'stop' may hold at most 64 strings, got 65"),
    ({"stop": [1]}, "stop", "'stop' must be a string or a list of strings"),
    ({"logit_bias": {"a": 1}}, "logit_bias", "'logit_bias' keys must be token ids; not token ids: 'a'"),
    ({"suffix": "x"}, "suffix", "'suffix' is not supported"),
    ({"best_of": 3}, "best_of", "'best_of' other than n is not supported"),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": [1.5]}, "prompt", None),
    ({"prompt": [[1], "a", 3]}, "prompt", None),
    ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be at least 1 (0 only with 'echo')"),
    ({"logprobs": -2}, "logprobs", "'logprobs' must be an integer >= 0 or -1 (the whole vocabulary)"),
    ({"stream_options": {"include_usage": True}}, "stream_options", None),  # (without stream: the field check)
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options", None),
    ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs",
     "'prompt_logprobs' are not available when 'stream' is true"),
    ({"truncation_side": "middle", "truncate_prompt_tokens": 1}, "truncation_side", None),
    ({"length_penalty": 0.5}, "length_penalty", None),
    ({"stop_regex": "("}, "stop_regex", None),
    ({"prompt_embeds": "abc"}, "prompt_embeds", None),
    ({"temperature": -1}, "temperature", None),  # (SamplingParams' own check, its field named)
])
def test_completion_refusals_name_the_field(tok, body, param, message):
    def parse(b):
        check_fields(b, "completions")
        return parse_completion(b, tok)

    status, got_param, got = refused(parse, {"prompt": "Hi", **body})
    assert (status, got_param) == (400, param), got
    if message is not None:
        assert got == message


def test_chat_request_renders_the_template_and_sets_the_chat_options(tok):
    req = parse_chat({"messages": USER, "chat_template_kwargs": {"enable_thinking": True}, "logprobs": True,
                      "top_logprobs": 2, "stream_reasoning": False}, tok, serving=PARSERS)
    assert tok.decode(req.prompts[0]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert (req.params.max_tokens, req.params.logprobs, req.top_logprobs) == (None, 2, 2)  # (chat: to the context)
    o = req.chat
    assert (o.tools, o.tool_choice, o.opens_reasoning, o.reasoning, o.stream_reasoning) == (None, "none", True, True,
                                                                                           False)
    # reasoning_effort "none" turns thinking off in the template (the block comes closed)
    off = parse_chat({"messages": USER, "reasoning_effort": "none", "max_completion_tokens": 5}, tok, serving=PARSERS)
    assert tok.decode(off.prompts[0]).endswith("assistant\n<think>\n\n</think>\n\n")
    assert (off.chat.opens_reasoning, off.params.max_tokens) == (False, 5)


def test_chat_tool_choices(tok):
    auto = parse_chat({"messages": USER, "tools": TOOLS}, tok, serving=PARSERS).chat
    assert (auto.tools, auto.tool_choice, auto.tool_name) == (TOOLS, "auto", None)
    named = parse_chat({"messages": USER, "tools": TOOLS, "parallel_tool_calls": False,
                        "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, tok, serving=PARSERS)
    assert (named.chat.tool_choice, named.chat.tool_name, named.chat.parallel_tool_calls) == ("named", "get_time",
                                                                                              False)
    assert named.params.structured_outputs.json == TOOLS[0]["function"]["parameters"]  # the arguments' grammar
    # "auto" needs the server's tool-call parser (vLLM's words); "none" without tools is taken
    assert refused(parse_chat, {"messages": USER, "tools": TOOLS}, tok)[:2] == (400, "tool_choice")
    assert parse_chat({"messages": USER, "tool_choice": "none"}, tok).chat.tool_choice == "none"


@pytest.mark.parametrize("body,param,message", [
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", None),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
     "'chat_template_kwargs' may not set ['tokenize']: they are request fields"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs", "'chat_template_kwargs' must be an object"),
    ({"reasoning_effort": "max"}, "reasoning_effort", None),
    ({"continue_final_message": True}, "continue_final_message",
     "'continue_final_message' needs an assistant message last"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", None),
    ({"top_logprobs": 2}, "top_logprobs", "'top_logprobs' needs 'logprobs': true"),
    ({"messages": []}, "messages", "'messages' must be a non-empty list"),
    ({"messages": [{"content": "x"}]}, "messages", "messages[0] must be an object with a string 'role'"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {}}]}]}, "messages", None),
    ({"temprature": 0.5}, "temprature", "unknown field 'temprature' (did you mean 'temperature'?)"),
    ({"max_output_tokens": 5}, "max_output_tokens", "unknown field 'max_output_tokens' (did you mean 'max_tokens'?)"),
    ({"functions": []}, "functions", "'functions' is deprecated: send 'tools'"),
    ({"return_hidden_states": True}, "return_hidden_states", None),
    ({"modalities": ["audio"]}, "modalities", None),
])
def test_chat_refusals_name_the_field(tok, body, param, message):
    def parse(b):
        check_fields(b, "chat")
        return parse_chat(b, tok, serving=PARSERS)

    status, got_param, got = refused(parse, {"messages": USER, **body})
    assert (status, got_param) == (400, param), got
    if message is not None:
        assert got == message


def test_fields_taken_as_absent_or_neutral():
    check_fields({"messages": USER, "moderation": None, "kwargs": {}, "return_hidden_states": False,
                  "user": "u", "rid": "r", "priority": 0}, "chat")  # (no error)
    assert refused(check_fields, {"prompt": "x", "kwargs": {"a": 1}}, "completions")[:2] == (400, "kwargs")


# ---------------------------------------------------------------------------------------------------------------
# completions: engine output -> final body and stream chunks


LP_STEPS = [step([373, 331], [-0.5, -1.0], [{373: -0.5, 9: -2.0}, {1203: -0.7, 331: -1.0}]),
            step([1203], [-0.2], [{1203: -0.2, 1138: -3.0}], finish="length")]


def test_completion_whole_body_with_logprobs_and_token_ids(tok):
    req = parse_completion({"prompt": "Hi", "max_tokens": 3, "logprobs": 1, "return_token_ids": True}, tok)
    assert whole(req, LP_STEPS, tok, chat=False) == {
        "id": "cmpl-1", "object": "text_completion", "model": MODEL,
        "choices": [{"index": 0, "text": "ello wor", "finish_reason": "length", "stop_reason": None,
                     "matched_stop": None, "prompt_logprobs": None, "prompt_token_ids": [42, 75],
                     "token_ids": [373, 331, 1203],
                     # the chosen token first in each top map, then the best alternatives (vLLM's)
                     "logprobs": {"tokens": ["el", "lo", " wor"], "token_logprobs": [-0.5, -1.0, -0.2],
                                  "top_logprobs": [{"el": -0.5}, {"lo": -1.0, " wor": -0.7}, {" wor": -0.2}],
                                  "text_offset": [0, 2, 4]}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}, "service_tier": None,
        "system_fingerprint": None}


def test_completion_stream_chunks_with_logprobs_token_ids_and_usage(tok):
    req = parse_completion({"prompt": "Hi", "max_tokens": 3, "logprobs": 1, "return_token_ids": True,
                            "return_tokens_as_token_ids": True, "stream": True,
                            "stream_options": {"include_usage": True}}, tok)
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL}
    assert streamed(req, LP_STEPS, tok, chat=False) == [
        {**head, "choices": [{"index": 0, "text": "ello", "finish_reason": None, "prompt_token_ids": [42, 75],
                              "token_ids": [373, 331], "logprobs": {
                                  "tokens": ["token_id:373", "token_id:331"], "token_logprobs": [-0.5, -1.0],
                                  "top_logprobs": [{"token_id:373": -0.5},
                                                   {"token_id:331": -1.0, "token_id:1203": -0.7}],
                                  "text_offset": [0, 12]}}]},
        {**head, "choices": [{"index": 0, "text": " wor", "finish_reason": "length", "stop_reason": None,
                              "matched_stop": None, "token_ids": [1203], "logprobs": {
                                  "tokens": ["token_id:1203"], "token_logprobs": [-0.2],
                                  "top_logprobs": [{"token_id:1203": -0.2}], "text_offset": [24]}}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}]


def test_completion_stop_string_cuts_the_text_and_echo_leads_it(tok):
    req = parse_completion({"prompt": "Hi", "echo": True, "stop": [" wor"], "max_tokens": 5}, tok)
    body = whole(req, [step([373, 331, 1203, 1138], finish="length")], tok, chat=False)
    c = body["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"], c["matched_stop"]) == ("Hiello", "stop", " wor", " wor")
    # the stop token's id ended it: SGLang's matched_stop names it
    body = whole(parse_completion({"prompt": "Hi", "stop_token_ids": [1203]}, tok),
                 [step([373, 1203], finish="stop", stop_reason=1203, stop_token=True)], tok, chat=False)
    c = body["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"], c["matched_stop"]) == ("el", "stop", 1203, 1203)
    assert body["usage"]["completion_tokens"] == 2


def test_completion_n_choices_are_prompt_major_and_usage_sums_them(tok):
    req = parse_completion({"prompt": ["Hi", [5, 6, 7]], "n": 2, "max_tokens": 1}, tok,
                           Limits(prompt_details=True))
    steps = [step([373], finish="length", num_cached_tokens=c) for c in (0, 1, 2, 0)]
    body = whole(req, steps, tok, chat=False, order=[3, 1, 0, 2])
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "el"), (1, "el"), (2, "el"), (3, "el")]
    # cached tokens: per prompt the most any of its samples found
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 2 + 0}}


def test_completion_continuous_usage_in_every_chunk(tok):
    req = parse_completion({"prompt": "Hi", "stream": True, "max_tokens": 3,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, tok)
    chunks = streamed(req, [step([373]), step([331, 1203], finish="length")], tok, chat=False)
    assert [(c["choices"][0]["text"] if c["choices"] else None, c["usage"]["completion_tokens"]) for c in chunks] == [
        ("el", 1), ("lo wor", 3), (None, 3)]


# ---------------------------------------------------------------------------------------------------------------
# chat completions: engine output -> final body and stream chunks


THOUGHT = [49, 85, 331, 370, 322, 288, 1986, 16, 201]  # "Oslo is a city.\n"
CLOSE = [1170, 278, 266, 77, 32, 554]  # "</think>\n\n"
ANSWER = [43, 86, 370, 300, 320, 80, 91, 16]  # "It is sunny."


def _message(**over) -> dict:
    return {"role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": [], "reasoning": None, "reasoning_content": None, **over}


def test_chat_whole_body_splits_reasoning_and_counts_its_tokens(tok):
    req = parse_chat({"messages": USER, "chat_template_kwargs": {"enable_thinking": True}}, tok, serving=PARSERS)
    steps = [step(THOUGHT), step(CLOSE + ANSWER + [END], finish="stop", stop_token=True)]
    n = len(THOUGHT + CLOSE + ANSWER) + 1
    assert whole(req, steps, tok, chat=True, serving=PARSERS) == {
        "id": "cmpl-1", "object": "chat.completion", "model": MODEL,
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop", "stop_reason": None, "matched_stop": END,
                     "token_ids": None, "message": _message(content="It is sunny.", reasoning="Oslo is a city.",
                                                            reasoning_content="Oslo is a city.")}],
        "usage": {"prompt_tokens": 18, "completion_tokens": n, "total_tokens": 18 + n,
                  "completion_tokens_details": {"reasoning_tokens": 9}, "reasoning_tokens": 9},
        "service_tier": None, "system_fingerprint": None, "metadata": None, "moderation": None,
        "prompt_logprobs": None, "prompt_token_ids": None}


def test_chat_stream_reasoning_then_content(tok):
    req = parse_chat({"messages": USER, "chat_template_kwargs": {"enable_thinking": True}, "stream": True,
                      "stream_options": {"include_usage": True}}, tok, serving=PARSERS)
    steps = [step(THOUGHT), step(CLOSE), step(ANSWER + [END], finish="stop", stop_token=True)]
    head = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}

    def ch(delta, finish=None, **end):
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **end}]}

    n = len(THOUGHT + CLOSE + ANSWER) + 1
    assert streamed(req, steps, tok, chat=True, serving=PARSERS) == [
        ch({"role": "assistant", "content": "", "reasoning_content": ""}),
        # (the newline before </think> is held until it is known not to end the reasoning)
        ch({"reasoning": "Oslo is a city.", "reasoning_content": "Oslo is a city."}),
        ch({"content": "It is sunny.", "reasoning_content": ""}, "stop", stop_reason=None, matched_stop=END),
        {**head, "choices": [], "usage": {"prompt_tokens": 18, "completion_tokens": n, "total_tokens": 18 + n,
                                          "completion_tokens_details": {"reasoning_tokens": 9},
                                          "reasoning_tokens": 9}}]


CALL_TEXT = "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"


def test_chat_auto_tool_call_whole_and_streamed(tok):
    ids = tok.encode(CALL_TEXT, add_special_tokens=False) + [END]
    body = stable_ids(whole(parse_chat({"messages": USER, "tools": TOOLS}, tok, serving=PARSERS),
                            [step(ids, finish="stop", stop_token=True)], tok, chat=True, serving=PARSERS))
    call = {"id": "call#0", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}
    c = body["choices"][0]
    assert (c["message"], c["finish_reason"]) == (_message(tool_calls=[call]), "tool_calls")
    req = parse_chat({"messages": USER, "tools": TOOLS, "stream": True}, tok, serving=PARSERS)
    chunks = stable_ids(streamed(req, [step(ids[:20]), step(ids[20:], finish="stop", stop_token=True)], tok,
                                 chat=True, serving=PARSERS))
    deltas = [(x["choices"][0]["delta"], x["choices"][0]["finish_reason"]) for x in chunks]
    assert deltas == [({"role": "assistant", "content": "", "reasoning_content": ""}, None),
                      ({"tool_calls": [{"index": 0, **call}], "reasoning_content": ""}, "tool_calls")]


def test_chat_tool_call_opened_inside_unclosed_thinking_is_a_call(tok):
    """Thinking on, tools given, and the model opens its call before </think> (Qwen3.5 does; vLLM #39056): the call
    is a tool call, not reasoning, whole and streamed, and usage counts the reasoning up to it."""
    ids = THOUGHT + tok.encode(CALL_TEXT, add_special_tokens=False) + [END]
    body = {"messages": USER, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}}
    out = stable_ids(whole(parse_chat(body, tok, serving=PARSERS), [step(ids, finish="stop", stop_token=True)], tok,
                           chat=True, serving=PARSERS))
    call = {"id": "call#0", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}
    c = out["choices"][0]
    assert (c["message"], c["finish_reason"]) == (
        _message(tool_calls=[call], reasoning="Oslo is a city.", reasoning_content="Oslo is a city."), "tool_calls")
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(THOUGHT)}
    req = parse_chat({**body, "stream": True}, tok, serving=PARSERS)
    chunks = stable_ids(streamed(req, [step(ids[:12]), step(ids[12:30]), step(ids[30:], finish="stop",
                                                                               stop_token=True)],
                                 tok, chat=True, serving=PARSERS))
    deltas = [x["choices"][0]["delta"] for x in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Oslo is a city."
    assert [tc for d in deltas for tc in d.get("tool_calls", [])] == [{"index": 0, **call}]
    assert not any(d.get("content") for d in deltas) and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_named_tool_choice_streams_the_arguments_as_generated(tok):
    req = parse_chat({"messages": USER, "tools": TOOLS, "stream": True,
                      "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, tok)
    args = tok.encode("{\"zone\": \"UTC\"}", add_special_tokens=False)  # { " z one ": ␣" UT C " }
    chunks = stable_ids(streamed(req, [step(args[:5]), step(args[5:], finish="stop")], tok, chat=True))
    assert [x["choices"][0]["delta"] for x in chunks] == [
        {"role": "assistant", "content": ""},
        {"tool_calls": [{"index": 0, "id": "call#0", "type": "function",
                         "function": {"name": "get_time", "arguments": "{\"zone\":"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": " \"UTC\"}"}}]}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # (a named call ends "stop", as OpenAI's)
    body = whole(parse_chat({**req_body(), "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                            tok), [step(args, finish="stop")], tok, chat=True)
    assert stable_ids(body["choices"][0]["message"]) == _message(content="", tool_calls=[
        {"id": "call#0", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}])


def req_body() -> dict:
    return {"messages": USER, "tools": TOOLS}


def test_chat_logprobs_whole_and_streamed(tok):
    body = {"messages": USER, "logprobs": True, "top_logprobs": 1, "max_tokens": 2}
    steps = [step([42], [-0.1], [{42: -0.1, 9: -4.0}]), step([75], [-0.3], [{373: -0.2, 75: -0.3}], finish="length")]

    def e(token, lp):
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    want = [{**e("H", -0.1), "top_logprobs": [e("H", -0.1)]}, {**e("i", -0.3), "top_logprobs": [e("el", -0.2)]}]
    got = whole(parse_chat(body, tok), steps, tok, chat=True)["choices"][0]
    assert (got["logprobs"], got["message"]["content"], got["finish_reason"]) == ({"content": want}, "Hi", "length")
    chunks = streamed(parse_chat({**body, "stream": True}, tok), steps, tok, chat=True)
    assert [x["choices"][0]["logprobs"] for x in chunks] == [None, {"content": want[:1]}, {"content": want[1:]}]


def test_chat_prompt_token_ids_and_echo(tok):
    prefill = [*USER, {"role": "assistant", "content": "Hel"}]
    req = parse_chat({"messages": prefill, "echo": True, "continue_final_message": True,
                      "add_generation_prompt": False, "return_token_ids": True, "stream": True}, tok)
    chunks = streamed(req, [step([331], finish="length")], tok, chat=True)
    assert chunks[0]["prompt_token_ids"] == req.prompts[0] and chunks[0]["choices"][0]["delta"] == {
        "role": "assistant", "content": ""}
    assert [(x["choices"][0]["delta"].get("content"), x["choices"][0].get("token_ids")) for x in chunks[1:]] == [
        ("Hel", []), ("lo", [331])]
    body = whole(parse_chat({**{k: v for k, v in req_body().items() if k != "tools"}, "messages": prefill,
                             "echo": True, "continue_final_message": True, "add_generation_prompt": False,
                             "return_token_ids": True}, tok), [step([331], finish="length")], tok, chat=True)
    assert (body["choices"][0]["message"]["content"], body["choices"][0]["token_ids"], body["prompt_token_ids"]) == (
        "Hello", [331], req.prompts[0])


# ---------------------------------------------------------------------------------------------------------------
# /tokenize, /detokenize, the error body


def test_tokenize_and_detokenize(tok):
    assert tokenize({"prompt": "Hi", "return_token_strs": True}, tok, 4096) == {
        "tokens": [42, 75], "count": 2, "max_model_len": 4096, "token_strs": ["H", "i"]}
    chat = tokenize({"messages": USER}, tok, 4096)
    assert chat["count"] == 24 and chat["token_strs"] is None
    assert tok.decode(chat["tokens"]).startswith("<|im_start|>user\nHi<|im_end|>\n")
    assert detokenize({"tokens": [42, 373, 331, 1203, 1138]}, tok, 2048) == {"prompt": "Hello world"}
    assert refused(detokenize, {"tokens": [2048]}, tok, 2048) == (
        400, "tokens", "'tokens' must be a list of token ids in [0, 2048)")
    assert refused(tokenize, {"prompt": 5}, tok, 4096)[:2] == (400, "prompt")


@pytest.mark.parametrize("status,kind", [(400, "invalid_request_error"), (404, "NotFoundError"),
                                         (503, "ServiceUnavailableError"), (500, "internal_error")])
def test_error_body_in_openais_shape_and_vllms_flat_one(status, kind):
    r = error_response(ApiError(status, "why", "field"))
    e = {"message": "why", "type": kind, "param": "field", "code": status}
    assert r.status_code == status and json.loads(r.body) == {"error": e, "object": "error", **e}
    lone = ApiError(400, "bad \ud800 text", "prompt")  # a lone surrogate the client sent: escaped, still encodes
    assert json.loads(error_response(lone).body)["error"]["message"] == "bad \\ud800 text"


def test_a_streams_closing_events_go_out_in_one_write():
    """Each write of a stream is one message through Serve's proxy: the finish chunk, the usage chunk and [DONE]
    leave together; a choice's finish while another goes on waits only for that next event."""
    import asyncio

    from mtp_ray.serve.openai.bodies import sse_stream

    def run(bodies: list[dict]) -> list[str]:
        async def chunks():
            for b in bodies:
                yield b

        async def collect():
            return [w async for w in sse_stream(chunks())]

        return asyncio.run(collect())

    delta = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    end = {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}
    use = {"choices": [], "usage": {"completion_tokens": 2}}
    writes = run([delta, delta, end, use])
    assert len(writes) == 3 and writes[-1].count("data: ") == 3 and writes[-1].endswith("data: [DONE]\n\n")
    assert json.loads(writes[-1].split("\n\n")[0][6:]) == end
    two = {"choices": [{"index": 1, "text": "c", "finish_reason": None}]}
    writes = run([end, two, {"choices": [{"index": 1, "text": "", "finish_reason": "stop"}]}])
    assert [w.count("data: ") for w in writes] == [2, 2]  # the held finish goes with the next event
    running = {"choices": [{"index": 0, "text": "a", "finish_reason": None}], "usage": {"completion_tokens": 1}}
    assert len(run([running, running, end])) == 3  # continuous usage stats do not hold a chunk back
