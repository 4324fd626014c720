"""The Serve app built from deployments/qwen35_mtp.yaml, driven with the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest
import requests
import yaml

from mtp_ray import LLM, SamplingParams
from tests.conftest import SERVE_PORT

pytestmark = pytest.mark.serve  # (Ray Serve: its own worker and cluster under -n 2, conftest.worker_of)

PORT = SERVE_PORT
BASE = f"http://127.0.0.1:{PORT}"
YAML = Path(__file__).resolve().parent.parent / "deployments" / "qwen35_mtp.yaml"


def app_spec() -> dict:
    return yaml.safe_load(YAML.read_text())["applications"][0]


@pytest.fixture(scope="module")
def server(serve_http):
    serve = serve_http

    from mtp_ray.serve.app import build_app

    spec = app_spec()
    # one group for this module (health, abort counters and routing observed on it); scaling is tested elsewhere
    spec["args"]["group"] = {"num_replicas": 1}
    spec["args"]["engine"]["warmup"] = "none"  # (CPU: a faster start; the warmup has tests of its own)
    serve.run(build_app(spec["args"]), name=spec["name"], route_prefix=spec["route_prefix"])
    yield spec
    serve.delete(spec["name"])


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(server):
    eng = server["args"]["engine"]
    return LLM(num_speculative_tokens=eng["spec"]["num_speculative_tokens"],
               max_model_len=eng["scheduler"]["max_model_len"])


MODEL = "tiny-qwen35-mtp"
PROMPTS = ["def main(", "import os\nimport sys\n\n", "class Node:\n    def __init__(self", "x = ["]


def test_completions_greedy_equal_offline(client, offline):
    ref = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for p, r in zip(PROMPTS, ref):
        out = client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
        assert out.choices[0].text == r.outputs[0].text
        assert out.usage.completion_tokens == len(r.outputs[0].token_ids)
        assert out.usage.prompt_tokens == len(r.prompt_token_ids)
        assert out.choices[0].finish_reason == r.outputs[0].finish_reason
    ids = offline.tokenizer.encode(PROMPTS[0])
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert out.choices[0].text == ref[0].outputs[0].text


def test_presence_and_frequency_penalties_equal_offline(client, offline):
    """OpenAI's own penalty fields through the official client (chat and completions) give the offline engine's
    tokens with the same penalties, and differ from the unpenalized output."""
    pen = {"presence_penalty": 0.6, "frequency_penalty": 1.2}
    ref = offline.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **pen))
    plain = offline.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in ref] != [r.outputs[0].token_ids for r in plain]
    for p, r in zip(PROMPTS[:2], ref, strict=True):
        out = client.completions.create(model=MODEL, prompt=p, max_tokens=32, temperature=0,
                                        extra_body={"ignore_eos": True}, **pen)
        assert out.choices[0].text == r.outputs[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=8, temperature=0, **pen)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1


def test_bad_words_equal_offline(client, offline):
    """vLLM's bad_words (extra_body) are tokenised by the ingress as by the offline API: the server's tokens are the
    offline engine's with the same words, which never hold a banned token and differ from the unconstrained ones."""
    base = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    plain = offline.generate(PROMPTS[2], SamplingParams(**base))[0].outputs[0]
    word = next(w for w in (offline.tokenizer.decode([t]).strip() for t in plain.token_ids) if w.isalpha())
    sp = SamplingParams(bad_words=[word], **base)
    ref = offline.generate(PROMPTS[2], sp)[0].outputs[0]
    assert ref.token_ids != plain.token_ids
    assert not {q[0] for q in sp.bad_words_token_ids if len(q) == 1} & set(ref.token_ids)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True, "bad_words": [word]})
    assert out.choices[0].text == ref.text


def test_logit_bias_and_tools_through_the_client(client):
    """logit_bias from the official client forces a token; tools are rendered into the prompt with tool_choice
    'none' (tool calling itself: test_serve_structured.py)."""
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                    logit_bias={"300": 100})
    tok = requests.post(f"{BASE}/tokenize", json={"model": MODEL, "prompt": out.choices[0].text}).json()["tokens"]
    assert tok == [300] * 6
    tools = [{"type": "function", "function": {"name": "get_time", "description": "the time",
                                               "parameters": {"type": "object", "properties": {}}}}]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "time?"}],
                                          max_tokens=4, temperature=0, tools=tools, tool_choice="none")
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens == 4
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "time?"}],
                                           max_tokens=4, temperature=0)
    assert chat.usage.prompt_tokens >= plain.usage.prompt_tokens


def test_echo_puts_the_prompt_before_the_completion(client, offline):
    """echo (completions): the prompt's text, then the completion's, streamed or not; a token-id prompt echoes its
    decoded text; echo with logprobs scores the prompt's tokens too."""
    base = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0).choices[0].text
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, echo=True)
    assert out.choices[0].text == PROMPTS[1] + base and out.usage.completion_tokens == 12
    chunks = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPTS[1] + base
    ids = offline.tokenizer.encode(PROMPTS[1])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, echo=True)
    assert by_ids.choices[0].text == offline.tokenizer.decode(ids) + base
    r = post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[1], "echo": True, "logprobs": 1,
                                 "max_tokens": 2, "temperature": 0}).json()["choices"][0]["logprobs"]
    assert len(r["tokens"]) == len(ids) + 2 and r["token_logprobs"][0] is None  # the prompt's, then the output's
    # chat echo: the final assistant message, which the reply continues, goes before the reply
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "def f("}]
    r = post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "echo": True, "max_tokens": 3,
                                      "continue_final_message": True, "add_generation_prompt": False})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("def f(")


