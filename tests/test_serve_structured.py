"""Issue 23's acceptance through the official openai client against the served app (deployments/qwen35_mtp.yaml:
dp = 2, the Qwen3 reasoning parser and the qwen3_coder tool parser), with MTP at k = 3: structured output (JSON
schema, regex, choice), forced and parsed tool calls, reasoning, prompt log-probs, strict fields."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import pytest
import requests
import yaml

from mtp_ray import LLM, SamplingParams
from mtp_ray.engine.sampling_params import StructuredOutputs
from tests.conftest import SERVE_PORT

pytestmark = pytest.mark.serve  # (Ray Serve: its own worker and cluster under -n 2, conftest.worker_of)

PORT = SERVE_PORT
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "tiny-qwen35-mtp"
K = 3
YAML = Path(__file__).resolve().parent.parent / "deployments" / "qwen35_mtp.yaml"
USER = [{"role": "user", "content": "Describe a person."}]

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False},
        "label": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]{1,6}$"}]}},
     "required": ["point", "label"], "additionalProperties": False},
]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server(serve_http):
    serve = serve_http

    from mtp_ray.serve.app import build_app

    spec = yaml.safe_load(YAML.read_text())["applications"][0]
    args = spec["args"]
    assert args["engine"]["parallel"]["dp"] == 2
    args["engine"]["spec"]["num_speculative_tokens"] = K
    args["group"], args["ingress"] = {"num_replicas": 1}, {"num_replicas": 1}
    args["engine"]["warmup"] = "none"  # (CPU: a faster start; the warmup has tests of its own)
    serve.run(build_app(args), name="structured", route_prefix="/")
    yield args
    serve.delete("structured")


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)


def post(body: dict, path: str = "/v1/chat/completions") -> requests.Response:
    return requests.post(f"{BASE}{path}", json=body, timeout=120)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_output_validates(client, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, max_tokens=120,
                                         temperature=0)
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    stream = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, max_tokens=120,
                                            temperature=0.8, seed=5, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    # the completions endpoint, through vLLM's guided_json
    comp = client.completions.create(model=MODEL, prompt="data = ", max_tokens=120, temperature=1.0, seed=3,
                                     extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(comp.choices[0].text), schema)


def test_json_object_regex_and_choice_hold(client):
    obj = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pattern = r"[A-Z][a-z]{2,6}-\d{2,4}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}, {"regex": pattern}):
        out = client.completions.create(model=MODEL, prompt="id = ", max_tokens=20, temperature=0.9, seed=1,
                                        extra_body=extra)
        assert re.fullmatch(pattern, out.choices[0].text), (extra, out.choices[0].text)
    options = ["alpha beta", "gamma", "delta_epsilon"]
    for seed in range(4):
        out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=20, temperature=1.0, seed=seed,
                                             extra_body={"guided_choice": options})
        assert out.choices[0].message.content in options and out.choices[0].finish_reason == "stop"


def test_greedy_structured_output_is_token_identical_for_k0_and_k3(client):
    """The served group (k = 3, dp = 2) and offline engines at k = 0 and k = 3 give the same tokens."""
    prompts = ["def f(x):\n", "import json\n"]
    cons = [StructuredOutputs(json=SCHEMAS[0]), StructuredOutputs(regex=r"(\w+ ){2,5}\w+\."),
            StructuredOutputs(json=SCHEMAS[2])]
    served = []
    for p in prompts:
        for c in cons:
            extra = {"structured_outputs": {k: v for k, v in vars(c).items() if v not in (None, False)},
                     "return_token_ids": True}
            r = client.completions.create(model=MODEL, prompt=p, max_tokens=60, temperature=0, extra_body=extra)
            served.append(r.choices[0].model_extra["token_ids"])
    for k in (0, K):
        llm = LLM(num_speculative_tokens=k, device="cpu", max_model_len=2048)
        res = llm.generate([p for p in prompts for _ in cons],
                           [SamplingParams(temperature=0, max_tokens=60, structured_outputs=c)
                            for _ in prompts for c in cons])
        assert [r.outputs[0].token_ids for r in res] == served, k
        if k:
            assert sum(r.outputs[0].spec["num_accepted_tokens"] for r in res) > 0  # MTP did accept drafts


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_validate(client, stream):
    def calls(**kw):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                           tools=TOOLS, max_tokens=150, temperature=0.7, seed=11, stream=stream, **kw)
        if not stream:
            m = r.choices[0].message
            assert not m.content
            return [(c.function.name, c.function.arguments) for c in m.tool_calls], r.choices[0].finish_reason
        got: dict[int, list] = {}
        finish = None
        for ch in r:
            if not ch.choices:
                continue
            finish = ch.choices[0].finish_reason or finish
            for tc in ch.choices[0].delta.tool_calls or []:
                entry = got.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
        return [tuple(v) for _, v in sorted(got.items())], finish

    named, finish = calls(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert len(named) == 1 and named[0][0] == "get_weather" and finish == "stop"
    jsonschema.validate(json.loads(named[0][1]), WEATHER)
    required, finish = calls(tool_choice="required")
    assert required and finish == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, args in required:
        jsonschema.validate(json.loads(args), schemas[name])


@pytest.mark.parametrize("choice,max_tokens", [("named", 150), ("named", 6), ("required", 150), ("required", 14)])
def test_forced_tool_calls_stream_their_arguments_as_generated(client, choice, max_tokens):
    """A forced tool_choice's arguments stream as they are generated (as vLLM): a call's first delta has the id and
    name, the next ones only the index and more arguments; together they are the non-streamed call's arguments.
    Cut by max_tokens (finish_reason "length"), the whole answer has neither calls nor content (as vLLM's tests
    ask, as OpenAI answers) while the stream has sent what was generated. The Responses API streams them as
    function_call_arguments deltas of one function_call item per call."""
    tc = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS, tool_choice=tc,
              max_tokens=max_tokens, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    deltas = [(ch.choices[0].delta.tool_calls, ch.choices[0].finish_reason)
              for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    got: dict[int, list] = {}
    for d in (d for tcs, _ in deltas for d in tcs or []):
        if d.index not in got:
            assert d.id and d.function.name and d.index == len(got)
            got[d.index] = [d.function.name, ""]
        else:
            assert d.id is None and d.function.name is None
        got[d.index][1] += d.function.arguments or ""
    if max_tokens == 150:
        assert [tuple(v) for v in got.values()] == [(c.function.name, c.function.arguments)
                                                    for c in whole.message.tool_calls]
    else:
        assert got and whole.message.tool_calls == [] and whole.message.content == ""
    pieces = sum(len(tcs or []) for tcs, _ in deltas)
    done = {"named": "stop", "required": "tool_calls"}[choice] if max_tokens == 150 else "length"
    assert deltas[-1][1] == whole.finish_reason == done
    if max_tokens == 150:
        assert pieces > 2 * len(got)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for c in whole.message.tool_calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    rtc = {"type": "function", "name": "get_weather"} if choice == "named" else "required"
    kw = dict(model=MODEL, input="Weather in Oslo?", tools=tools, temperature=0, max_output_tokens=max_tokens,
              tool_choice=rtc)
    one = [o for o in client.responses.create(**kw).output if o.type == "function_call"]
    events = list(client.responses.create(stream=True, **kw))
    args: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
    done = [(e.item_id, e.arguments) for e in events if e.type == "response.function_call_arguments.done"]
    assert [a for _, a in done] == [args.get(i, "") for i, _ in done] and done
    if max_tokens == 150:
        assert [a for _, a in done] == [o.arguments for o in one] and one
        assert [o.type for o in events[-1].response.output] == ["function_call"] * len(one)
    else:  # vLLM's test_max_tokens_with_tool_choice_required: no function_call item in a cut response
        assert not one
        assert events[-1].type == "response.incomplete"  # the stream's final Response is the whole one's
        assert not [o for o in events[-1].response.output if o.type == "function_call"]


def test_a_required_call_cut_by_a_stop_string_is_no_call(client):
    """tool_choice required whose JSON a stop string cuts ("}"): no call and no content, finish "stop" (vLLM's
    validation drops the array that no longer parses); it returned a call with arguments that are no JSON and
    finish "tool_calls". A named call keeps the arguments as cut (vLLM). On /v1/responses the streamed call's
    output_item.done says "incomplete" (it said "completed", also when max_output_tokens cut it)."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
              tool_choice="required", max_tokens=150, temperature=0, stop="}")
    whole = client.chat.completions.create(**kw).choices[0]
    assert (whole.message.tool_calls, whole.message.content, whole.finish_reason) == ([], "", "stop"), whole
    chunks = [ch.choices[0] for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    assert any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "stop"  # (sent as generated)
    named = client.chat.completions.create(**{**kw, "tool_choice": {"type": "function",
                                                                    "function": {"name": "get_weather"}}})
    call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "stop" and call.function.arguments.startswith("{")
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    for extra, limit in (({"stop": "}"}, 150), (None, 14)):
        rk = dict(model=MODEL, input="Weather in Oslo?", tools=tools, temperature=0, tool_choice="required",
                  max_output_tokens=limit, extra_body=extra)
        one = client.responses.create(**rk)
        assert not [o for o in one.output if o.type == "function_call"], one
        events = list(client.responses.create(stream=True, **rk))
        items = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
        assert items and all(i.status == "incomplete" for i in items), items
        assert not [o for o in events[-1].response.output if o.type == "function_call"]


@pytest.mark.parametrize("extra", [{}, {"chat_template_kwargs": {"enable_thinking": True},
                                         "separate_reasoning": False}])
def test_a_required_call_cut_before_its_name_streams_no_content(server, extra):
    """tool_choice required cut by max_tokens before a call's name is read: the stream ends with no content and no
    call, as the whole answer (it used to send the partial JSON, or with reasoning not separated the whole text,
    as content)."""
    for max_tokens in (1, 3, 5):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
                "tool_choice": "required", "max_tokens": max_tokens, "temperature": 0, **extra}
        whole = requests.post(f"{BASE}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        r = requests.post(f"{BASE}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert whole["message"]["content"] == "" and not whole["message"].get("tool_calls"), whole
        assert not any(d.get("content") or d.get("tool_calls") for d in deltas), (max_tokens, deltas)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_with_stop_regex_sends_the_text_the_whole_answer_has(server, path):
    """stop_regex: a stream holds back text that may still become part of a match (it sent "(n" of "(n)", and
    the match then cut it from the whole answer): the joined stream equals the non-streamed text."""
    stops = 0
    for prompt, pattern in (("def fib(n):\n    ", r"\(\w*\)"), ("import os\nimport sys\n\n", r"def \w")):
        body = {"model": MODEL, "max_tokens": 30, "temperature": 0, "stop_regex": pattern}
        body.update({"prompt": prompt} if "chat" not in path else {"messages": [{"role": "user", "content": prompt}]})
        whole = requests.post(f"{BASE}{path}", json=body, timeout=60).json()["choices"][0]
        r = requests.post(f"{BASE}{path}", json={**body, "stream": True}, timeout=60)
        chunks = [json.loads(x[6:])["choices"] for x in r.text.splitlines() if x.startswith("data: {")]
        if "chat" in path:
            want, got = whole["message"]["content"], "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
        else:
            want, got = whole["text"], "".join(c[0]["text"] for c in chunks if c)
        assert got == want, (prompt, whole.get("stop_reason"))
        stops += whole["matched_stop"] == pattern
    assert stops or "chat" in path  # (the completions both stop at their pattern)


@pytest.mark.parametrize("stream", [False, True, "whole reasoning"])
def test_auto_tool_call_and_reasoning_are_parsed(client, stream):
    """A scripted output (a regex constraint on tool_choice auto) in Qwen3.5's XML call format, after a reasoning
    block the output opens itself (with enable_thinking on, the prompt opens it and a constraint applies after
    </think> only): reasoning_content, content and the call come back split. SGLang's stream_reasoning false:
    the reasoning in one delta, once it has ended."""
    script = ("<think>\nOslo is a city\\.\n</think>\n\nLet me check\\.\n<tool_call>\n<function=get_weather>\n"
              "<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
              "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS, max_tokens=200,
              temperature=0, extra_body={"guided_regex": script, "return_token_ids": True})
    if not stream:
        whole = client.chat.completions.create(**kw)
        m = whole.choices[0]
        assert m.finish_reason == "tool_calls"
        # usage counts the reasoning's tokens: those after <think>, up to </think> (the tags are no single token
        # in the bundled vocabulary: counted from the tokens' text)
        ids, n = m.model_extra["token_ids"], whole.usage.completion_tokens_details.reasoning_tokens
        text = [detok(ids[:j]) for j in range(len(ids) + 1)]
        assert text[text.index("<think>") + n] == "<think>\nOslo is a city.\n"
        msg = m.message
        assert msg.model_extra["reasoning_content"] == "Oslo is a city."
        assert msg.content.strip() == "Let me check."
        call = msg.tool_calls[0]
    else:
        reasoning = content = args = name = ""
        pieces = []
        if stream == "whole reasoning":
            kw["extra_body"]["stream_reasoning"] = False
        for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            if not ch.choices:
                assert ch.usage.completion_tokens_details.reasoning_tokens > 3
                continue
            d = ch.choices[0].delta
            pieces += [(d.model_extra or {}).get("reasoning_content")] if (d.model_extra or {}).get(
                "reasoning_content") else []
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
        assert reasoning == "Oslo is a city." and content.strip() == "Let me check."
        assert len(pieces) == 1 if stream == "whole reasoning" else len(pieces) > 1, pieces
        call = type("C", (), {"function": type("F", (), {"name": name, "arguments": args})})
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 3, "unit": "celsius"}


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_auto_call(client, parallel, stream):
    """tool_choice auto with two calls in the output (scripted by a regex): both come back, or with
    parallel_tool_calls false the first alone (vLLM), streamed or not."""
    call = ("<tool_call>\n<function=get_time>\n<parameter=zone>\n{z}\n</parameter>\n</function>\n</tool_call>")
    script = call.format(z="UTC") + "\n" + call.format(z="CET")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Time?"}], tools=TOOLS, max_tokens=120,
              temperature=0, parallel_tool_calls=parallel, extra_body={"guided_regex": script})
    if stream:
        calls: dict[int, str] = {}
        for ch in client.chat.completions.create(stream=True, **kw):
            for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                calls[tc.index] = calls.get(tc.index, "") + (tc.function.arguments or "")
        zones = [json.loads(calls[i])["zone"] for i in sorted(calls)]
    else:
        m = client.chat.completions.create(**kw).choices[0]
        assert m.finish_reason == "tool_calls"
        zones = [json.loads(c.function.arguments)["zone"] for c in m.message.tool_calls]
    assert zones == (["UTC", "CET"] if parallel else ["UTC"])


THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.mark.parametrize("extra,reasoning", [(THINKING, True), ({}, False), ({**THINKING, "separate_reasoning": False},
                                                                              False)])
def test_reasoning_keys_are_always_there(client, extra, reasoning):
    """SGLang's clients read message.reasoning_content and every delta's reasoning_content without a guard: with a
    reasoning parser on, the keys are there, null in a message where nothing is reasoning (thinking off, or
    separate_reasoning false: the reasoning stays in content), "" in such a delta (vLLM's tests concatenate any
    reasoning key a delta has)."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, extra_body=extra)
    msg = client.chat.completions.create(**kw).choices[0].message
    assert bool(msg.reasoning_content) == reasoning and msg.model_extra["reasoning"] == msg.reasoning_content
    assert msg.content if not reasoning else not msg.content
    got = ""
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        got += d.reasoning_content + (d.content or "")  # (an AttributeError if the key is gone, a TypeError if null)
        assert "reasoning" not in d.model_extra or d.model_extra["reasoning"]  # vLLM's tests add up a present one
    assert got == (msg.reasoning_content or "") + (msg.content or "")


def test_responses_reasoning_effort_and_template_kwargs_turn_thinking_on_or_off(client):
    """On /v1/responses a reasoning effort other than "none" asks for reasoning (thinking on), "none" turns it off,
    and chat_template_kwargs (as on the chat route) has the last word: the output's reasoning item says which."""
    def kinds(**kw):
        r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, temperature=0, **kw)
        return [o.type for o in r.output], r.usage.output_tokens_details.reasoning_tokens

    assert kinds() == (["message"], 0)  # the template's default (this one: thinking off)
    for effort in ("low", "high"):
        assert kinds(reasoning={"effort": effort}) == (["reasoning"], 6)  # never closed: all of it is reasoning
    assert kinds(reasoning={"effort": "none"}) == (["message"], 0)
    # streamed: the reasoning part is added before its deltas and done after them (OpenAI's node client adds a
    # delta to the part at its content_index: "missing content at index 0" without it)
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, temperature=0, stream=True,
                                          reasoning={"effort": "low"}))
    parts = [(i, e.type[22:], e.part) for i, e in enumerate(events) if e.type.startswith("response.content_part")]
    assert [(kind, p.type) for _, kind, p in parts] == [("added", "reasoning_text"), ("done", "reasoning_text")]
    deltas = [i for i, e in enumerate(events) if e.type == "response.reasoning_text.delta"]
    assert parts[0][0] < deltas[0] and deltas[-1] < parts[1][0]
    assert parts[1][2].text == "".join(events[i].delta for i in deltas)
    assert kinds(extra_body=THINKING) == (["reasoning"], 6)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert kinds(reasoning={"effort": "high"}, extra_body=off) == (["message"], 0)


