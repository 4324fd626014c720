"""The other APIs' translations, without Ray or HTTP: OpenAI's Responses API, Anthropic's Messages API and SGLang's
native /generate, each from a fixed request to the chat / completion body it becomes (and the 400s naming a field),
and from a fixed chat / completion answer, whole or as a sequence of chunks, to that API's body or events in order.
(tests/test_serve_openai.py and test_serve_structured.py check the same over HTTP against the engine.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from mtp_ray.serve.apis import anthropic as messages_api
from mtp_ray.serve.apis import responses_out as responses_api
from mtp_ray.serve.apis import sglang as native_api
from mtp_ray.serve.openai.chat_request import parse_chat
from mtp_ray.serve.openai.errors import ApiError
from mtp_ray.serve.openai.fields import check_fields
from mtp_ray.serve.openai.tokenize import tokenize
from tests.tiny_tokenizer import data_events, named_events, stable_ids, tokenizer

MODEL = "tiny"
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}


def refused(fn, *args) -> tuple[int, str | None, str]:
    with pytest.raises(ApiError) as e:
        fn(*args)
    return e.value.status, e.value.param, e.value.message


def drain(front, chunks: list[dict]) -> list[str]:
    """front.convert over these chat / completion chunks (as the route's async stream), all its events."""
    async def gen():
        for c in chunks:
            yield c

    async def collect():
        return [e async for e in front.convert(gen())]

    return asyncio.run(collect())


def chunk(delta: dict | None = None, finish: str | None = None, logprobs=None, usage=None, **choice) -> dict:
    """A chat completion chunk of choice 0 (usage: a continuous-usage chunk's)."""
    out = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
           "choices": [{"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish, **choice}]}
    return {**out, "usage": usage} if usage is not None else out


def usage_chunk(usage: dict) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [],
            "usage": usage}


def chat_answer(message: dict, finish: str, usage: dict, logprobs=None, **choice) -> dict:
    msg = {"role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
           "function_call": None, "tool_calls": [], "reasoning": None, "reasoning_content": None, **message}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": finish,
                         "stop_reason": None, "matched_stop": None, **choice}],
            "usage": usage}


USAGE = {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32,
         "prompt_tokens_details": {"cached_tokens": 16}, "completion_tokens_details": {"reasoning_tokens": 7},
         "reasoning_tokens": 7}
CALL = {"id": "call_X1", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}


# ---------------------------------------------------------------------------------------------------------------
# OpenAI Responses API: request -> chat body


def test_responses_string_input_instructions_and_ignored_fields():
    body = {"model": MODEL, "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 16, "temperature": 0.5,
            "top_p": 0.9, "store": True, "metadata": {"a": "b"}, "truncation": "disabled", "user": "u",
            "parallel_tool_calls": True, "tool_choice": "auto", "service_tier": "auto", "max_tool_calls": 2,
            "prompt_cache_key": "k", "stream": False, "previous_response_id": None, "background": False}
    chat, shell = responses_api.front(body, MODEL)
    assert chat == {"model": MODEL, "temperature": 0.5, "top_p": 0.9, "parallel_tool_calls": True, "stream": False,
                    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                    "max_completion_tokens": 16}
    check_fields(chat, "chat")  # what the chat route then takes
    assert shell.model == MODEL and shell.id.startswith("resp_") and len(shell.id) == 37


def test_responses_items_become_messages_with_parallel_calls_in_one_turn():
    items = [{"role": "developer", "content": "Use tools."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "time "},
                                                             {"type": "input_text", "text": "here?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{\"zone\": \"UTC\"}"},
             {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{\"zone\": \"CET\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
             {"type": "function_call_output", "call_id": "c2", "output": {"time": "13:00"}},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Noon."}]}]
    chat = responses_api.front({"input": items}, MODEL)[0]
    assert chat == {"messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "time here?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"CET\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c2", "content": "{\"time\": \"13:00\"}"},
        {"role": "assistant", "content": "Noon."}]}


def test_responses_tools_formats_choice_logprobs_and_stream():
    tools = [{"type": "function", "name": "get_time", "description": "the time", "parameters": TIME_SCHEMA,
              "strict": None}]
    body = {"input": "time?", "tools": tools, "tool_choice": {"type": "function", "name": "get_time"},
            "text": {"format": {"type": "json_schema", "name": "t", "schema": TIME_SCHEMA, "strict": True}},
            "include": ["message.output_text.logprobs", "reasoning.encrypted_content"], "top_logprobs": 3,
            "stream": True, "stream_options": {"include_obfuscation": False}, "frequency_penalty": 1.5, "top_k": 4,
            "stop": ["\n"]}
    chat = responses_api.front(body, MODEL)[0]
    assert chat == {
        "messages": [{"role": "user", "content": "time?"}], "stream": True, "frequency_penalty": 1.5, "top_k": 4,
        "stop": ["\n"], "logprobs": True, "top_logprobs": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TIME_SCHEMA,
                                                                   "strict": True}},
        "tools": [{"type": "function", "function": {"name": "get_time", "description": "the time",
                                                    "parameters": TIME_SCHEMA}}],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "stream_options": {"include_usage": True}}
    check_fields(chat, "chat")
    # logprobs: include alone asks for the chosen tokens' (no alternatives); top_logprobs alone for both
    assert responses_api.front({"input": "x", "include": ["message.output_text.logprobs"]}, MODEL)[0] == {
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 0}
    assert responses_api.front({"input": "x", "top_logprobs": 2}, MODEL)[0]["top_logprobs"] == 2
    assert responses_api.front({"input": "x", "text": {"format": {"type": "json_object"}}}, MODEL)[0][
        "response_format"] == {"type": "json_object"}
    # tool_choice without tools: "auto" / "none" are the API's default and dropped; a forced one goes to chat (400)
    assert "tool_choice" not in responses_api.front({"input": "x", "tool_choice": "none"}, MODEL)[0]
    assert responses_api.front({"input": "x", "tool_choice": "required"}, MODEL)[0]["tool_choice"] == "required"