def test_completions_streaming_equals_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # vLLM's defaults (server.enable_prompt_tokens_details / enable_force_include_usage off): usage holds the three
    # counts only, and a stream without stream_options has none
    assert full.usage.prompt_tokens_details is None
    plain = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, stream=True))
    assert plain and all(c.usage is None and c.choices for c in plain)


def sse(path: str, body: dict) -> list[dict]:
    r = requests.post(f"{BASE}{path}", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("extra", [{"stop": ["\n\n"]}, {"echo": True}, {"echo": True, "stop": [")\n"]}])
def test_streamed_logprobs_and_token_ids_add_up_to_the_whole_response(server, extra):
    """Concatenated over the chunks, a stream's log-prob sections and token ids equal the whole response's. With a
    stop string the stream holds text back (it may be the start of the stop), but text_offset still counts every
    token's string (it once counted the text sent so far); echo's offsets run on after the prompt's."""
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "logprobs": 2,
            "return_token_ids": True, **extra}
    whole = post("/v1/completions", body).json()["choices"][0]
    parts = [c["choices"][0] for c in sse("/v1/completions", body) if c["choices"]]
    lp = {k: [x for p in parts if p["logprobs"] for x in p["logprobs"][k]] for k in whole["logprobs"]}
    assert lp == whole["logprobs"]
    assert "".join(p["text"] for p in parts) == whole["text"]
    assert [t for p in parts for t in p["token_ids"]] == whole["token_ids"]
    assert parts[0]["prompt_token_ids"] == whole["prompt_token_ids"] and "prompt_token_ids" not in parts[1]