def test_responses_logprobs_and_the_options_agent_clients_set(client):
    """/v1/responses gives the message text's log-probs when `include` names them (and top_logprobs alternatives),
    the same entries as the chat route's for the same greedy answer, streamed or not; options the OpenAI Agents SDK
    sends that change nothing here are taken (encrypted reasoning, built-in tool caps, cache retention, nulls)."""
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2)
    want = chat.choices[0].logprobs.content

    def same(got):  # the same tokens and alternatives; log-probs within float noise (another batch, another rank)
        assert [(e.token, [t.token for t in e.top_logprobs]) for e in got] == \
            [(e.token, [t.token for t in e.top_logprobs]) for e in want]
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(got, want, strict=True))

    kw = dict(model=MODEL, input=msgs, max_output_tokens=6, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs", "reasoning.encrypted_content"],
              extra_body={"prompt_cache_retention": "24h", "max_tool_calls": 2, "context_management": None})
    part = client.responses.create(**kw).output[0].content[0]
    assert part.text == chat.choices[0].message.content
    same(part.logprobs)
    events = list(client.responses.create(stream=True, **kw))
    streamed = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    done = next(ev for ev in events if ev.type == "response.output_text.done")
    for got in (streamed, done.logprobs, events[-1].response.output[0].content[0].logprobs):
        same(got)
    plain = client.responses.create(model=MODEL, input=msgs, max_output_tokens=6, temperature=0)
    assert plain.output[0].content[0].logprobs == []  # not asked for
    for extra in ({"include": ["file_search_call.results"]}, {"include": [{}]}, {"top_logprobs": -1},
                  {"reasoning": {"effort": "max"}}, {"input": [{"type": "item_reference", "id": "msg_1"}]}):
        r = post({"model": MODEL, "input": "x", "max_output_tokens": 2, **extra}, "/v1/responses")
        assert r.status_code == 400 and r.json()["error"]["param"] in extra, r.text
    # a null field is as if absent on every route; a set unknown one is still a 400 naming it
    assert post({"model": MODEL, "messages": USER, "max_tokens": 2, "moderation": None}).status_code == 200
    r = post({"model": MODEL, "messages": USER, "max_tokens": 2, "moderation": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "moderation"


def test_the_message_text_log_probs_skip_the_reasoning_and_its_end_tag():
    from mtp_ray.serve.apis.responses_out import TextLogprobs

    entries = [{"token": t, "logprob": -1.0} for t in ("a", "</th", "ink>", "\n\n", "b")]
    assert TextLogprobs().text_entries(entries, "reasoning") == entries[3:]
    assert TextLogprobs().text_entries(entries[:2], "text") == entries[:2]
    split = TextLogprobs()  # chunk by chunk, the first before anything says how the output starts
    got = split.text_entries(entries[:1], None) + split.text_entries(entries[1:3], "reasoning")
    assert got + split.text_entries(entries[3:], None) == entries[3:]


ORDERED = {"type": "object", "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "alpha": {"enum": ["a", "b"]}, "mid": {"type": "boolean"}},
           "required": ["zeta", "alpha", "mid"], "additionalProperties": False}


def test_json_keys_come_in_the_schema_order(client):
    """A schema's property order is the order the JSON is written in (OpenAI, vLLM, SGLang): "reasoning" before
    "answer" is how a schema asks for it. Chat's json_schema, a named tool call and the Responses text.format."""
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDERED, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, max_tokens=60,
                                          temperature=0)
    tool = [{"type": "function", "function": {"name": "f", "parameters": ORDERED}}]
    call = client.chat.completions.create(model=MODEL, messages=USER, tools=tool, max_tokens=80, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "f"}})
    resp = client.responses.create(model=MODEL, input="x", max_output_tokens=60, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "o", "schema": ORDERED}})
    for text in (chat.choices[0].message.content, call.choices[0].message.tool_calls[0].function.arguments,
                 resp.output_text):
        assert list(json.loads(text)) == ["zeta", "alpha", "mid"], text


