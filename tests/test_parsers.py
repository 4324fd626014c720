"""Reasoning and tool-call parsers (pure Python, no Ray): whole text, streaming in any chunking, bundled template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtp_ray.serve.parsers.reasoning import (
    REASONING_PARSERS,
    Qwen3ReasoningParser,
    opens_reasoning,
    reasoning_token_count,
)
from mtp_ray.serve.parsers.tool_calls import TOOL_PARSERS, ToolCall

MODEL_DIR = Path(__file__).resolve().parents[1] / "mtp_ray" / "assets" / "tiny-qwen35-mtp"

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
            "ratio": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
            "note": {"type": ["string", "null"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]


def chunkings(text: str):
    """Chunks of 1, 2, 3 and 7 characters, and every split into two pieces."""
    for k in (1, 2, 3, 7):
        yield [text[i:i + k] for i in range(0, len(text), k)]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


# ---------------------------------------------------------------- reasoning

REASONING_CASES = [
    (True, "\nLet me think.\n\nStill thinking\n</think>\n\nThe answer is 4.", "Let me think.\n\nStill thinking",
     "The answer is 4."),
    (True, "thinking forever\n\n", "thinking forever", None),
    (True, "<think>\nx\n</think>\n\ny", "x", "y"),
    (False, "<think>\nhidden\n</think>\n\nvisible\n", "hidden", "visible\n"),
    (False, "just content </think> here", None, "just content </think> here"),
    (False, "<thin", None, "<thin"),
    (True, "\n\n</think>\n\n", None, None),
    (True, "a </thi", "a </thi", None),
    (False, "", None, ""),  # (vLLM: an empty answer without think tags is content "", not null)
    (True, "r</think>c </think> d", "r", "c </think> d"),
]


@pytest.mark.parametrize("in_r,text,reasoning,content", REASONING_CASES)
def test_reasoning_split(in_r, text, reasoning, content):
    assert Qwen3ReasoningParser(in_r).split(text) == (reasoning, content)


@pytest.mark.parametrize("in_r,text,reasoning,content", REASONING_CASES)
def test_reasoning_streaming_equals_split(in_r, text, reasoning, content):
    for chunks in chunkings(text):
        p = REASONING_PARSERS["qwen3"](in_r)
        rs, cs = [], []
        for ch in chunks:
            r, c = p.feed(ch)
            rs.append(r)
            cs.append(c)
            assert "<think" not in c or "<think" in (content or "")  # no partial tag leaks
        r, c = p.flush()
        assert ("".join(rs) + r, "".join(cs) + c) == (reasoning or "", content or ""), chunks


@pytest.mark.parametrize("opens,tokens,want", [
    (True, ["a", "b", "</think>", "c"], 2), (True, ["a", "b"], 2), (False, ["a", "</think>", "b"], 0),
    (False, ["<think>", "a", "b", "</think>", "c"], 2), (True, ["<think>", "a", "</think>"], 1), (False, [], 0),
])
def test_reasoning_token_count_by_id_and_by_text(opens, tokens, want):
    """Tokens before the first </think> once the output is inside a think block, the <think> tag not counted:
    the same by token id (tags of one token) and from the text of token prefixes, where each tag spans tokens."""
    vocab = {"<think>": 0, "</think>": 1, "a": 2, "b": 3, "c": 4}
    by_id = reasoning_token_count([vocab[t] for t in tokens], opens, (0, 1), lambda n: "")
    spread = [piece for t in tokens for piece in ([t[:3], t[3:]] if t.startswith("<") else [t])]  # tags: 2 tokens
    by_text = reasoning_token_count(list(range(len(spread))), opens, None, lambda n: "".join(spread[:n]))
    assert by_id == want and by_text == want


TOOL_OPEN = "<tool_call>"
# (in_reasoning, text, reasoning, content) with a tool parser on: a call opened in unclosed thinking ends it
TOOL_IN_THINK_CASES = [
    (True, "I should look it up.\n<tool_call>\n<function=f>\n</function>\n</tool_call>", "I should look it up.",
     "<tool_call>\n<function=f>\n</function>\n</tool_call>"),
    (False, "<think>\nplan\n<tool_call>{\"name\": \"f\"}</tool_call>", "plan",
     "<tool_call>{\"name\": \"f\"}</tool_call>"),
    (True, "r</think>\n\nc <tool_call>x</tool_call>", "r", "c <tool_call>x</tool_call>"),  # closed first: as before
    (True, "<tool_call>x</tool_call>", None, "<tool_call>x</tool_call>"),
    (True, "a <tool_call>x</tool_call> b </think> c", "a ", "<tool_call>x</tool_call> b </think> c"),
    (True, "still <tool_ca", "still <tool_ca", None),  # a tag never completed stays reasoning
]


@pytest.mark.parametrize("in_r,text,reasoning,content", TOOL_IN_THINK_CASES)
def test_a_tool_call_opened_in_unclosed_thinking_ends_the_reasoning(in_r, text, reasoning, content):
    """Qwen3.5 may open <tool_call> before </think> (vLLM #39056): with a tool parser on (tool_open) the call is
    content, whole and streamed in any chunking; without one, the text stays reasoning as it was."""
    assert Qwen3ReasoningParser(in_r, TOOL_OPEN).split(text) == (reasoning, content)
    for chunks in chunkings(text):
        p = Qwen3ReasoningParser(in_r, TOOL_OPEN)
        rs, cs = [], []
        for ch in chunks:
            r, c = p.feed(ch)
            rs.append(r)
            cs.append(c)
            assert "<tool_ca" not in r  # no part of the tag is ever streamed as reasoning
        r, c = p.flush()
        assert ("".join(rs) + r, "".join(cs) + c) == (reasoning or "", content or ""), chunks
    # no tool parser: the call stays in the reasoning, as before
    assert Qwen3ReasoningParser(True).split("a <tool_call>x</tool_call>") == ("a <tool_call>x</tool_call>", None)


def test_reasoning_tokens_end_at_a_tool_call_opened_in_thinking():
    """usage's reasoning_tokens counts up to the opening tool call when it ends the reasoning, by id and by text."""
    tokens = ["a", "b", "<tool_call>", "x", "</tool_call>"]
    text_of = lambda n: "".join(tokens[:n])  # noqa: E731
    ids = list(range(10, 10 + len(tokens)))
    assert reasoning_token_count(ids, True, (0, 1), text_of, TOOL_OPEN) == 2
    assert reasoning_token_count(ids, True, None, text_of, TOOL_OPEN) == 2
    assert reasoning_token_count(ids, True, None, text_of) == 5  # no tool parser: all of it is reasoning


def test_reasoning_never_emits_partial_close_tag():
    p = Qwen3ReasoningParser(True)
    assert p.feed("abc</thi") == ("abc", "")
    assert p.feed("nk>\n\nok") == ("", "ok")
    assert p.flush() == ("", "")
    assert REASONING_PARSERS["deepseek_r1"] is Qwen3ReasoningParser


# ---------------------------------------------------------------- tool calls

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
          '\n<tool_call>\n{"name": "noop", "parameters": "{\\"x\\": \\"é\\"}"}\n</tool_call>')