def test_streamed_chat_names_the_prompt_ids_in_its_first_chunk(server):
    """return_token_ids in a chat stream (vLLM): the prompt's ids at the top of the first chunk, none after it;
    the generated ids per chunk."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 8,
            "temperature": 0, "return_token_ids": True}
    whole = post("/v1/chat/completions", body).json()
    chunks = sse("/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"] and len(whole["prompt_token_ids"]) > 4
    assert not any("prompt_token_ids" in c for c in chunks[1:])
    assert [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []] == \
        whole["choices"][0]["token_ids"]


def test_responses_api_equals_chat_streamed_or_not(client):
    """POST /v1/responses (OpenAI's Responses API, through the official client): the same greedy text and usage as
    the chat completion of the same messages; streamed, the events in order (each item added, its deltas, done)
    add up to the same output, ending in response.incomplete at max_output_tokens."""
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    kw = dict(model=MODEL, instructions="You write Python.", max_output_tokens=10, temperature=0,
              input=[{"role": "user", "content": [{"type": "input_text", "text": "def add(a, b):"}]}])
    r = client.responses.create(**kw)
    assert r.output_text == chat.choices[0].message.content and r.status == "incomplete"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.incomplete_details.reason == "max_output_tokens" and [o.type for o in r.output] == ["message"]
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.incomplete"
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text and events[-1].response.usage.output_tokens == 10
    # a Response's usage names its cached prompt tokens whatever server.enable_prompt_tokens_details says (as vLLM's)
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0  # the same prompt, three times


def test_anthropic_messages_equal_chat_streamed_or_not(client):
    """POST /v1/messages (Anthropic's Messages API, through the official anthropic client): the same greedy text and
    token counts as the chat completion of the same messages; streamed, the events in order add up to the same
    message; stop_sequences end it as stop_sequence; count_tokens counts the prompt; thinking gives a thinking block
    (the reasoning parser's); bad requests are a 400 in Anthropic's error shape."""
    import anthropic

    ac = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "You write Python."},
                                                                 *msgs], max_tokens=10, temperature=0)
    # (temperature: the API's older versions' field; its current client sends it as an extra)
    kw = dict(model=MODEL, system="You write Python.", messages=msgs, max_tokens=10, extra_body={"temperature": 0})
    m = ac.messages.create(**kw)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == 10
    assert ac.messages.count_tokens(model=MODEL, system=kw["system"], messages=msgs).input_tokens == \
        chat.usage.prompt_tokens
    events = list(ac.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"], kinds
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == m.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 10
    with ac.messages.stream(**kw) as stream:  # the SDK's own accumulation of the events
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == "max_tokens"
    cut = m.content[0].text[3:6]
    stopped = ac.messages.create(**{**kw, "stop_sequences": [cut]})
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == cut
    assert stopped.content[0].text == m.content[0].text[: m.content[0].text.index(cut)]
    think = ac.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    want = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "You write Python."},
                                                                 *msgs], max_tokens=10, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert think.content[0].type == "thinking" and think.content[0].thinking == want.choices[0].message.reasoning
    raw = {"model": MODEL, "messages": msgs, "max_tokens": 4}
    image = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
    for body, param in (({"model": MODEL, "messages": msgs}, "max_tokens"), ({**raw, "messages": image}, "image"),
                        ({**raw, "top_n": 3}, "top_n")):
        r = requests.post(f"{BASE}/v1/messages", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and param in r.json()["error"]["message"], r.text
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(**{**kw, "model": "claude-nope"})
    # a last assistant message is a prefill, continued (chat's continue_final_message); output_config.format holds
    prefill = [*msgs, {"role": "assistant", "content": "    return"}]
    cont = ac.messages.create(**{**kw, "messages": prefill})
    want = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "You write Python."},
                                                                 *prefill], max_tokens=10, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert cont.content[0].text == want.choices[0].message.content
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    fmt = ac.messages.create(**{**kw, "max_tokens": 20, "output_config": {"format": {"type": "json_schema",
                                                                                    "schema": schema}}})
    assert set(json.loads(fmt.content[0].text)) == {"a"}


def test_anthropic_tool_use_round_trip(client):
    """Forced tool use ({"type": "any"}) answers a tool_use block whose input holds the schema, streamed too
    (input_json_delta events the SDK accumulates); the conversation with the call and its tool_result continues."""
    import anthropic

    ac = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": "get_time", "description": "the time in a zone", "input_schema": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "time?"}], tools=tools, max_tokens=40,
              tool_choice={"type": "any"}, extra_body={"temperature": 0})
    m = ac.messages.create(**kw)
    call = next(b for b in m.content if b.type == "tool_use")
    assert m.stop_reason == "tool_use" and call.name == "get_time" and call.input["zone"] in ("UTC", "CET"), m
    with ac.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [call.input]
    # a named tool: chat ends it "stop" (as OpenAI's), Anthropic's stop_reason is tool_use, streamed or not
    named = {**kw, "tool_choice": {"type": "tool", "name": "get_time"}}
    assert ac.messages.create(**named).stop_reason == "tool_use"
    with ac.messages.stream(**named) as stream:
        assert stream.get_final_message().stop_reason == "tool_use"
    # message_start's usage is the end's (the prompt's cached tokens apart), also when the cache holds most of it
    events = list(ac.messages.create(stream=True, **named))
    start, end = events[0].message.usage, events[-2].usage
    assert (start.input_tokens, start.cache_read_input_tokens) == (end.input_tokens, end.cache_read_input_tokens)
    assert end.cache_read_input_tokens > 0  # the same prompt, four times
    turn = [{"role": "user", "content": "time?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                               "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12:00"}]}]
    again = ac.messages.create(model=MODEL, messages=turn, tools=tools, max_tokens=3)
    total = [u.input_tokens + u.cache_read_input_tokens for u in (again.usage, m.usage)]
    assert again.usage.output_tokens >= 1 and total[0] > total[1], total


def test_responses_api_function_calls_formats_and_refusals(client):
    """Forced function calls come back as function_call items, and a conversation carrying a call and its output
    continues; a JSON schema format holds; what a stateless server cannot do is a 400 naming the field."""
    import openai

    tools = [{"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}]
    r = client.responses.create(model=MODEL, input="time?", tools=tools, tool_choice="required", temperature=0,
                                max_output_tokens=40)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    turn = [{"role": "user", "content": "time?"}, {"type": "function_call", "call_id": call.call_id,
                                                   "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    assert client.responses.create(model=MODEL, input=turn, tools=tools, max_output_tokens=3).usage.output_tokens
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=20, temperature=0,
                                text={"format": {"type": "json_schema", "name": "p", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"a"}
    # the sampling extras the chat route honours (vLLM and SGLang take them here too)
    pen = dict(model=MODEL, input="x x x", max_output_tokens=8, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x x x"}],
                                           max_tokens=8, temperature=0, frequency_penalty=2.0)
    assert client.responses.create(**pen, extra_body={"frequency_penalty": 2.0}).output_text == \
        plain.choices[0].message.content
    for extra, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"tools": [{"type": "web_search"}]}, "tools"),
                         ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
                         ({"extra_body": {"n": 2}}, "n"), ({"extra_body": {"top_k": -5}}, "top_k")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": MODEL, "input": "x", "max_output_tokens": 2, **extra})
        assert e.value.body["param"] == param, e.value.body


def test_sglang_native_generate(server, offline):
    """POST /generate (SGLang's native API, as its RL and script clients call it): greedy text and ids equal the
    offline engine's, for text and a batch of input_ids; streamed, each event holds the text and ids so far; log-probs
    as [logprob, id, text] triples (the greedy token first among the alternatives), the prompt's from
    logprob_start_len, and with max_new_tokens 0 the prompt's alone; stops name what matched; bad fields get a 400.
    GET /get_server_info names the MTP settings and the mean acceptance length so far (sglang.bench_serving's)."""
    ref = offline.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12))
    greedy = {"max_new_tokens": 12, "temperature": 0}
    one = post("/generate", {"text": PROMPTS[0], "sampling_params": greedy, "stream": "false"}).json()  # (lax bool)
    assert one["text"] == ref[0].outputs[0].text and one["output_ids"] == ref[0].outputs[0].token_ids
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12} and meta["completion_tokens"] == 12
    assert meta["prompt_tokens"] == len(ref[0].prompt_token_ids) and meta["e2e_latency"] > 0
    batch = post("/generate", {"input_ids": [r.prompt_token_ids for r in ref], "sampling_params": [greedy] * 2,
                               "rid": ["a", "b"], "return_prompt_token_ids": True}).json()
    assert [b["text"] for b in batch] == [r.outputs[0].text for r in ref] and [b["index"] for b in batch] == [0, 1]
    assert [b["meta_info"]["id"] for b in batch] == ["a", "b"]
    assert [b["prompt_token_ids"] for b in batch] == [r.prompt_token_ids for r in ref]
    r = requests.post(f"{BASE}/generate", json={"text": PROMPTS[0], "sampling_params": greedy, "stream": True},
                      timeout=60)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    outs = [json.loads(e) for e in events[:-1]]
    assert outs[-1]["text"] == one["text"] and outs[-1]["output_ids"] == one["output_ids"]
    assert outs[-1]["meta_info"]["finish_reason"] == meta["finish_reason"]
    assert all(a["text"] == b["text"][: len(a["text"])] and a["meta_info"]["finish_reason"] is None
               for a, b in zip(outs, outs[1:]))
    lp = post("/generate", {"text": PROMPTS[0], "sampling_params": greedy, "return_logprob": True,
                            "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True}).json()
    m = lp["meta_info"]
    assert [t[1] for t in m["output_token_logprobs"]] == one["output_ids"]
    assert all(isinstance(t[0], float) and t[0] <= 0 and isinstance(t[2], str) for t in m["output_token_logprobs"])
    assert all(len(top) == 2 and top[0][1] == t[1] and top[0][0] >= top[1][0]
               for t, top in zip(m["output_token_logprobs"], m["output_top_logprobs"]))
    assert [t[1] for t in m["input_token_logprobs"]] == ref[0].prompt_token_ids
    assert m["input_token_logprobs"][0][0] is None and m["input_top_logprobs"][0] is None
    r = requests.post(f"{BASE}/generate", json={"text": PROMPTS[0], "sampling_params": greedy, "stream": True,
                                                "return_logprob": True, "top_logprobs_num": 2}, timeout=60)
    last = json.loads([line[6:] for line in r.text.splitlines() if line.startswith("data: {")][-1])["meta_info"]
    assert [t[:2] for t in last["output_token_logprobs"]] == [t[:2] for t in m["output_token_logprobs"]]
    assert last["output_top_logprobs"] == [[t[:2] + [None] for t in top] for top in m["output_top_logprobs"]]
    score = post("/generate", {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                               "logprob_start_len": 0}).json()
    assert score["text"] == "" and score["output_ids"] == [] and score["meta_info"]["output_token_logprobs"] == []
    assert score["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert "input_top_logprobs" not in score["meta_info"]  # (top_logprobs_num 0: no top lists, as SGLang)
    assert [t[:2] for t in score["meta_info"]["input_token_logprobs"]] == \
        [t[:2] for t in m["input_token_logprobs"]]
    stop_id = one["output_ids"][3]
    stopped = post("/generate", {"text": PROMPTS[0], "sampling_params": {**greedy, "stop_token_ids": [stop_id]}})
    fin = stopped.json()["meta_info"]["finish_reason"]
    assert fin["type"] == "stop" and fin["matched"] == stop_id, stopped.text
    n2 = post("/generate", {"text": PROMPTS[0], "sampling_params": {**greedy, "n": 2}}).json()
    assert isinstance(n2, list) and [o["text"] for o in n2] == [one["text"]] * 2
    info, eng = requests.get(f"{BASE}/get_server_info").json(), server["args"]["engine"]
    k = eng["spec"]["num_speculative_tokens"]
    assert info["context_length"] == eng["scheduler"]["max_model_len"] and info["speculative_num_steps"] == k > 0
    assert 1 <= info["internal_states"][0]["avg_spec_accept_length"] <= k + 1, info
    for body, param in [({"text": "x", "input_ids": [1, 2]}, "text"),
                        ({"text": "x", "sampling_params": {"max_new_token": 3}}, "sampling_params.max_new_token"),
                        ({"text": "x", "image_data": "a.png"}, "image_data"),
                        ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
                        ({"text": "x", "sampling_params": {"max_new_tokens": 0}, "stream": True}, "stream"),
                        ({"input_ids": [[1, 2], [3]], "rid": ["a"]}, "rid"),
                        ({"text": "x", "stream": True, "return_logprob": True, "logprob_start_len": 0},
                         "logprob_start_len"),
                        ({"input_ids": [1, "2"]}, "input_ids"),
                        ({"text": "x", "sampling_params": [{"n": 1}, {"n": 2}], }, "sampling_params")]:
        r = post("/generate", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


NATIVE_FUZZ = {"text": ["x", ["a", "b"], "", 5, [], None], "input_ids": [[1, 2, 3], [[1], [2, 3]], [], [-1], [10**9]],
               "sampling_params": [{}, {"max_new_tokens": -1}, {"temperature": "hot"}, {"top_k": -1},
                                   {"stop": ["\n"], "n": 2}, [], [{"n": 1}], "x", {"max_new_tokens": 0},
                                   {"top_p": 0.5, "sampling_seed": 3}, {"stop_token_ids": [10**9]}],
               "stream": [True, False, "yes"], "return_logprob": [True, False], "top_logprobs_num": [0, 3, -2, "a"],
               "logprob_start_len": [-1, 0, 1, 999, "z"], "rid": ["r", ["r"], 5], "return_text_in_logprobs": [True]}


def fuzz_answer(path: str, body: dict, codes: dict[int, int]) -> requests.Response:
    """A fuzzed body's answer: a 200 (a stream ending in [DONE]) or a 400 with a message, counted in codes."""
    r = post(path, body)
    assert r.status_code in (200, 400), (body, r.status_code, r.text)
    codes[r.status_code] += 1
    if r.status_code == 400:
        assert r.json()["error"]["message"], body
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]"), (body, r.text[-300:])
    return r


def test_random_generate_requests_get_200_or_400(server):
    """Seeded random /generate bodies (SGLang's native API): each a 200 (a stream ending in [DONE]) or a 400 naming
    the problem, and the group never restarts."""
    import random

    rng = random.Random(11)
    before = requests.get(f"{BASE}/admin/health").json()
    codes = {200: 0, 400: 0}
    for _ in range(40):
        body = {rng.choice(["text", "input_ids"]): "x"}
        for key in rng.sample(sorted(NATIVE_FUZZ), rng.randint(1, 4)):
            body[key] = rng.choice(NATIVE_FUZZ[key])
        if isinstance(body.get("sampling_params", {}), dict):  # short answers (SGLang's default is 128 tokens)
            body["sampling_params"] = {"max_new_tokens": 3, **body.get("sampling_params", {})}
        fuzz_answer("/generate", {k: v for k, v in body.items() if v is not None}, codes)
    after = requests.get(f"{BASE}/admin/health").json()
    assert after["healthy"] and after["restarts"] == before["restarts"], after
    assert codes[200] >= 5 and codes[400] >= 5, codes


def test_what_vllm_and_sglang_clients_send_by_default(server, client):
    """The OpenAI SDK's Responses call with its defaults spelled out (tool_choice "auto" without tools, store,
    parallel_tool_calls, truncation "disabled") is answered, streamed or not; chat takes tool_choice "none" without
    tools (vLLM) and refuses any other with vLLM's words; a context-length 400 carries vLLM's and SGLang's wording;
    usage names the reasoning tokens as OpenAI and as SGLang do."""
    kw = dict(model=MODEL, input="The capital of France is", temperature=0.0, top_p=1.0, max_output_tokens=4,
              store=True, parallel_tool_calls=True, tool_choice="auto", truncation="disabled")
    assert client.responses.create(**kw).usage.output_tokens == 4
    assert list(client.responses.create(stream=True, **kw))[-1].response.usage.output_tokens == 4
    msgs = [{"role": "user", "content": "hi"}]
    assert post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2,
                                         "tool_choice": "none"}).status_code == 200
    r = post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2, "tool_choice": "auto"})
    assert r.status_code == 400 and "When using `tool_choice`, `tools` must be set" in r.json()["error"]["message"]
    for body, sglang in [({"messages": [{"role": "user", "content": "hello " * 3000}]},
                          "is longer than the model's context length"),
                         ({"messages": msgs, "max_tokens": 10**6}, "Requested token count exceeds the model's "
                                                                    "maximum context")]:
        err = post("/v1/chat/completions", {"model": MODEL, **body}).json()["error"]["message"]
        assert "This model's maximum context length is" in err and sglang in err, err
    u = post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0,
                                      "chat_template_kwargs": {"enable_thinking": True}}).json()["usage"]
    assert u["reasoning_tokens"] == u["completion_tokens_details"]["reasoning_tokens"] > 0
    # booleans as pydantic's lax mode (vLLM's and SGLang's request models) reads them; anything else a 400
    r = post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2, "logprobs": "true",
                                      "top_logprobs": 2, "stream": "False"})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    r = post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2, "logprobs": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    # vLLM's logprob_token_ids: those tokens' log-probs in place of the top alternatives, chat and completions
    named = [100, 1000, 1500]
    r = post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0,
                                      "logprobs": True, "top_logprobs": 3, "logprob_token_ids": named,
                                      "return_tokens_as_token_ids": True})
    for pos in r.json()["choices"][0]["logprobs"]["content"]:
        assert [e["token"] for e in pos["top_logprobs"]] == [f"token_id:{t}" for t in named]
    r = post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0, "logprobs": 0,
                                 "logprob_token_ids": named, "return_tokens_as_token_ids": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert all({f"token_id:{t}" for t in named} <= set(top) for top in lp["top_logprobs"])
    r = post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2, "logprob_token_ids": named})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids"