def detok(ids: list[int]) -> str:
    return requests.post(f"{BASE}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30).json()["prompt"]


def test_enable_thinking_reaches_the_template_and_tool_history_renders(client):
    def prompt(kwargs):
        r = requests.post(f"{BASE}/tokenize", json={"model": MODEL, "messages": USER, "chat_template_kwargs": kwargs,
                                                    "return_token_strs": True}, timeout=30).json()
        return "".join(r["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")

    assert prompt({"enable_thinking": True}).endswith("<think>\n")
    assert prompt({"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    off = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert on.choices[0].message.model_extra["reasoning_content"]  # never closed: all of it is reasoning
    assert on.usage.completion_tokens_details.reasoning_tokens == on.usage.completion_tokens == 8
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = requests.post(f"{BASE}/tokenize", json={"model": MODEL, "messages": history, "tools": TOOLS}, timeout=30)
    text = requests.post(f"{BASE}/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]}).json()["prompt"]
    assert "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>" in text
    assert "<tool_response>\n12:00\n</tool_response>" in text and '"name": "get_weather"' in text
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_prompt_logprobs_and_echo_equal_the_engine(client):
    prompt = "def add(a, b):\n    return a + b\n"
    llm = LLM(num_speculative_tokens=K, device="cpu", max_model_len=2048)
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ref.prompt_token_ids)
    for t, want, got in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:], plp[1:], strict=True):
        assert got[str(t)]["logprob"] == pytest.approx(want[t].logprob, abs=1e-4)
        assert len(got) in (2, 3)  # the prompt token (+ the top 2, which may include it)
    # lm-eval's scoring request: echo + logprobs with max_tokens 0 -> the prompt only, its log-probs
    e = requests.post(f"{BASE}/v1/completions", json={"model": MODEL, "prompt": ref.prompt_token_ids, "echo": True,
                                                      "logprobs": 1, "max_tokens": 0, "temperature": 0}).json()
    lp = e["choices"][0]["logprobs"]
    assert e["choices"][0]["text"] == prompt and e["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert sum(lp["token_logprobs"][1:]) == pytest.approx(sum(ref.prompt_logprobs[i][t].logprob for i, t in enumerate(
        ref.prompt_token_ids) if i), abs=1e-3)
    zero = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    assert len(zero.choices[0].logprobs.top_logprobs[0]) == 1  # logprobs 0: the sampled token itself


