"""Tool-call parsers, selected by name like vLLM's ``--tool-call-parser``.

Both formats wrap each call in ``<tool_call>...</tool_call>``: ``hermes`` holds a JSON object, ``qwen3_coder``
(Qwen3-Coder / Qwen3.5) holds ``<function=NAME><parameter=P>VALUE</parameter></function>`` XML whose values are
typed by the tool's JSON schema. A block that does not parse stays in the content as text; text after the first
call is dropped (vLLM's parsers keep only the text before it); nothing here raises on model output. Streaming holds
back a possible tag and whole blocks, and yields exactly what ``parse`` gives.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, json.dumps(..., ensure_ascii=False); the caller assigns the id


def _held(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


def _no_constant(s: str) -> Any:
    raise ValueError(f"not JSON: {s}")  # NaN / Infinity would not serialise back as valid JSON


def _loads(s: str) -> Any:
    return json.loads(s, parse_constant=_no_constant)


def _call(name: Any, args: Any) -> ToolCall | None:
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


class ToolParser(ABC):
    """One request's parser. Subclasses turn the text inside a ``<tool_call>`` block into a call (or None)."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []
        self._schemas: dict[str, dict] = {}
        for t in self.tools:
            fn = t.get("function", t) if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                props = params.get("properties") if isinstance(params, dict) else None
                self._schemas[fn["name"]] = props if isinstance(props, dict) else {}
        self._buf = ""
        self._in_block = False
        self._scan = 0  # where to resume looking for </tool_call> in the buffered block
        self._pending = ""  # whitespace-only content held until something visible arrives
        self._live = False
        self._called = False  # a call has been parsed: no more content

    @abstractmethod
    def parse_block(self, body: str) -> ToolCall | None:
        """The call inside one block's text, or None when it is not one (the block then stays content)."""

    def _try(self, body: str, closed: bool = True) -> ToolCall | None:
        if not closed:  # stopped inside the block: drop a cut-off </tool_call>
            body = body[:len(body) - _held(body, CALL_CLOSE)]
        try:
            return self.parse_block(body)
        except Exception:  # model output must never break the response
            return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (i := text.find(CALL_OPEN, pos)) >= 0:
            if not calls:
                content.append(text[pos:i])
            j = text.find(CALL_CLOSE, i + len(CALL_OPEN))
            end = len(text) if j < 0 else j + len(CALL_CLOSE)
            call = self._try(text[i + len(CALL_OPEN):j if j >= 0 else len(text)], j >= 0)
            if call is not None:
                calls.append(call)
            elif not calls:
                content.append(text[i:end])
            pos = end
        if not calls:
            content.append(text[pos:])
        out = "".join(content)
        return (out if out.strip() else None), calls

    def _emit(self, s: str) -> str:
        if self._called:  # text after the first call is dropped
            return ""
        if self._live:
            return s
        self._pending += s
        if not self._pending.strip():
            return ""
        out, self._pending, self._live = self._pending, "", True
        return out

    def _step(self, final: bool) -> tuple[str, list[ToolCall]]:
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            buf = self._buf
            if not self._in_block:
                i = buf.find(CALL_OPEN)
                if i >= 0:
                    out.append(self._emit(buf[:i]))
                    self._buf, self._in_block, self._scan = buf[i + len(CALL_OPEN):], True, 0
                    continue
                keep = 0 if final else _held(buf, CALL_OPEN)
                out.append(self._emit(buf[:len(buf) - keep]))
                self._buf = buf[len(buf) - keep:]
                break
            j = buf.find(CALL_CLOSE, self._scan)
            if j < 0 and not final:
                self._scan = max(0, len(buf) - len(CALL_CLOSE) + 1)
                break
            body = buf if j < 0 else buf[:j]
            call = self._try(body, j >= 0)
            if call is not None:
                calls.append(call)
                self._called = True
            else:
                out.append(self._emit(CALL_OPEN + body + ("" if j < 0 else CALL_CLOSE)))
            self._buf = "" if j < 0 else buf[j + len(CALL_CLOSE):]
            self._in_block = False
        return "".join(out), calls

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        return self._step(final=False)

    def flush(self) -> tuple[str, list[ToolCall]]:
        return self._step(final=True)


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (arguments may be a JSON string of an object)."""

    def parse_block(self, body: str) -> ToolCall | None:
        obj = _loads(body.strip())
        if not isinstance(obj, dict):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = _loads(args) if args.strip() else {}
        return _call(obj.get("name"), args)


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>")
_PARAM_CLOSE = "</parameter>"


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder / Qwen3.5 XML calls; parameter values typed by the tool's JSON schema."""

    def convert(self, fn: str, key: str, raw: str) -> Any:
        schema = self._schemas.get(fn, {}).get(key)
        typ = schema.get("type") if isinstance(schema, dict) else None
        types = set(typ) if isinstance(typ, list) else {typ} if isinstance(typ, str) else set()
        if "null" in types and raw.strip() == "null":
            return None
        if "string" in types:
            return raw
        try:
            return _loads(raw)
        except ValueError:
            return raw

    def parse_block(self, body: str) -> ToolCall | None:
        m = _FUNCTION.fullmatch(body.strip())
        if m is None:
            return None
        name, rest = m.group(1).strip(), m.group(2)
        args: dict[str, Any] = {}
        while rest.strip():
            p = _PARAM.match(rest.lstrip())
            if p is None:
                return None
            rest = rest.lstrip()[p.end():]
            end, nxt = rest.find(_PARAM_CLOSE), rest.find("<parameter=")
            if end >= 0 and (nxt < 0 or end < nxt):
                value, rest = rest[:end], rest[end + len(_PARAM_CLOSE):]
            else:  # a missing </parameter>: the value runs to the next parameter or the end
                cut = nxt if nxt >= 0 else len(rest)
                value, rest = rest[:cut], rest[cut:]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[p.group(1).strip()] = self.convert(name, p.group(1).strip(), value)
        return _call(name, args)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}