def test_chat_greedy_equals_offline_and_streams(client, offline):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    text = offline.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ref = offline.generate(text, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_seed_logprobs_and_stop(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, n=2, seed=5,
                                    logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    again = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, n=2, seed=5,
                                      logprobs=2)
    assert [c.text for c in out.choices] == [c.text for c in again.choices]
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
        # the top 2 and, as vLLM, the sampled token when it is not among them
        assert all(2 <= len(t) <= 3 and tok in t for t, tok in zip(lp.top_logprobs, lp.tokens, strict=True))
        assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    assert len(chat.choices[0].logprobs.content) == 5
    assert all(len(e.top_logprobs) == 3 for e in chat.choices[0].logprobs.content)
    # the engine's max_logprobs (20, vLLM's default) caps every log-prob count; -1 (the vocabulary) is past it
    for path, extra in (("/v1/completions", {"prompt": "x", "logprobs": 21}),
                        ("/v1/completions", {"prompt": "x", "echo": True, "prompt_logprobs": -1}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                                  "top_logprobs": -1})):
        r = post(path, {"model": MODEL, "max_tokens": 2, **extra})
        assert r.status_code == 400 and "which is greater than max allowed: 20" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] in ("logprobs", "prompt_logprobs"), r.text
    base = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0).choices[0].text
    stop = base[10:13]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == base[: base.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_vllm_extra_fields_through_extra_body(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0.7, extra_body={
        "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 20,
        "stop_token_ids": [0]})
    assert out.usage.completion_tokens == 20
    first = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    tok = requests.post(f"{BASE}/tokenize", json={"model": MODEL, "prompt": first.choices[0].text}).json()["tokens"]
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                        extra_body={"stop_token_ids": tok[:1]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1


@pytest.mark.parametrize("stream", [False, True])
def test_use_beam_search_gives_the_offline_beams(client, offline, stream):
    """vLLM's use_beam_search (its test_batch_completions: n = 2 beams per prompt; the beams differ, two copies of
    a prompt give the same ones): the n best of LLM.beam_search, without the prompt, with their finish reasons and
    usage, streamed or not; chat too; a field a search cannot honour is a 400 naming it."""
    from mtp_ray.beam_search import BeamSearchParams

    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    ref = offline.beam_search(prompts[:2], BeamSearchParams(beam_width=2, max_tokens=5))
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0.0, stream=stream,
                                    extra_body={"use_beam_search": True, "return_token_ids": True})
    ids: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in (out if stream else [out]):
        for c in chunk.choices:
            ids[c.index] = ids.get(c.index, []) + (getattr(c, "token_ids", None) or [])
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert sorted(ids) == list(range(6))
    assert texts[0] != texts[1] and (texts[0], texts[1]) == (texts[4], texts[5])
    for i, r in enumerate(ref):
        n_prompt = len(offline.encode(prompts[i])[1])
        for j, seq in enumerate(r.sequences):
            assert ids[2 * i + j] == seq.tokens[n_prompt:], (i, j)
            assert finish[2 * i + j] == seq.finish_reason
    if not stream:
        assert out.usage.completion_tokens == sum(len(v) for v in ids.values())
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=4, extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content
    for extra, param in (({"stop": ["x"]}, "stop"), ({"n": 11}, "n"), ({"presence_penalty": 0.5}, "presence_penalty")):
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "use_beam_search": True, **extra}
        r = requests.post(f"{BASE}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = requests.post(f"{BASE}/v1/completions", json={"model": MODEL, "prompt": "x", "length_penalty": 0.5},
                      timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty", r.text


def test_server_load_and_full_bodies_as_vllm(server, client):
    """vLLM's GET /load counts the generation requests being answered (a stream until its end) and its
    test_invocations compares the openai client's model_dump of a chat completion with the raw JSON of the same
    request through /invocations: every field the client's models declare is in the body (null where unset); an
    empty prompt names vLLM's rule."""
    from concurrent.futures import ThreadPoolExecutor

    def load() -> int:
        return requests.get(f"{BASE}/load", timeout=10).json()["server_load"]

    assert load() == 0
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    with requests.post(f"{BASE}/v1/completions", json={**body, "max_tokens": 2000, "stream": True}, stream=True,
                       timeout=120) as r:
        lines = r.iter_lines()  # (kept: a dropped iterator closes the connection, and the stream ends)
        next(lines)  # the stream has started (2000 tokens: it outlasts the request below)
        assert load() == 1
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(post, "/v1/completions", body)
            seen = set()
            while not whole.done():
                seen.add(load())
            assert whole.result().status_code == 200 and 2 in seen, seen
        assert load() == 1  # the stream, until its end
    deadline = time.monotonic() + 10  # its client went away: it ended
    while load() != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load() == 0
    args = {"model": MODEL, "messages": [{"role": "user", "content": "what is 1+1?"}], "max_completion_tokens": 5,
            "temperature": 0.0, "logprobs": False}
    dumped = client.chat.completions.create(**args).model_dump()
    raw = requests.post(f"{BASE}/invocations", json=args, timeout=60).json()
    assert dumped.keys() == raw.keys() and dumped["choices"] == raw["choices"]
    r = post("/v1/completions", {"model": MODEL, "prompt": None, "prompt_embeds": []})
    assert "Either prompt or prompt_embeds must be provided and non-empty" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_stop_strings(client, stream):
    """vLLM: stop strings are looked for only past min_tokens tokens; a stop met before then is not one."""
    base = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0).choices[0].text
    stop = base[1:4]  # inside the first tokens
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop], stream=stream)
    if stream:
        chunks = list(client.completions.create(**kw, extra_body={"min_tokens": 8}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    else:
        out = client.completions.create(**kw, extra_body={"min_tokens": 8}).choices[0]
        text, reason = out.text, out.finish_reason
    assert len(client.completions.create(**{**kw, "stream": False}).choices[0].text) < 4  # without it: cut there
    assert text.startswith(base[:4]) and reason in ("length", "stop"), (text, base, stop, reason)  # not cut early


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_and_min_tokens_text_as_vllm(client, offline, stream):
    """vLLM: a stop token (stop_token_ids) ends the text before it unless include_stop_str_in_output (its text was
    in the output either way); a stop string ending exactly at the min_tokens-th token is not a stop (it was)."""
    tok = offline.tokenizer
    ids = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    ids = ids.token_ids
    i = next(i for i in range(2, 8) if tok.decode(ids[i : i + 1]).strip() and ids[i] not in ids[:i])

    def text(**extra) -> tuple[str, str]:
        kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=stream, extra_body=extra)
        if not stream:
            c = client.completions.create(**kw).choices[0]
            return c.text, c.finish_reason
        chunks = [c.choices[0] for c in client.completions.create(**kw) if c.choices]
        return "".join(c.text for c in chunks), next(c.finish_reason for c in chunks if c.finish_reason)

    assert text(stop_token_ids=[ids[i]]) == (tok.decode(ids[:i]), "stop")
    assert text(stop_token_ids=[ids[i]], include_stop_str_in_output=True) == (tok.decode(ids[: i + 1]), "stop")
    got, _ = text(ignore_eos=True, min_tokens=i + 1, stop=[tok.decode(ids[i : i + 1])])
    assert len(got) >= len(tok.decode(ids[: i + 1])), got


def test_truncate_prompt_tokens(client, offline):
    """vLLM's truncate_prompt_tokens: the last n prompt tokens (usage counts them; the output is that prompt's),
    a prompt string of any length tokenised whole first; -1 = the context length; 0 is refused."""
    ids = offline.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 4})
    want = offline.generate([ids[-4:]], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert out.usage.prompt_tokens == 4 and out.choices[0].text == want
    long = "a " * 1_000_000 + PROMPTS[1]  # far past the characters a context can hold: refused untruncated
    assert post("/v1/completions", {"model": MODEL, "prompt": long, "max_tokens": 2}).status_code == 400
    cut = client.completions.create(model=MODEL, prompt=long, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 4})
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text == want
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    r = post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    r = post("/v1/completions", {"model": MODEL, "prompt": "x", "max_completion_tokens": 2})  # (lmdeploy's client)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def post(path: str, body) -> requests.Response:
    data = body if isinstance(body, str) else json.dumps(body)
    return requests.post(f"{BASE}{path}", data=data, headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 3000, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"9999999": 1}}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [9999999], "min_tokens": 2}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": None, "prompt_embeds": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "prompt_embeds": "AAAA"}, 400, "prompt_embeds"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"nam": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "frequency_penalty": "high"}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**7]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
])
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, path, body, status, param):
    r = post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] is not None
    if param:
        assert err["param"] == param
    ok = post("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


FUZZ_VALUES = {
    "max_tokens": [1, 3, 0, -2, None, "4", 2.5, 10**9], "temperature": [0, 0.7, 1e-30, 5.0, -1, "hot", None, 1e308],
    "top_p": [0.1, 1, 0, 1.5, None], "top_k": [0, -1, 3, 10**6, -7, 1.5], "min_p": [0, 0.5, 1, 2],
    "seed": [0, -5, 2**63, 2**70, "s"], "n": [1, 2, 0], "stop": ["x", ["a", ""], [1], "", None],
    "logprobs": [0, 5, 20, 21, True, -1], "presence_penalty": [0, 2, -2, 2.1], "frequency_penalty": [1.5, "x"],
    "repetition_penalty": [1.2, 1e-300, 0, 1e300], "logit_bias": [{"5": 100}, {"5": -100, "6": 7}, {"x": 1}, [1]],
    "stop_token_ids": [[0], [10**9], [-1], "1"], "min_tokens": [0, 2, 100, -1], "ignore_eos": [True, "yes"],
    "stream": [True, False, "no"], "stream_options": [{"include_usage": True}, 5], "echo": [False, True],
    "prompt": ["def f(", ["a", "b"], [1, 2, 3], [[4, 5], "c"], [], [10**9], "", 7, [True]],
}
CHAT_FUZZ_VALUES = {
    "messages": [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "s"}, {"role": "user",
                 "content": [{"type": "text", "text": "a"}]}], [{"role": "user", "content": None}], [],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "hi", [{"x": 1}]],
    "max_completion_tokens": [2, 0, "2"], "logprobs": [True, False, 3], "top_logprobs": [0, 5, 21, -1],
    "tools": [[{"type": "function", "function": {"name": "f"}}], "t"], "tool_choice": ["none", "auto"],
    "response_format": [{"type": "text"}, {"type": "json_object"}], "n": [1, 3, -1], "seed": [1, 2**64],
    "stream": [True, False], "temperature": [0, 0.9, None], "stop": ["\n", ["a", "b"]],
}