def test_usage_counts_only_returned_tokens_and_stop_reason(client):
    full = client.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=30, temperature=0,
                                     extra_body={"return_token_ids": True})
    ids = full.choices[0].model_extra["token_ids"]
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = client.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=30, temperature=0, stop=[stop],
                                    extra_body={"return_token_ids": True})
    c = cut.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    assert cut.usage.completion_tokens == len(c.model_extra["token_ids"]) < len(ids)
    assert c.model_extra["token_ids"] == ids[: cut.usage.completion_tokens]
    # SGLang's matched_stop: the stop string, the stop_regex pattern, the token that stopped it, or null
    assert c.model_extra["matched_stop"] == stop and full.choices[0].model_extra["matched_stop"] is None
    pattern = "[" + re.escape(stop[0]) + "]"
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "def f(x):\n", "max_tokens": 30, "temperature": 0, "stream": stream}
        by_regex = requests.post(f"{BASE}/v1/completions", json={**body, "stop_regex": pattern}, timeout=60)
        by_token = requests.post(f"{BASE}/v1/completions", json={**body, "stop_token_ids": [ids[3]]}, timeout=60)
        by_end = requests.post(f"{BASE}/v1/completions", json={**body, "logit_bias": {"2": 100}}, timeout=60)
        by_eos = requests.post(f"{BASE}/v1/completions", json={**body, "logit_bias": {"0": 100}}, timeout=60)
        # a constraint that is complete ends the output as the end token would (SGLang's output takes it there)
        by_grammar = requests.post(f"{BASE}/v1/completions", json={**body, "regex": "(yes|no)"}, timeout=60)
        got = [last_choice(r, stream)["matched_stop"] for r in (by_regex, by_token, by_end, by_eos, by_grammar)]
        assert got == [pattern, ids[3], 2, 0, 0], (stream, got)  # 2 and 0: the bundled model's end tokens
        assert last_choice(by_grammar, stream)["stop_reason"] is None
        # vLLM's stop_reason: None for the tokenizer's end token (<|endoftext|>, 0), the id for generation_config's
        # other end token (<|im_end|>, 2)
        assert [last_choice(r, stream)["stop_reason"] for r in (by_end, by_eos)] == [2, None], stream