@pytest.mark.parametrize("reasoning,kwargs,want", [
    ({"effort": "low"}, None, {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": True}}),
    ({"effort": "high", "summary": "auto"}, {"enable_thinking": False},
     {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}),
    ({"effort": "none"}, None, {"reasoning_effort": "none"}),
    ({"summary": "auto"}, None, {}),
])
def test_responses_reasoning_effort_turns_thinking_on_unless_told(reasoning, kwargs, want):
    body = {"input": "Hi", "reasoning": reasoning, **({"chat_template_kwargs": kwargs} if kwargs else {})}
    chat = responses_api.front(body, MODEL)[0]
    assert {k: v for k, v in chat.items() if k != "messages"} == want


@pytest.mark.parametrize("body,param,message", [
    ({"previous_response_id": "resp_1"}, "previous_response_id",
     "this server stores no responses: send the whole conversation in 'input'"),
    ({"conversation": "c"}, "conversation", None),
    ({"background": True}, "background", "background responses are not supported"),
    ({"prompt": {"id": "p"}}, "prompt", None),
    ({"modalities": ["text"]}, "modalities", "unknown field 'modalities'"),
    ({"truncation": "auto"}, "truncation", None),
    ({"include": ["file_search_call.results"]}, "include", None),
    ({"top_logprobs": 21}, "top_logprobs", "'top_logprobs' must be an integer from 0 to 20"),
    ({"top_logprobs": True}, "top_logprobs", None),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", None),
    ({"text": "plain"}, "text", None),
    ({"tools": [{"type": "web_search"}]}, "tools", None),
    ({"tools": {"type": "function"}}, "tools", "'tools' must be a list of function tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", None),
    ({"reasoning": {"effort": "max"}}, "reasoning",
     "'reasoning.effort' must be one of none, minimal, low, medium, high, xhigh"),
    ({"reasoning": {"budget": 3}}, "reasoning", None),
    ({"input": []}, "input", "'input' must be a string or a non-empty list of items"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0].content must be a string or a list of input_text parts (this model takes text only)"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input",
     "input[0]: this server stores no items: send the item itself, not an item_reference"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", None),
    ({"instructions": ["a"]}, "instructions", "'instructions' must be a string"),
])
def test_responses_refusals_name_the_field(body, param, message):
    status, got_param, got = refused(responses_api.front, {"input": "x", **body}, MODEL)
    assert (status, got_param) == (400, param)
    if message is not None:
        assert got == message


# ---------------------------------------------------------------------------------------------------------------
# OpenAI Responses API: chat answer -> Response, chat chunks -> events


def _shell(body: dict):
    shell = responses_api.front(body, MODEL)[1]
    shell.created = 1700000000
    return shell


def _echo(**over) -> dict:
    """The fields of a Response that echo a request of input "Hi" alone."""
    return {"instructions": None, "max_output_tokens": None, "temperature": None, "top_p": None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
            "reasoning": None, "metadata": None, "previous_response_id": None, "store": False,
            "truncation": "disabled", "user": None, **over}


RESP_USAGE = {"input_tokens": 20, "output_tokens": 12, "total_tokens": 32,
              "input_tokens_details": {"cached_tokens": 16}, "output_tokens_details": {"reasoning_tokens": 7}}


def test_responses_whole_answer_has_reasoning_message_and_call_items():
    tools = [{"type": "function", "name": "get_time", "parameters": TIME_SCHEMA}]
    shell = _shell({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 64, "temperature": 0,
                    "tools": tools, "reasoning": {"effort": "low"}, "metadata": {"k": "v"}, "user": "u"})
    chat = chat_answer({"content": "Let me check.", "reasoning": "Oslo is a city.", "tool_calls": [CALL]},
                       "tool_calls", USAGE)
    assert stable_ids(shell.whole(chat)) == {
        "id": "resp#0", "object": "response", "created_at": 1700000000, "status": "completed", "error": None,
        "incomplete_details": None, "model": MODEL,
        "output": [
            {"id": "rs#0", "type": "reasoning", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Oslo is a city."}]},
            {"id": "msg#0", "type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]},
            {"id": "fc#0", "type": "function_call", "call_id": "call_X1", "name": "get_time",
             "arguments": "{\"zone\": \"UTC\"}", "status": "completed"}],
        "usage": RESP_USAGE,
        **_echo(instructions="Be brief.", max_output_tokens=64, temperature=0, tools=tools,
                reasoning={"effort": "low"}, metadata={"k": "v"}, user="u")}


def test_responses_whole_answer_cut_at_max_output_tokens_is_incomplete():
    shell = _shell({"input": "Hi", "tool_choice": "none", "text": {"format": {"type": "json_object"}}})
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}  # (no details: 0)
    r = stable_ids(shell.whole(chat_answer({"content": "{\"a\""}, "length", usage)))
    assert (r["status"], r["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert r["output"] == [{"id": "msg#0", "type": "message", "role": "assistant", "status": "incomplete", "content": [
        {"type": "output_text", "text": "{\"a\"", "annotations": [], "logprobs": []}]}]
    assert r["usage"] == {"input_tokens": 5, "output_tokens": 4, "total_tokens": 9,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}
    assert (r["tool_choice"], r["text"]) == ("none", {"format": {"type": "json_object"}})


def _lp(token: str, logprob: float = -0.5) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}


def test_responses_whole_answer_logprobs_are_the_message_texts_only():
    """The chat choice's entries cover the reasoning, its </think> and the text: the message part gets those after
    the tag (the newlines the parser strips from the text included, as the chat route counts them)."""
    shell = _shell({"input": "Hi", "include": ["message.output_text.logprobs"]})
    entries = [_lp("Hm"), _lp("</"), _lp("think"), _lp(">"), _lp("\n\n"), _lp("Yes", -0.1)]
    chat = chat_answer({"content": "Yes", "reasoning": "Hm"}, "stop", USAGE, logprobs={"content": entries})
    out = shell.whole(chat)["output"]
    assert [o["type"] for o in out] == ["reasoning", "message"]
    assert out[1]["content"][0]["logprobs"] == entries[4:]


def test_responses_stream_reasoning_then_text_events_in_order():
    shell = _shell({"input": "Hi", "stream": True})
    r0 = {"reasoning_content": ""}
    chunks = [chunk({"role": "assistant", "content": "", **r0}),
              chunk({"reasoning": "Oslo", "reasoning_content": "Oslo"}),
              chunk({"reasoning": " is a city.", "reasoning_content": " is a city."}),
              chunk({"content": "It is", **r0}),
              chunk({"content": " sunny.", **r0}, finish="stop"),
              usage_chunk(USAGE)]
    events = stable_ids(named_events(drain(shell, chunks)))
    assert [e["sequence_number"] for e in events] == list(range(17))
    pending = {"id": "resp#0", "object": "response", "created_at": 1700000000, "status": "in_progress",
               "error": None, "incomplete_details": None, "model": MODEL, "output": [], "usage": None, **_echo()}
    reasoning = {"id": "rs#0", "type": "reasoning", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Oslo is a city."}]}
    part = {"type": "output_text", "text": "It is sunny.", "annotations": [], "logprobs": []}
    message = {"id": "msg#0", "type": "message", "role": "assistant", "status": "completed", "content": [part]}
    rs, msg = {"item_id": "rs#0", "output_index": 0, "content_index": 0}, \
        {"item_id": "msg#0", "output_index": 1, "content_index": 0}
    want = [
        ("response.created", {"response": pending}),
        ("response.in_progress", {"response": pending}),
        ("response.output_item.added", {"output_index": 0, "item": {"id": "rs#0", "type": "reasoning",
                                                                    "summary": [], "content": []}}),
        ("response.content_part.added", {**rs, "part": {"type": "reasoning_text", "text": ""}}),
        ("response.reasoning_text.delta", {**rs, "delta": "Oslo"}),
        ("response.reasoning_text.delta", {**rs, "delta": " is a city."}),
        ("response.reasoning_text.done", {**rs, "text": "Oslo is a city."}),
        ("response.content_part.done", {**rs, "part": {"type": "reasoning_text", "text": "Oslo is a city."}}),
        ("response.output_item.done", {"output_index": 0, "item": reasoning}),
        ("response.output_item.added", {"output_index": 1, "item": {
            "id": "msg#0", "type": "message", "role": "assistant", "status": "in_progress", "content": []}}),
        ("response.content_part.added", {**msg, "part": {**part, "text": ""}}),
        ("response.output_text.delta", {**msg, "delta": "It is", "logprobs": []}),
        ("response.output_text.delta", {**msg, "delta": " sunny.", "logprobs": []}),
        ("response.output_text.done", {**msg, "text": "It is sunny.", "logprobs": []}),
        ("response.content_part.done", {**msg, "part": part}),
        ("response.output_item.done", {"output_index": 1, "item": message}),
        ("response.completed", {"response": {**pending, "status": "completed", "output": [reasoning, message],
                                             "usage": RESP_USAGE}}),
    ]
    assert [(e.pop("type"), e.pop("sequence_number"))[0] for e in events] == [k for k, _ in want]
    assert events == [fields for _, fields in want]


def test_responses_stream_function_calls_open_and_close_one_item_each():
    """A forced (required) call streams its arguments as generated: the first delta names the call, the next ones
    carry more arguments of it; a second call closes the first."""
    shell = _shell({"input": "time?", "tools": [{"type": "function", "name": "get_time"}],
                    "tool_choice": "required", "stream": True})
    call1 = {"index": 0, "id": "call_X1", "type": "function", "function": {"name": "get_time",
                                                                           "arguments": "{\"zone\": "}}
    call2 = {"index": 1, "id": "call_X2", "type": "function", "function": {"name": "get_time",
                                                                           "arguments": "{\"zone\": \"CET\"}"}}
    chunks = [chunk({"role": "assistant", "content": ""}),
              chunk({"tool_calls": [call1]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"UTC\"}"}}]}),
              chunk({"tool_calls": [call2]}, finish="tool_calls"),
              usage_chunk({"prompt_tokens": 9, "completion_tokens": 20, "total_tokens": 29})]
    events = stable_ids(named_events(drain(shell, chunks)))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    item = {"id": "fc#0", "type": "function_call", "call_id": "call_X1", "name": "get_time", "arguments": "",
            "status": "in_progress"}
    assert events[2] == {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": item}
    assert [e["delta"] for e in events if e["type"].endswith("arguments.delta")] == [
        "{\"zone\": ", "\"UTC\"}", "{\"zone\": \"CET\"}"]
    assert events[5] == {"type": "response.function_call_arguments.done", "sequence_number": 5, "item_id": "fc#0",
                         "output_index": 0, "name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}
    first = {**item, "arguments": "{\"zone\": \"UTC\"}", "status": "completed"}
    second = {**first, "id": "fc#1", "call_id": "call_X2", "arguments": "{\"zone\": \"CET\"}"}
    assert events[6]["item"] == first and events[10] == {"type": "response.output_item.done", "sequence_number": 10,
                                                         "output_index": 1, "item": second}
    final = events[-1]["response"]
    assert (final["status"], final["output"], final["tool_choice"]) == ("completed", [first, second], "required")


def test_responses_stream_forced_call_cut_short_is_no_call_in_the_final_response():
    shell = _shell({"input": "time?", "tools": [{"type": "function", "name": "get_time"}],
                    "tool_choice": "required", "stream": True})
    call = {"index": 0, "id": "call_X1", "type": "function", "function": {"name": "get_time",
                                                                          "arguments": "{\"zo"}}
    chunks = [chunk({"tool_calls": [call]}, finish="length"),
              usage_chunk({"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13})]
    events = stable_ids(named_events(drain(shell, chunks)))
    done = next(e for e in events if e["type"] == "response.output_item.done")
    assert done["item"] == {"id": "fc#0", "type": "function_call", "call_id": "call_X1", "name": "get_time",
                            "arguments": "{\"zo", "status": "incomplete"}
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert (last["response"]["status"], last["response"]["incomplete_details"], last["response"]["output"]) == (
        "incomplete", {"reason": "max_output_tokens"}, [])


def test_responses_stream_text_logprobs_go_with_their_deltas():
    shell = _shell({"input": "Hi", "include": ["message.output_text.logprobs"], "stream": True})
    close = [_lp("</"), _lp("think"), _lp(">")]
    chunks = [chunk({"reasoning": "Hm", "reasoning_content": "Hm"}, logprobs={"content": [_lp("Hm")]}),
              chunk({"content": "", "reasoning_content": ""}, logprobs={"content": close}),
              chunk({"content": "Yes"}, logprobs={"content": [_lp("\n\n"), _lp("Yes")]}),
              chunk({"content": "!"}, finish="stop", logprobs={"content": [_lp("!")]}),
              usage_chunk({"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16})]
    events = named_events(drain(shell, chunks))
    text = [_lp("\n\n"), _lp("Yes"), _lp("!")]
    assert [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"] == [text[:2], text[2:]]
    assert next(e for e in events if e["type"] == "response.output_text.done")["logprobs"] == text
    assert events[-1]["response"]["output"][1]["content"][0]["logprobs"] == text


def test_responses_stream_error_chunk_is_an_error_event():
    shell = _shell({"input": "Hi", "stream": True})
    err = {"error": {"message": "the group failed", "type": "internal_error", "param": None, "code": 500}}
    events = named_events(drain(shell, [chunk({"content": "a"}), err]))
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1] == {"type": "error", "sequence_number": 5, "code": 500, "message": "the group failed",
                          "param": None}


def test_responses_stream_accumulates_in_the_openai_client():
    """The openai client's own accumulation of a Responses stream (ResponseStreamState, what
    client.responses.stream() runs) takes the events as they are and ends with the same output as ours."""
    from openai._models import construct_type
    from openai._types import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    shell = _shell({"input": "Hi", "stream": True})
    call = {"index": 0, "id": "call_X1", "type": "function", "function": {"name": "f", "arguments": "{\"a\""}}
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning": "Oslo", "reasoning_content": "Oslo"}),
              chunk({"content": "It is"}), chunk({"tool_calls": [call]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, finish="tool_calls"),
              usage_chunk(USAGE)]
    events = named_events(drain(shell, chunks))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    seen = [e for d in events for e in state.handle_event(construct_type(type_=ResponseStreamEvent, value=d))]
    final = seen[-1].response
    assert seen[-1].type == "response.completed" and final.output_text == "It is"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert (final.output[0].content[0].text, final.output[2].arguments) == ("Oslo", "{\"a\": 1}")
    assert final.model_dump(exclude_none=True)["output"] == json.loads(json.dumps(
        events[-1]["response"]["output"]))


def test_responses_function_call_output_as_text_parts_is_the_tool_text():
    items = [{"role": "user", "content": "time?"},
             {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "12:00"}]}]
    chat = responses_api.front({"input": items}, MODEL)[0]
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "12:00"}


def test_responses_body_through_chat_parsing_reaches_the_template():
    """reasoning.effort turns thinking on in the chat template the route renders (the prompt opens <think>); "none"
    leaves it closed."""
    tok = tokenizer()
    on = parse_chat(responses_api.front({"input": "Hi", "reasoning": {"effort": "low"}}, MODEL)[0], tok)
    off = parse_chat(responses_api.front({"input": "Hi", "reasoning": {"effort": "none"}}, MODEL)[0], tok)
    assert tok.decode(on.prompts[0]).endswith("<|im_start|>assistant\n<think>\n")
    assert tok.decode(off.prompts[0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (on.chat.opens_reasoning, off.chat.opens_reasoning) == (True, False)


# ---------------------------------------------------------------------------------------------------------------
# Anthropic Messages API: request -> chat body


def test_messages_request_with_system_blocks_tool_history_and_named_tool():
    body = {"model": MODEL, "max_tokens": 32, "temperature": 0, "top_k": 5, "metadata": {"user_id": "u"},
            "system": [{"type": "text", "text": "You "},
                       {"type": "text", "text": "help.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "time?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "12:00"}]},
                    {"type": "text", "text": "Thanks"}]}],
            "tools": [{"name": "get_time", "description": "the time", "input_schema": TIME_SCHEMA}],
            "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
            "stop_sequences": ["\n\n"]}
    chat, front = messages_api.front(body, MODEL)
    assert chat == {
        "model": MODEL, "temperature": 0, "top_k": 5, "max_completion_tokens": 32, "stop": ["\n\n"],
        "messages": [
            {"role": "system", "content": "You help."},
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_time",
                                                                   "arguments": "{\"zone\": \"UTC\"}"}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "12:00"},
            {"role": "user", "content": "Thanks"}],
        "tools": [{"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA,
                                                    "description": "the time"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "parallel_tool_calls": False}
    check_fields(chat, "chat")
    assert front.model == MODEL and front.id.startswith("msg_") and len(front.id) == 28


@pytest.mark.parametrize("extra,want", [
    ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"thinking": {"type": "disabled"}}, {"chat_template_kwargs": {"enable_thinking": False}}),
    ({"output_config": {"effort": "max", "format": {"type": "json_schema", "schema": TIME_SCHEMA}}},
     {"reasoning_effort": "xhigh", "response_format": {"type": "json_schema", "json_schema": {
         "name": "output", "schema": TIME_SCHEMA}}}),
    ({"tool_choice": {"type": "auto"}}, {}),  # (no tools: the default, dropped)
    ({"tool_choice": {"type": "any"}}, {"tool_choice": "required"}),  # (no tools: chat refuses it by name)
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "none"}},
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "none"}),
    ({"messages": [{"role": "user", "content": "def f():"}, {"role": "assistant", "content": "    return"}]},
     {"add_generation_prompt": False, "continue_final_message": True}),  # a prefill
])
def test_messages_request_options(extra, want):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}
    chat = messages_api.front(body, MODEL)[0]
    assert {k: v for k, v in chat.items() if k not in ("messages", "max_completion_tokens")} == want
    assert chat["max_completion_tokens"] == 8