def test_random_requests_get_200_or_400_and_never_take_the_group_down(server):
    """Seeded random mixes of valid and invalid values of every completion and chat field: each answer is a 200 (the
    stream well formed) or a 400 naming the problem, and the group never restarts (a request whose parameters
    failed a step would take it down: a stop token id past the vocabulary with min_tokens once did)."""
    import random

    rng = random.Random(7)
    before = requests.get(f"{BASE}/admin/health").json()
    codes = {200: 0, 400: 0}
    for i in range(120):
        chat = i >= 80
        values = CHAT_FUZZ_VALUES if chat else FUZZ_VALUES
        body = {"model": MODEL, "max_tokens": 3, **({"messages": [{"role": "user", "content": "x"}]} if chat
                                                     else {"prompt": "x"})}
        for key in rng.sample(sorted(values), rng.randint(1, 4)):
            body[key] = rng.choice(values[key])
        body = {k: v for k, v in body.items() if v is not None}
        r = fuzz_answer("/v1/chat/completions" if chat else "/v1/completions", body, codes)
        if r.status_code == 200 and body.get("stream") is not True:
            assert r.json()["usage"]["completion_tokens"] >= 1, body
    after = requests.get(f"{BASE}/admin/health").json()
    assert after["healthy"] and after["restarts"] == before["restarts"], after
    assert codes[200] >= 10 and codes[400] >= 10, codes  # both kinds were exercised