def last_choice(r: requests.Response, stream: bool) -> dict:
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    return [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][-1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_in_a_stream_are_refused_and_models_say_when(server, path):
    """A stream has no place for prompt_logprobs: a 400 naming them (vLLM's), not a stream that drops them
    (prompt_logprobs 0 asks for nothing and is taken); /v1/models' created is a time, as vLLM's."""
    body = {"model": MODEL, "max_tokens": 2, "stream": True, "prompt_logprobs": 1,
            **({"messages": USER} if path.endswith("chat/completions") else {"prompt": "import os"})}
    r = post(body, path)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert post({**body, "prompt_logprobs": 0}, path).status_code == 200
    created = requests.get(f"{BASE}/v1/models", timeout=30).json()["data"][0]["created"]
    assert abs(created - time.time()) < 600, created


EXTRA_FIELDS = {  # every extra the issue lists -> a value; each is honoured (200) or a 400 naming it
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"],
    "guided_grammar": 'start: "ab"', "structured_outputs": {"choice": ["x"]}, "regex": "b+",
    "stop_regex": "\\n", "prompt_logprobs": 1, "allowed_token_ids": [300, 301], "use_beam_search": True,
    "return_token_ids": True, "return_tokens_as_token_ids": True, "continue_final_message": True,
    "add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False},
    "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "echo": True,
    "user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto", "parallel_tool_calls": False,
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", list(EXTRA_FIELDS))
def test_every_extra_field_is_honoured_or_refused_by_name(server, path, field):
    chat = path.endswith("chat/completions")
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    base.update({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}
                if chat and field == "continue_final_message" else
                {"messages": USER} if chat else {"prompt": "def f("})
    body = {**base, field: EXTRA_FIELDS[field]}
    if field == "stream_options":
        body["stream"] = True
    if field == "continue_final_message":
        body["add_generation_prompt"] = False
    r = post(body, path)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == field, r.text
        assert not chat and field in ("continue_final_message", "add_generation_prompt", "chat_template_kwargs"), r.text
        return
    assert r.status_code == 200, r.text
    if field == "stream_options":
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        assert all("usage" in e for e in events)
        return
    c = r.json()["choices"][0]
    text = c["message"]["content"] if chat else c["text"]
    if field in ("guided_regex",):
        assert re.fullmatch("a+", text)
    if field == "regex":
        assert re.fullmatch("b+", text)
    if field == "guided_choice":
        assert text in ("a", "b")
    if field == "guided_grammar":
        assert text == "ab"
    if field == "structured_outputs":
        assert text == "x"
    if field == "guided_json":
        assert text.startswith("{")
    if field == "prompt_logprobs":
        plp = r.json()["prompt_logprobs"] if chat else c["prompt_logprobs"]
        assert plp[0] is None and len(plp) == r.json()["usage"]["prompt_tokens"]
    if field == "return_token_ids":
        assert len(c["token_ids"]) == r.json()["usage"]["completion_tokens"]
    if field == "allowed_token_ids":
        assert set(c.get("token_ids") or []) <= {300, 301}
    if field == "echo" and not chat:
        assert text.startswith("def f(")


def test_allowed_token_ids_and_tokens_as_ids(client):
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0.9, seed=2, logprobs=1,
                                    extra_body={"allowed_token_ids": [300, 301], "return_token_ids": True,
                                                "return_tokens_as_token_ids": True})
    c = out.choices[0]
    # only these ids, the end token as well (vLLM): the output runs to max_tokens
    assert set(c.model_extra["token_ids"]) <= {300, 301} and out.usage.completion_tokens == 6
    assert c.finish_reason == "length"
    assert all(re.fullmatch(r"token_id:\d+", t) for t in c.logprobs.tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_fails_while_generating_is_an_error_not_a_stop(server, stream):
    """A regex that validates but exceeds the matcher's lexer once tokens arrive (llguidance: "too many expressions
    constructed"): the request ends in an error naming structured_outputs, never in a "stop" whose text breaks the
    constraint; the group serves the next request."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0, "guided_regex": "(a{1000}){1000}",
            "stream": stream}
    r = post(body, "/v1/completions")
    if stream:
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        assert not any(c.get("finish_reason") == "stop" for e in events for c in e.get("choices", [])), r.text
        err = next(e["error"] for e in events if "error" in e)
    else:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
    assert "structured_outputs" in err["message"] and "failed while generating" in err["message"], err
    ok = post({"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0, "guided_regex": "a{3}b"},
              "/v1/completions")
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "aaab", ok.text


@pytest.mark.parametrize("body,param", [
    ({"temprature": 0}, "temprature"), ({"guided_json": 42}, "guided_json"), ({"guided_regex": "[a-"}, None),
    ({"response_format": {"type": "json_schema"}}, "response_format"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"chat_template": "{{ x }}"}, "chat_template"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, None), ({"functions": []}, "functions"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"structured_outputs": {"json": "{bad"}}, "structured_outputs"),
])
def test_bad_fields_are_a_400_naming_them(server, body, param):
    r = post({"model": MODEL, "messages": USER, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"]
    if param:
        assert err["param"] == param, err
    if "temprature" in body:
        assert "temperature" in err["message"]


def test_constraints_past_the_budgets_are_a_400_naming_the_limit(server):
    """A schema nested ~900 deep (it broke the request's pickling: a 500), 100k choices and 10k pattern properties
    (20-60 s of compile CPU each, on every retry) are refused at once, naming the limit; the server serves on."""
    deep: dict = {"type": "string"}
    for _ in range(450):
        deep = {"type": "object", "properties": {"a": deep}}
    many = {"type": "object", "patternProperties": {f"^p{i}$": {"type": "string"} for i in range(10_000)}}
    for body in ({"guided_json": deep}, {"guided_choice": [f"c{i}" for i in range(100_000)]},
                 {"structured_outputs": {"json": many}}, {"response_format": {"type": "json_schema", "json_schema": {
                     "name": "x", "schema": deep}}}):
        t0 = time.monotonic()
        r = post({"model": MODEL, "messages": USER, "max_tokens": 2, **body})
        assert r.status_code == 400 and "limit" in r.json()["error"]["message"], r.text[:300]
        assert time.monotonic() - t0 < 5, body.keys()
    assert post({"model": MODEL, "messages": USER, "max_tokens": 2}).status_code == 200


def test_models_by_id_and_unknown_routes(server):
    card = requests.get(f"{BASE}/v1/models/{MODEL}", timeout=10).json()
    assert card["id"] == MODEL and card["root"] == MODEL
    assert requests.get(f"{BASE}/v1/models", timeout=10).json()["data"][0]["root"] == MODEL
    r = requests.get(f"{BASE}/v1/models/other", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = requests.post(f"{BASE}/v1/nope", json={}, timeout=10)
    assert r.status_code == 404 and set(r.json()["error"]) >= {"message", "type", "code"}


def test_vllm_compatibility_details(client):
    """Details vLLM's own OpenAI tests check: $defs in a required tool's parameters, response_format yielding to a
    forced tool call, `reasoning` beside reasoning_content, /invocations, logit_bias errors naming the bad keys, any
    message role passed to the template, usage only with include_usage."""
    defs_tool = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"opts": {"$ref": "#/$defs/Opts"}}, "required": ["opts"],
        "$defs": {"Opts": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}}}]
    for extra in ({}, {"response_format": {"type": "json_object"}}):
        r = post({"model": MODEL, "messages": USER, "tools": defs_tool, "tool_choice": "required", "max_tokens": 60,
                  "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert json.loads(call["arguments"])["opts"]["unit"] in ("c", "f")
    msg = post({"model": MODEL, "messages": USER, "max_tokens": 4, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": True}}).json()["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] and msg["tool_calls"] == []
    inv = requests.post(f"{BASE}/invocations", json={"model": MODEL, "messages": USER, "max_tokens": 2}, timeout=60)
    assert inv.json()["object"] == "chat.completion"
    inv = requests.post(f"{BASE}/invocations", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert inv.json()["object"] == "text_completion"
    r = post({"model": MODEL, "messages": USER, "logit_bias": {"bad1": 1, "5": 2}})
    assert r.status_code == 400 and "bad1" in r.json()["error"]["message"]
    r = post({"model": MODEL, "messages": USER, "logit_bias": {"4096": 1}})
    assert r.status_code == 400 and "4096" in r.json()["error"]["message"]
    r = post({"model": MODEL, "messages": [{"role": "narrator", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = post({"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True,
              "stream_options": {"include_usage": False, "continuous_usage_stats": True}}, "/v1/completions")
    assert "usage" not in r.text