@pytest.mark.parametrize("body,param,message", [
    ({"max_tokens": None}, "max_tokens", "'max_tokens' is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages",
     "messages[0]: a 'image' block is not supported here (this model takes text only)"),
    ({"top_n": 3}, "top_n", "unknown field 'top_n' (did you mean 'top_p'?)"),
    ({"container": "c"}, "container", "containers are not supported"),
    ({"mcp_servers": []}, "mcp_servers", "MCP servers are not supported"),
    ({"messages": []}, "messages", "'messages' must be a non-empty list"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages",
     "messages[0]: 'role' must be \"user\" or \"assistant\""),
    ({"system": 3}, "system", "'system' must be a string or a list of text blocks"),
    ({"stop_sequences": "\n"}, "stop_sequences", "'stop_sequences' must be a list of strings"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", None),
    ({"tools": [{"name": "f"}]}, "tools", None),
    ({"tool_choice": {"type": "function"}}, "tool_choice", None),
    ({"thinking": {"type": "on"}}, "thinking", None),
    ({"output_config": {"effort": "low", "verbosity": 1}}, "output_config", "'output_config' takes effort and format"),
    ({"output_config": {"effort": "extreme"}}, "output_config", None),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config", None),
])
def test_messages_refusals_name_the_field(body, param, message):
    status, got_param, got = refused(messages_api.front, {"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 8, **body}, MODEL)
    assert (status, got_param) == (400, param)
    if message is not None:
        assert got == message


def test_messages_non_text_system_block_names_system():
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "system": [{"type": "image", "source": {}}]}
    assert refused(messages_api.front, body, MODEL) == (
        400, "system", "system: a 'image' block is not supported here (this model takes text only)")


def test_messages_count_tokens_takes_the_prompt_fields_only():
    body = {"model": MODEL, "system": "You write Python.", "messages": [{"role": "user", "content": "def add(a, b):"}],
            "thinking": {"type": "disabled"}}
    chat = messages_api.chat_body(body, count_only=True)
    assert chat == {"model": MODEL, "messages": [{"role": "system", "content": "You write Python."},
                                                 {"role": "user", "content": "def add(a, b):"}],
                    "chat_template_kwargs": {"enable_thinking": False}}
    tok = tokenizer()
    text = tok.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    n = tokenize({k: chat[k] for k in ("messages", "chat_template_kwargs")}, tok, 4096)["count"]
    assert n == len(tok.encode(text, add_special_tokens=False)) == 40
    assert refused(messages_api.chat_body, {**body, "max_tokens": 3}, True) == (
        400, "max_tokens", "unknown field 'max_tokens'")


@pytest.mark.parametrize("status,kind", [(400, "invalid_request_error"), (404, "not_found_error"),
                                         (413, "request_too_large"), (429, "rate_limit_error"),
                                         (503, "overloaded_error"), (500, "api_error")])
def test_messages_errors_in_anthropics_shape(status, kind):
    r = messages_api.error_response(ApiError(status, "why", "field", headers={"retry-after": "2"}))
    assert r.status_code == status and r.headers["retry-after"] == "2"
    assert json.loads(r.body) == {"type": "error", "error": {"type": kind, "message": "why"}}


# ---------------------------------------------------------------------------------------------------------------
# Anthropic Messages API: chat answer -> Message, chat chunks -> events


MSG_USAGE = {"input_tokens": 4, "output_tokens": 12, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16}


def test_messages_whole_answer_blocks_and_usage():
    front = messages_api.front({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}, MODEL)[1]
    chat = chat_answer({"content": "Let me check.", "reasoning": "Oslo is a city.", "tool_calls": [CALL]},
                       "tool_calls", USAGE)
    assert stable_ids(front.whole(chat)) == {
        "id": "msg#0", "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "thinking", "thinking": "Oslo is a city.", "signature": ""},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "call_X1", "name": "get_time", "input": {"zone": "UTC"}}],
        "stop_reason": "tool_use", "stop_sequence": None, "usage": MSG_USAGE}


@pytest.mark.parametrize("message,finish,stop_reason,want", [
    ({"content": "a"}, "stop", None, ("end_turn", None)),
    ({"content": "a"}, "stop", 0, ("end_turn", None)),  # (ended by the end token's id)
    ({"content": "a"}, "stop", "\n\n", ("stop_sequence", "\n\n")),
    ({"content": "a"}, "length", None, ("max_tokens", None)),
    ({"content": "", "tool_calls": [CALL]}, "stop", None, ("tool_use", None)),  # a named call: chat says "stop"
])
def test_messages_stop_reasons(message, finish, stop_reason, want):
    front = messages_api.front({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}, MODEL)[1]
    m = front.whole(chat_answer(message, finish, USAGE, stop_reason=stop_reason))
    assert (m["stop_reason"], m["stop_sequence"]) == want


def test_messages_whole_answer_drops_a_call_that_does_not_parse():
    front = messages_api.front({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}, MODEL)[1]
    calls = [{**CALL, "function": {"name": "f", "arguments": "{\"zo"}},
             {**CALL, "id": "call_X2", "function": {"name": "g", "arguments": "[1, 2]"}}]
    m = front.whole(chat_answer({"tool_calls": calls}, "tool_calls", USAGE))
    assert m["content"] == [{"type": "tool_use", "id": "call_X2", "name": "g", "input": {"value": [1, 2]}}]


def test_messages_stream_events_in_order():
    """message_start waits for the first chunk past the role chunk (its usage then names the cached prompt tokens),
    each block is started, streamed and stopped before the next; message_delta carries the stop reason and usage."""
    front = messages_api.front({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                "stream": True}, MODEL)[1]
    u0 = {"prompt_tokens": 20, "completion_tokens": 0, "total_tokens": 20}
    u = {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22,
         "prompt_tokens_details": {"cached_tokens": 16}}
    chunks = [chunk({"role": "assistant", "content": "", "reasoning_content": ""}, usage=u0),
              chunk({"reasoning": "Hm", "reasoning_content": "Hm"}, usage=u),
              chunk({"content": "Hi", "reasoning_content": ""}, usage=u),
              chunk({"content": " there", "reasoning_content": ""}, finish="stop", stop_reason=0, usage=u),
              usage_chunk(USAGE)]
    events = stable_ids(named_events(drain(front, chunks)))
    assert events == [
        {"type": "message_start", "message": {
            "id": "msg#0", "type": "message", "role": "assistant", "model": MODEL, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": 4, "output_tokens": 0, "cache_creation_input_tokens": 0,
                                             "cache_read_input_tokens": 16}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "",
                                                                      "signature": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Hm"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": " there"}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": MSG_USAGE},
        {"type": "message_stop"}]


def test_messages_stream_tool_use_blocks():
    front = messages_api.front({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                "stream": True}, MODEL)[1]
    u = {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}
    call = {"index": 0, "id": "call_X1", "type": "function", "function": {"name": "get_time", "arguments": "{\"zo"}}
    chunks = [chunk({"content": "Ok"}, usage=u), chunk({"tool_calls": [call]}, usage=u),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "ne\": \"UTC\"}"}}]}, usage=u),
              chunk({}, finish="stop", usage=u),  # (a named call ends "stop" on chat)
              usage_chunk({"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29})]
    events = named_events(drain(front, chunks))
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[4] == {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "call_X1", "name": "get_time", "input": {}}}
    assert [e["delta"] for e in events[5:7]] == [{"type": "input_json_delta", "partial_json": "{\"zo"},
                                                 {"type": "input_json_delta", "partial_json": "ne\": \"UTC\"}"}]
    assert events[8]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[8]["usage"] == {"input_tokens": 20, "output_tokens": 9, "cache_creation_input_tokens": 0,
                                  "cache_read_input_tokens": 0}


def test_messages_stream_accumulates_in_the_anthropic_client():
    """The anthropic client's own accumulation of a Messages stream (what messages.stream() runs) ends with the
    blocks, stop reason and usage of the whole answer."""
    from anthropic.lib.streaming._messages import accumulate_event

    front = messages_api.front({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                "stream": True}, MODEL)[1]
    u = {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22,
         "prompt_tokens_details": {"cached_tokens": 16}}
    call = {"index": 0, "id": "call_X1", "type": "function", "function": {"name": "get_time", "arguments": "{\"zo"}}
    chunks = [chunk({"reasoning": "Hm"}, usage=u), chunk({"content": "Ok"}, usage=u),
              chunk({"tool_calls": [call]}, usage=u),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "ne\": \"UTC\"}"}}]}, finish="tool_calls",
                    usage=u),
              usage_chunk(USAGE)]
    snapshot, bufs = None, {}
    for e in named_events(drain(front, chunks)):
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    got = snapshot.model_dump(exclude_none=True)
    assert got["content"] == [{"type": "thinking", "thinking": "Hm", "signature": ""}, {"type": "text", "text": "Ok"},
                              {"type": "tool_use", "id": "call_X1", "name": "get_time", "input": {"zone": "UTC"}}]
    assert (got["stop_reason"], got["usage"]["input_tokens"], got["usage"]["output_tokens"],
            got["usage"]["cache_read_input_tokens"]) == ("tool_use", 4, 12, 16)