def test_64_concurrent_streams_complete(server):
    """... and are admitted in fewer calls to the group than requests (one Serve call carries the requests that
    arrived while the previous one was in flight: serve/cluster/groups.py, Admissions)."""
    from openai import AsyncOpenAI

    calls = settled("ingress_admission_calls_total")

    async def main():
        client = AsyncOpenAI(base_url=f"{BASE}/v1", api_key="x", max_retries=0, timeout=300)

        async def one(i: int) -> tuple[int, int]:
            want = 5 + (i * 7) % 40
            stream = await client.completions.create(model=MODEL, prompt=f"def f{i}(" + "x" * (i % 9), stream=True,
                                                     max_tokens=want, temperature=0.5, seed=i,
                                                     extra_body={"ignore_eos": True},
                                                     stream_options={"include_usage": True})
            got = None
            async for c in stream:
                if c.usage is not None:
                    got = c.usage.completion_tokens
            return want, got

        return await asyncio.gather(*[one(i) for i in range(64)])

    res = asyncio.run(main())
    assert len(res) == 64 and all(w == g for w, g in res)
    calls = settled("ingress_admission_calls_total") - calls
    assert 1 <= calls < 64, calls


def test_models_health_metrics_tokenize(server):
    models = requests.get(f"{BASE}/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    assert requests.get(f"{BASE}/version").json()["version"]
    # a body sent as a form or text (what a web page can POST cross-site without a preflight) is not read as JSON
    for kind in ("application/x-www-form-urlencoded", "text/plain;charset=UTF-8", "multipart/form-data"):
        r = requests.post(f"{BASE}/v1/completions", data=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}),
                          headers={"Content-Type": kind}, timeout=60)
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], (kind, r.text)
    assert requests.post(f"{BASE}/v1/completions", data=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}),
                         headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60).status_code == 200
    h = requests.get(f"{BASE}/health")
    assert h.status_code == 200 and h.json()["healthy"]
    text = "def f(x):\n    return x"
    toks = post("/tokenize", {"model": MODEL, "prompt": text}).json()
    assert post("/detokenize", {"model": MODEL, "tokens": toks["tokens"]}).json()["prompt"] == text
    assert toks["count"] == len(toks["tokens"]) and toks["max_model_len"] > 0 and toks["token_strs"] is None  # vLLM
    strs = post("/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == toks["count"]
    for bad_ids in ([True], [-1], [10**9], "12"):  # a boolean is not a token id
        r = requests.post(f"{BASE}/detokenize", json={"model": MODEL, "tokens": bad_ids}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", (bad_ids, r.text)
    m = requests.get(f"{BASE}/metrics").text
    for name in ("num_requests_running", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_per_pos_total", "dpmeta_steps_total", "dummy_forwards_total",
                 "waves_total", "group_restarts_total"):
        assert f"mtp_ray:{name}" in m, name
    assert 'rank="1"' in m
    # Prometheus' own parser: every family typed (they were all untyped, each histogram three families), buckets in
    # `le` order (they were in text order: +Inf first, 10.0 before 2.5)
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(m)}
    assert fams["mtp_ray:time_to_first_token_seconds"].type == "histogram"
    assert fams["mtp_ray:generation_tokens"].type == "counter" and fams["mtp_ray:num_requests_running"].type == "gauge"
    assert not [f.name for f in fams.values() if f.type == "unknown"]
    les = [s.labels["le"] for s in fams["mtp_ray:e2e_request_latency_seconds"].samples if s.name.endswith("_bucket")]
    assert les[-1] == "+Inf" and [float(x) for x in les] == sorted(float(x) for x in les)


def metric(name: str) -> float:
    """The value of an ingress series in /metrics (summed over the ingress replicas, the model's label only)."""
    m = re.search(rf"^mtp_ray:{name}{{model_name=\"[^\"]*\"}} (\S+)$", requests.get(f"{BASE}/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


def settled(name: str) -> float:
    """metric(name) once two reads a hub report apart agree (the ingress reports once a second)."""
    last = metric(name)
    for _ in range(10):
        time.sleep(1.2)
        now = metric(name)
        if now == last:
            return now
        last = now
    return last


def aborted() -> int:
    return sum(r["spec"].get("aborted", 0) for r in requests.get(f"{BASE}/admin/health").json()["ranks"])


def test_client_disconnect_aborts_the_request(server):
    """A client that goes away mid-stream gets its request aborted on its rank (its KV freed), well before the
    request could end by itself: 1900 tokens take ~30 s on a 2-core machine, the abort ~0.1 s. Ten times: Serve
    cancels the gone client's stream with its child calls, and the abort sent from the stream's clean-up was
    one of them ~1 time in 12 until it was sent from a task of its own."""
    n, before, sent, tokens = 10, aborted(), metric("ingress_abort_calls_total"), metric("generation_tokens_total")
    for _ in range(n):
        with requests.post(f"{BASE}/v1/completions", stream=True, timeout=60, json={
                "model": MODEL, "prompt": "def long(", "max_tokens": 1900, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
    gone, deadline = time.time(), time.time() + 20
    while aborted() < before + n and time.time() < deadline:  # the rank's counters reach the group with its polls
        time.sleep(0.2)
    h = requests.get(f"{BASE}/admin/health").json()
    assert aborted() == before + n, f"{aborted() - before} of {n} aborted {time.time() - gone:.1f} s later: {h}"
    # the abort's trail: sent by the ingress to the rank (an admission call carries other requests: it stays
    # open), none of the calls failed, received by a rank
    while metric("ingress_abort_calls_total") < sent + n and time.time() < deadline:  # (the hub: once a second)
        time.sleep(0.2)
    assert metric("ingress_abort_calls_total") == sent + n and metric("ingress_abort_errors_total") == 0
    assert sum(r["aborts"].get("received", 0) for r in h["ranks"]) >= n, h
    # the tokens each of them streamed count (they counted at a request's end only, not when it was aborted)
    assert metric("generation_tokens_total") >= tokens + n, (tokens, metric("generation_tokens_total"))
    while time.time() < deadline + 10:
        h = requests.get(f"{BASE}/admin/health").json()
        if h["in_flight"] == 0 and all(r["num_running"] == 0 for r in h["ranks"]):
            break
        time.sleep(0.5)
    assert h["in_flight"] == 0 and all(r["num_running"] == 0 for r in h["ranks"]), h
    # the ingress replica pulled those streams from the ranks (runtime/outboxes.py), and holds none there now
    assert any(r["subscribers"] for r in h["ranks"]) and all(
        sum(r["subscribers"].values()) == 0 for r in h["ranks"]), h


def test_rl_methods_through_the_serve_handle(server, offline):
    from ray import serve

    h = serve.get_deployment_handle("EngineGroup", app_name=server["name"])
    ids = offline.tokenizer.encode(PROMPTS[0])
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    params = {"temperature": 0, "max_tokens": 12}
    assert h.generate.remote(ids, params).result()["token_ids"] == want
    mem = h.sleep.remote(1).result()
    assert all(m["cache_bytes"] == 0 for m in mem)
    h.wake_up.remote().result()
    assert h.generate.remote(ids, params).result()["token_ids"] == want
    assert h.reset_prefix_cache.remote().result() is True


@pytest.mark.slow
def test_dead_rank_makes_health_503_and_serve_replaces_the_group(server, ray_cluster):
    ray = ray_cluster
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("mtp_ray_rank_")]
    victim = next(a for a in names if a["name"].endswith("_r1"))
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]))
    codes, deadline = [], time.time() + 180
    while time.time() < deadline:
        try:
            codes.append(requests.get(f"{BASE}/health", timeout=10).status_code)
        except requests.RequestException:
            codes.append(None)
        if 503 in codes and codes[-1] == 200:
            break
        time.sleep(0.5)
    assert 503 in codes, codes[-10:]
    assert codes[-1] == 200, codes[-10:]
    ok = post("/v1/completions", {"model": MODEL, "prompt": "after the restart", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