XML = ("Sure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
       "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n"
       '["a", "b"]\n</parameter>\n<parameter=opts>\n{"k": 1}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n'
       "</function>\n</tool_call>\n<tool_call>\n<function=noop>\n<parameter=extra>\n12\n</parameter>\n"
       "<parameter=free>\nsome text\n</parameter>\n</function>\n</tool_call>")

TOOL_CASES = [
    ("hermes", HERMES, "Let me check.\n",  # the text before the first call (vLLM: what follows it is dropped)
     [("get_weather", {"city": "Paris", "days": 2}), ("noop", {"x": "é"})]),
    ("hermes", '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n', None, [("noop", {})]),
    ("hermes", "<tool_call>\n{not json}\n</tool_call> after", "<tool_call>\n{not json}\n</tool_call> after", []),
    ("hermes", '<tool_call>\n{"name": "noop", "arguments": {"a": 1}}\n', None, [("noop", {"a": 1})]),  # EOS
    ("hermes", '<tool_call>\n{"name": "noop", "argu', '<tool_call>\n{"name": "noop", "argu', []),  # cut off
    ("hermes", "plain text with < and <tool", "plain text with < and <tool", []),
    ("hermes", '<tool_call>["list"]</tool_call>', '<tool_call>["list"]</tool_call>', []),
    ("qwen3_coder", XML, "Sure.\n\n", [
        ("get_weather", {"city": "New York", "days": 3, "metric": True, "ratio": 0.5, "tags": ["a", "b"],
                         "opts": {"k": 1}, "note": None}),
        ("noop", {"extra": 12, "free": "some text"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nmany\n"
     "</parameter>\n</function>\n", None, [("get_weather", {"city": "42", "days": "many"})]),  # EOS after </function>
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome", "<tool_call>\n<function=get_weather>"
     "\n<parameter=city>\nRome", []),  # cut off before </function>
    ("qwen3_coder", "a<tool_call>\nno function here\n</tool_call>b", "a<tool_call>\nno function here\n</tool_call>b",
     []),
    ("qwen3_coder", "<tool_call>\n<function=noop>\n</function>\n</tool_call>\n\n  ", None, [("noop", {})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nline1\n\nline2\n</parameter>\n"
     "<parameter=days>\n7\n</function>\n</tool", None, [("get_weather", {"city": "line1\n\nline2", "days": 7})]),
]


def _calls(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", TOOL_CASES)
def test_tool_parse(name, text, content, calls):
    got_content, got_calls = TOOL_PARSERS[name](TOOLS).parse(text)
    assert got_content == content and _calls(got_calls) == calls
    assert all(isinstance(c.arguments, str) and isinstance(json.loads(c.arguments), dict) for c in got_calls)


@pytest.mark.parametrize("name,text,content,calls", TOOL_CASES)
def test_tool_streaming_equals_parse(name, text, content, calls):
    want_content, want_calls = TOOL_PARSERS[name](TOOLS).parse(text)
    for chunks in chunkings(text):
        p = TOOL_PARSERS[name](TOOLS)
        cs, got = [], []
        for ch in chunks:
            c, new = p.feed(ch)
            assert "<tool_call" not in c or "<tool_call" in (want_content or "")
            cs.append(c)
            got += new
        c, new = p.flush()
        assert "".join(cs) + c == (want_content or "") and got + new == want_calls, chunks


def test_tool_streaming_emits_calls_when_complete():
    p = TOOL_PARSERS["hermes"](TOOLS)
    assert p.feed("Hi <tool_c") == ("Hi ", [])
    assert p.feed('all>{"name": "noop", "arguments": {}}') == ("", [])
    assert p.feed("</tool_call> bye") == ("", [ToolCall("noop", "{}")])  # text after a call: dropped (vLLM)
    assert p.flush() == ("", [])


def test_non_ascii_arguments_kept():
    _, calls = TOOL_PARSERS["qwen3_coder"](TOOLS).parse(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n</function>\n</tool_call>")
    assert calls == [ToolCall("get_weather", '{"city": "Zürich"}')]


# ---------------------------------------------------------------- bundled chat template

@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def test_template_tool_call_round_trip(tok):
    args = {"city": "New York", "days": 3, "metric": False, "tags": ["x"], "opts": {"a": [1, 2]}, "note": "multi\nline"}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "On it.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
                {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "ok"}]}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and "<tools>\n" in text and "\n</tools>" in text
    assert text.count("<|im_start|>system") == 1 and json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nok\n</tool_response>\n"
            "<|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    start = text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    assistant = text[start:text.index("<|im_end|>", start)]
    content, calls = TOOL_PARSERS["qwen3_coder"](TOOLS).parse(assistant)
    assert content == "On it.\n" and _calls(calls) == [("get_weather", args), ("noop", {})]


def test_template_thinking_and_reasoning_history(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    on = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    default = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert on == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert off == default == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert opens_reasoning(on) and not opens_reasoning(off) and not opens_reasoning(default)
    hist = msgs + [{"role": "assistant", "content": "x", "reasoning_content": "\nold\n"}]
    later = tok.apply_chat_template(hist + [{"role": "user", "content": "c"}], add_generation_prompt=True,
                                    tokenize=False, enable_thinking=True)
    assert "old" not in later and opens_reasoning(later)
    cur = tok.apply_chat_template(hist, tokenize=False)
    assert cur.endswith("<|im_start|>assistant\n<think>\nold\n</think>\n\nx<|im_end|>\n") and not opens_reasoning(cur)


def test_template_continue_final_message(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, wor"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello, wor"


def test_random_streams_equal_whole_text():
    import random

    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", "\n\n", " ", "a", "<", "</", "<thi", "<tool_",
              '{"name": "f", "arguments": {"a": 1}}', "<function=f>", "</function>", "<parameter=a>", "\n2\n",
              "</parameter>"]

    def stream(p, text):
        outs, i = [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            outs.append(p.feed(text[i:i + k]))
            i += k
        return outs + [p.flush()]

    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for in_r in (True, False):
            r, c = Qwen3ReasoningParser(in_r).split(text)
            outs = stream(Qwen3ReasoningParser(in_r), text)
            assert ("".join(o[0] for o in outs), "".join(o[1] for o in outs)) == (r or "", c or ""), text
        for name, cls in TOOL_PARSERS.items():
            content, calls = cls([]).parse(text)
            outs = stream(cls([]), text)
            assert "".join(o[0] for o in outs) == (content or ""), (name, text)
            assert [x for o in outs for x in o[1]] == calls, (name, text)
