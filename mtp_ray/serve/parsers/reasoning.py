"""Reasoning parsers: split a model's output into ``reasoning_content`` and ``content``.

Qwen3 / Qwen3.5 think inside ``<think>...</think>``; Qwen3.5's template opens the block in the generation prompt
when thinking is on, so the output may start inside it (``opens_reasoning`` tells from the rendered prompt).
Same behaviour as vLLM's ``--reasoning-parser qwen3`` (``deepseek_r1`` is an alias here). Streaming never emits
part of a tag and yields exactly what ``split`` gives for the whole text.

With a tool-call parser on, an opening tool call (``tool_open``, e.g. ``<tool_call>``) inside thinking that was never
closed also ends the reasoning: Qwen3.5 sometimes opens its call before ``</think>``, and a call filed under
reasoning is lost to the agent (vLLM #39056). The tag and what follows are content, where the tool parser reads them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open think block (looks only at the last turn)."""
    tail = prompt_text[prompt_text.rfind("<|im_start|>") + 1:] if "<|im_start|>" in prompt_text else prompt_text
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


def _held(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


def _reasoning_end(text: str, start: int, tool_open: str | None) -> tuple[int, int]:
    """Where the reasoning in text[start:] ends -> (its end, where the content starts); (-1, -1): not yet. The first
    </think> (dropped), or an opening tool call before it (kept: it starts the content)."""
    close = text.find(THINK_CLOSE, start)
    call = text.find(tool_open, start) if tool_open else -1
    if call >= 0 and (close < 0 or call < close):
        return call, call
    return (close, close + len(THINK_CLOSE)) if close >= 0 else (-1, -1)


def reasoning_token_count(ids: list[int], opens: bool, think_ids: tuple[int, int] | None,
                          text_of: Callable[[int], str], tool_open: str | None = None) -> int:
    """How many output tokens are reasoning (usage.completion_tokens_details.reasoning_tokens, as OpenAI and vLLM):
    those before the first </think> when the output starts inside a think block (the prompt opened it, or the
    output starts with <think>), the <think> tag's own tokens not counted. By id where each tag is one token of
    the vocabulary (think_ids); else from the text of token prefixes (text_of(n): the text of ids[:n]), found by
    binary search. tool_open: as the parser's (an opening tool call in unclosed thinking ends the reasoning)."""
    text = text_of(len(ids)) if think_ids is None or tool_open else ""  # (decoded once, only where it is read)
    if think_ids is not None and not (tool_open and tool_open in text):
        start, end = think_ids
        if not ids or not (opens or ids[0] == start):
            return 0
        region = ids[: ids.index(end)] if end in ids else ids
        return sum(t != start for t in region)
    opened = text.startswith(THINK_OPEN)
    if not (opens or opened):
        return 0

    def tokens_within(chars: int) -> int:  # the most leading tokens whose text fits in `chars` characters
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if len(text_of(mid)) <= chars else (lo, mid - 1)
        return lo

    close = _reasoning_end(text, len(THINK_OPEN) if opened else 0, tool_open)[0]
    end = len(ids) if close < 0 else tokens_within(close)
    return max(0, end - (tokens_within(len(THINK_OPEN)) if opened else 0))


class ReasoningParser(ABC):
    """One request's parser: ``split`` for whole text, ``feed``/``flush`` for streaming (reasoning, content)."""

    def __init__(self, in_reasoning: bool = False, tool_open: str | None = None) -> None:
        self.in_reasoning = in_reasoning
        self.tool_open = tool_open  # an opening tool call that also ends the reasoning (a tool parser's), or None

    @abstractmethod
    def split(self, text: str) -> tuple[str | None, str | None]: ...

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, str]: ...

    @abstractmethod
    def flush(self) -> tuple[str, str]: ...

    @property
    @abstractmethod
    def in_content(self) -> bool:
        """Streaming: the reasoning has ended (what follows is the answer)."""


class Qwen3ReasoningParser(ReasoningParser):
    """``<think>`` reasoning ``</think>`` content: reasoning loses the newlines around it, content its leading ones."""

    def __init__(self, in_reasoning: bool = False, tool_open: str | None = None) -> None:
        super().__init__(in_reasoning, tool_open)
        self._state = "start"  # start -> reasoning -> content, or start -> content
        self._buf = ""
        self._nl = ""  # trailing newlines of reasoning, emitted only if more reasoning follows
        self._r_started = False
        self._strip_content = False  # content after </think>: leading newlines dropped
        self._c_started = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        in_r = self.in_reasoning
        if text.startswith(THINK_OPEN):
            text, in_r = text[len(THINK_OPEN):], True
        if not in_r:
            return None, text  # (vLLM: no tags, the output as it is; "" stays "")
        end, content_at = _reasoning_end(text, 0, self.tool_open)
        if end < 0:
            return text.strip("\n") or None, None
        return text[:end].strip("\n") or None, text[content_at:].lstrip("\n") or None

    def _reason(self, s: str) -> str:
        if not self._r_started:
            s = s.lstrip("\n")
        s = self._nl + s
        out = s.rstrip("\n")
        self._nl = s[len(out):]
        self._r_started = self._r_started or bool(out)
        return out

    def _content(self, s: str) -> str:
        if self._strip_content and not self._c_started:
            s = s.lstrip("\n")
        self._c_started = self._c_started or bool(s)
        return s

    def _step(self, final: bool) -> tuple[str, str]:
        r, c = [], []
        while True:
            buf = self._buf
            if self._state == "start":
                if not final and THINK_OPEN.startswith(buf):
                    break  # could still become <think>
                if buf.startswith(THINK_OPEN):
                    self._buf, self._state = buf[len(THINK_OPEN):], "reasoning"
                else:
                    self._state = "reasoning" if self.in_reasoning else "content"
            elif self._state == "reasoning":
                i, content_at = _reasoning_end(buf, 0, self.tool_open)
                if i >= 0:
                    r.append(self._reason(buf[:i]))
                    self._nl, self._buf, self._state = "", buf[content_at:], "content"
                    self._strip_content = True
                    continue
                keep = 0 if final else max(_held(buf, THINK_CLOSE), _held(buf, self.tool_open) if self.tool_open else 0)
                r.append(self._reason(buf[:len(buf) - keep]))
                self._buf = buf[len(buf) - keep:]
                break
            else:
                c.append(self._content(buf))
                self._buf = ""
                break
        return "".join(r), "".join(c)

    @property
    def in_content(self) -> bool:
        return self._state == "content"

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._step(final=False)

    def flush(self) -> tuple[str, str]:
        return self._step(final=True)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": Qwen3ReasoningParser,
}