def test_messages_stream_error_chunk():
    front = messages_api.front({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}, MODEL)[1]
    events = named_events(drain(front, [{"error": {"message": "boom", "type": "internal_error", "code": 500}}]))
    assert events == [{"type": "error", "error": {"type": "api_error", "message": "boom"}}]


# ---------------------------------------------------------------------------------------------------------------
# SGLang native /generate: request -> completion body


class Words:
    """A tokenizer stand-in for log-prob entries' text: id 7 -> "<7>"."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def _native(n: native_api.Native) -> tuple:
    return n.n, n.start, n.top_n, n.tok, n.score_only, n.rid, n.prompt_ids, n.single


def test_native_text_request_in_sglang_names():
    body = {"text": "Hi", "rid": "r1", "stream": "false", "lora_path": None, "return_hidden_states": False,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "sampling_seed": 3, "min_new_tokens": 2,
                                "stop": ["\n"], "no_stop_trim": True, "stream_interval": 4, "custom_params": None,
                                "top_p": None, "skip_special_tokens": False}}
    out, native = native_api.front(body, MODEL, Words())
    assert out == {"lora_path": None, "return_hidden_states": False, "prompt": "Hi", "max_tokens": 8,
                   "temperature": 0, "seed": 3, "min_tokens": 2, "stop": ["\n"], "no_stop_trim": True,
                   "skip_special_tokens": False, "stream": False, "return_token_ids": True,
                   "return_tokens_as_token_ids": True}
    check_fields(out, "completions")
    assert _native(native) == (1, -1, 0, None, False, "r1", False, True)


def test_native_batch_of_ids_with_logprobs_and_default_max_new_tokens():
    body = {"input_ids": [[5, 6], [7]], "rid": ["a", "b"], "return_prompt_token_ids": True, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True,
            "sampling_params": [{"n": 2}, {"n": 2}]}
    words = Words()
    out, native = native_api.front(body, MODEL, words)
    assert out == {"prompt": [[5, 6], [7]], "max_tokens": 128, "n": 2, "stream": False, "return_token_ids": True,
                   "return_tokens_as_token_ids": True, "logprobs": 2, "prompt_logprobs": 2}
    assert _native(native) == (2, 0, 2, words, False, ["a", "b"], True, False)


def test_native_max_new_tokens_0_scores_the_prompt():
    out, native = native_api.front({"text": "Hi", "sampling_params": {"max_new_tokens": 0}, "return_logprob": True},
                                   MODEL, None)
    assert out == {"prompt": "Hi", "max_tokens": 0, "echo": True, "stream": False, "return_token_ids": True,
                   "return_tokens_as_token_ids": True, "logprobs": 0}
    assert _native(native) == (1, -1, 0, None, True, None, False, True)


@pytest.mark.parametrize("body,param", [
    ({"text": "x", "input_ids": [1, 2]}, "text"),
    ({"sampling_params": {"max_new_tokens": 3}}, "input_ids"),  # (neither)
    ({"text": "x", "sampling_params": {"max_new_token": 3}}, "sampling_params.max_new_token"),
    ({"text": "x", "sampling_params": {"structural_tag": "t"}}, "sampling_params.structural_tag"),
    ({"text": "x", "sampling_params": "greedy"}, "sampling_params"),
    ({"text": "x", "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
    ({"text": "x", "image_data": "a.png"}, "image_data"),
    ({"text": "x", "session_params": {"id": 1}}, "session_params"),
    ({"text": "x", "return_text": True}, "return_text"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 0}, "stream": True}, "stream"),
    ({"input_ids": [[1, 2], [3]], "rid": ["a"]}, "rid"),
    ({"text": "x", "stream": True, "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
    ({"text": "x", "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "x", "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [True, 2]}, "input_ids"),
    ({"text": ["a", 1]}, "text"),
    ({"text": "x", "stream": "maybe"}, "stream"),
])
def test_native_refusals_name_the_field(body, param):
    status, got, _ = refused(native_api.front, body, MODEL, None)
    assert (status, got) == (400, param)


# ---------------------------------------------------------------------------------------------------------------
# SGLang native /generate: completion answer -> outputs


def completion(choices: list[dict], usage: dict | None = None) -> dict:
    base = {"logprobs": None, "finish_reason": "length", "stop_reason": None, "matched_stop": None,
            "prompt_logprobs": None}
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{**base, **c} for c in choices],
            "usage": usage or {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


def _meta(out: dict) -> dict:
    assert isinstance(out["meta_info"].pop("e2e_latency"), float)
    return out


def test_native_single_answer_and_its_finish_reasons():
    out, native = native_api.front({"text": "Hi", "rid": "r1"}, MODEL, None)
    cmpl = completion([{"index": 0, "text": " there!", "token_ids": [1873, 3], "prompt_token_ids": [42, 75],
                        "finish_reason": "stop", "stop_reason": 3, "matched_stop": 3}],
                      {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                       "prompt_tokens_details": {"cached_tokens": 1}})
    assert _meta(native.whole(cmpl)) == {"text": " there!", "output_ids": [1873, 3], "meta_info": {
        "id": "r1", "finish_reason": {"type": "stop", "matched": 3}, "prompt_tokens": 2, "completion_tokens": 2,
        "cached_tokens": 1}}
    no_rid = native_api.front({"text": "Hi"}, MODEL, None)[1]
    for finish, matched, want in [("length", None, {"type": "length", "length": 2}),
                                  ("stop", "\n", {"type": "stop", "matched": "\n"}),
                                  ("error", None, {"type": "abort", "message": "error"})]:
        cmpl["choices"][0].update(finish_reason=finish, matched_stop=matched)
        meta = no_rid.whole(cmpl)["meta_info"]
        assert (meta["id"], meta["finish_reason"]) == ("cmpl-1", want)


def test_native_batch_with_n_is_prompt_major_with_rids_and_prompt_ids():
    native = native_api.front({"text": ["a", "b"], "rid": ["p", "q"], "return_prompt_token_ids": True,
                               "sampling_params": {"n": 2}}, MODEL, None)[1]
    choices = [{"index": i, "text": t, "token_ids": [10 + i], "prompt_token_ids": [67] if i < 2 else [68]}
               for i, t in enumerate(["a0", "a1", "b0", "b1"])]
    outs = [_meta(o) for o in native.whole(completion(choices, {"prompt_tokens": 2, "completion_tokens": 4,
                                                                "total_tokens": 6,
                                                                "prompt_tokens_details": {"cached_tokens": 1}}))]
    assert outs == [{"text": t, "output_ids": [10 + i], "meta_info": {
        "id": rid, "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 1, "completion_tokens": 1,
        "cached_tokens": 0}, "prompt_token_ids": [67] if i < 2 else [68], "index": i}
        for i, (t, rid) in enumerate(zip(["a0", "a1", "b0", "b1"], ["p_0", "p_1", "q_0", "q_1"]))]
    # one rid for a batch, or none: "<rid>_<i>" over all outputs (SGLang's)
    one = native_api.front({"text": ["a", "b"], "rid": "r"}, MODEL, None)[1]
    assert [o["meta_info"]["id"] for o in one.whole(completion(choices[::2]))] == ["r_0", "r_2"]


def test_native_logprobs_as_sglang_triples():
    native = native_api.front({"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 2,
                               "logprob_start_len": 1, "return_text_in_logprobs": True}, MODEL, Words())[1]
    lp = {"tokens": ["token_id:9", "token_id:4"], "token_logprobs": [-0.1, -1.5],
          "top_logprobs": [{"token_id:9": -0.1, "token_id:8": -3.0, "token_id:2": -2.5},
                           {"token_id:4": -1.5, "token_id:1": -0.5}],
          "text_offset": [0, 11]}
    plp = [None, {"6": {"logprob": -2.0, "rank": 3, "decoded_token": "<6>"},
                  "1": {"logprob": -0.2, "rank": 1, "decoded_token": "<1>"},
                  "2": {"logprob": -1.0, "rank": 2, "decoded_token": "<2>"}},
           {"7": {"logprob": -0.3, "rank": 1, "decoded_token": "<7>"},
            "3": {"logprob": -1.4, "rank": 2, "decoded_token": "<3>"}}]
    out = _meta(native.whole(completion([{"index": 0, "text": "xy", "token_ids": [9, 4], "prompt_token_ids": [5, 6, 7],
                                          "logprobs": lp, "prompt_logprobs": plp}])))
    assert out["meta_info"] == {
        "id": "cmpl-1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
        "cached_tokens": 0,
        "input_token_logprobs": [[-2.0, 6, "<6>"], [-0.3, 7, "<7>"]],
        "input_top_logprobs": [[[-0.2, 1, "<1>"], [-1.0, 2, "<2>"]], [[-0.3, 7, "<7>"], [-1.4, 3, "<3>"]]],
        "output_token_logprobs": [[-0.1, 9, "<9>"], [-1.5, 4, "<4>"]],
        "output_top_logprobs": [[[-0.1, 9, "<9>"], [-2.5, 2, "<2>"]], [[-0.5, 1, "<1>"], [-1.5, 4, "<4>"]]]}


def test_native_scoring_answer_has_no_output():
    native = native_api.front({"text": "Hi", "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                               "logprob_start_len": 0}, MODEL, None)[1]
    echo_lp = {"tokens": ["token_id:42", "token_id:75"], "token_logprobs": [None, -1.0],
               "top_logprobs": [None, {"token_id:75": -1.0}], "text_offset": [0, 11]}
    plp = [None, {"75": {"logprob": -1.0, "rank": 1, "decoded_token": "token_id:75"}}]
    out = _meta(native.whole(completion([{"index": 0, "text": "Hi", "token_ids": [], "prompt_token_ids": [42, 75],
                                          "logprobs": echo_lp, "prompt_logprobs": plp}])))
    assert out == {"text": "", "output_ids": [], "meta_info": {
        "id": "cmpl-1", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": 2, "completion_tokens": 0,
        "cached_tokens": 0, "input_token_logprobs": [[None, 42, None], [-1.0, 75, None]],
        "output_token_logprobs": []}}


def test_native_stream_sends_the_text_so_far_then_done():
    native = native_api.front({"text": "Hi", "stream": True, "return_logprob": True}, MODEL, None)[1]

    def part(text, ids, finish=None, **extra):
        c = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish,
             "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5] * len(ids),
                          "top_logprobs": [{f"token_id:{i}": -0.5} for i in ids], "text_offset": [0] * len(ids)},
             **extra}
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL, "choices": [c]}

    chunks = [part(" the", [1], prompt_token_ids=[42, 75]), part("re", [2]),
              part("!", [3], "stop", matched_stop="!", stop_reason="!"),
              {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL, "choices": [],
               "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}]
    events = data_events(drain(native, chunks))
    assert events[-1] == "[DONE]" and len(events) == 4
    outs = [_meta(e) for e in events[:-1]]
    assert [(o["text"], o["output_ids"], o["meta_info"]["finish_reason"], o["meta_info"]["completion_tokens"])
            for o in outs] == [(" the", [1], None, 1), (" there", [1, 2], None, 2),
                               (" there!", [1, 2, 3], {"type": "stop", "matched": "!"}, 3)]
    assert all(o["meta_info"]["prompt_tokens"] == 2 and o["meta_info"]["id"] == "cmpl-1" for o in outs)
    assert outs[-1]["meta_info"]["output_token_logprobs"] == [[-0.5, 1, None], [-0.5, 2, None], [-0.5, 3, None]]
    assert outs[-1]["meta_info"]["input_token_logprobs"] == []
    err = {"error": {"message": "boom", "type": "internal_error", "param": None, "code": 500}}
    assert data_events(drain(native_api.front({"text": "Hi", "stream": True}, MODEL, None)[1], [err])) == [
        err, "[DONE]"]


def test_native_model_and_server_info():
    info = {"model": "/m/tiny", "k": 3, "dp": 2, "max_model_len": 4096}
    assert native_api.model_info(info, "/m/tok") == {"model_path": "/m/tiny", "tokenizer_path": "/m/tok",
                                                     "is_generation": True, "preferred_sampling_params": None,
                                                     "weight_version": None}
    s = native_api.server_info(info, "/m/tok", MODEL, {"spec_decode_num_drafts_total": 10.0,
                                                       "spec_decode_num_accepted_tokens_total": 15.0})
    assert {k: s[k] for k in ("served_model_name", "context_length", "dp_size", "tp_size", "ep_size",
                              "enable_dp_attention", "speculative_algorithm", "speculative_num_steps",
                              "speculative_eagle_topk", "speculative_num_draft_tokens", "internal_states")} == {
        "served_model_name": MODEL, "context_length": 4096, "dp_size": 2, "tp_size": 1, "ep_size": 2,
        "enable_dp_attention": True, "speculative_algorithm": "NEXTN", "speculative_num_steps": 3,
        "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
        "internal_states": [{"avg_spec_accept_length": 2.5}]}
    off = native_api.server_info({**info, "k": 0, "dp": 1}, "/m/tok", MODEL, {})
    assert (off["speculative_algorithm"], off["speculative_num_steps"], off["enable_dp_attention"],
            off["internal_states"]) == (None, None, False, [{"avg_spec_accept_length": None}])
