"""One chat choice's text read back as an assistant message: reasoning split off (reasoning parser), then tool calls
parsed from the content (tool_choice auto, the tool-call parser) or read from the JSON a forced tool_choice's grammar
produced (required: an array of {name, parameters}; named: the function's arguments). Streamed or whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtp_ray.serve.openai.chat_request import ChatOptions
from mtp_ray.serve.openai.ids import new_id
from mtp_ray.serve.parsers.call_array import CallArray
from mtp_ray.serve.parsers.reasoning import REASONING_PARSERS
from mtp_ray.serve.parsers.tool_calls import CALL_OPEN, TOOL_PARSERS, ToolCall


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_args: str = ""  # more arguments of the last call streamed before (a forced tool_choice's, as generated)
    tool_calls: list[ToolCall] = field(default_factory=list)  # new calls (each with its arguments so far)


def call_id() -> str:
    return new_id("call")


def forced_calls(text: str, opts: ChatOptions) -> list[ToolCall] | None:
    """The calls in a forced tool_choice's whole output, with their arguments as generated (as they stream, so a
    streamed and a whole answer carry the same text, cut by max_tokens or not). Named: the output is the call's
    arguments; required: the calls of its JSON array (serve/parsers/call_array.py). None: no call in it."""
    if opts.tool_choice == "named":
        return [ToolCall(opts.tool_name or "", text)] if text.strip() else None
    array = CallArray()
    array.feed(text)
    return array.take()[1] or None


def call_dropped(tool_choice: str, cut: str | None) -> bool:
    """A forced call cut short is no call, nor content (vLLM, as OpenAI): cut at max_tokens ("length"), or for
    `required` at a stop string / stop_regex ("stop") too (its JSON array no longer parses: vLLM's validation drops
    it; a named call keeps the arguments as cut, as vLLM's). tool_choice: ChatOptions.tool_choice."""
    return (cut == "length" and tool_choice in ("required", "named")) or (cut == "stop" and tool_choice == "required")


class ChatOutput:
    def __init__(self, opts: ChatOptions, reasoning_parser: str | None, tool_call_parser: str | None,
                 think_ids: tuple[int, int] | None = None):
        self.opts = opts
        self.parses_reasoning = reasoning_parser is not None  # the server's: usage counts reasoning tokens
        self.think_ids = think_ids  # <think> / </think> as token ids (ChatServing.think_ids)
        self.tools = (TOOL_PARSERS[tool_call_parser](opts.tools)
                      if opts.tool_choice == "auto" and tool_call_parser else None)
        # with calls parsed from the text, one opened inside unclosed thinking ends the reasoning (parsers/reasoning.py)
        self.tool_open = CALL_OPEN if self.tools is not None else None
        self.reasoning = (REASONING_PARSERS[reasoning_parser](opts.opens_reasoning, self.tool_open)
                          if opts.reasoning and reasoning_parser else None)
        self.forced = opts.tool_choice in ("required", "named")
        self.buffer = ""  # a forced tool_choice's output so far (content at the end if it holds no call)
        self.call_open = False  # a named tool_choice's call has been opened (its arguments stream into it)
        self.array = CallArray() if opts.tool_choice == "required" else None  # a required one's calls
        self.held_reasoning = ""  # stream_reasoning false: the reasoning so far, sent once it has ended
        self.auto_calls = 0  # calls the auto tool parser has streamed (parallel_tool_calls false: the first goes)
        self.ended = False

    def no_call(self, cut: str | None) -> bool:
        """This choice's forced call, cut as Choice.cut says, is none (call_dropped)."""
        return call_dropped(self.opts.tool_choice, cut)

    def whole(self, text: str, cut: str | None = None) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a finished choice; cut: Choice.cut ("length", "stop", None)."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        calls: list[ToolCall] = []
        if self.no_call(cut):
            content = ""
        elif self.forced and content is not None:
            found = forced_calls(content, self.opts)
            if found is not None:
                content, calls = None, found
        elif self.tools is not None and content is not None:
            content, calls = self.tools.parse(content)
            calls = calls if self.opts.parallel_tool_calls else calls[:1]  # vLLM keeps the first
        return (reasoning if self.opts.include_reasoning else None), content, calls

    def feed(self, delta: str, final: bool, cut: str | None = None) -> ChatDelta:
        """The next piece of a streamed choice; final: the choice ended (everything held back is released); cut:
        Choice.cut ("length", "stop", None)."""
        out = ChatDelta()
        if self.ended:  # the choice's end may be seen twice (its last delta, then its end): released once
            return out
        self.ended = final
        if self.reasoning is not None:
            r, c = self.reasoning.feed(delta)
            if final:
                r2, c2 = self.reasoning.flush()
                r, c = r + r2, c + c2
            out.reasoning = r if self.opts.include_reasoning else ""
            if not self.opts.stream_reasoning:  # held until the answer starts (or the choice ends)
                self.held_reasoning, out.reasoning = self.held_reasoning + out.reasoning, ""
                if final or self.reasoning.in_content:
                    out.reasoning, self.held_reasoning = self.held_reasoning, ""
        else:
            c = delta
        if self.opts.tool_choice == "named":  # the arguments as they come: the call opens with the first text
            if self.call_open:                # that is not blank
                out.tool_args = c
            else:
                self.buffer += c
                if self.buffer.strip():
                    out.tool_calls, self.call_open = [ToolCall(self.opts.tool_name or "", self.buffer)], True
            return out
        if self.array is not None:  # required: each call as soon as its name is read, then its arguments
            self.buffer += c
            self.array.feed(c)
            out.tool_args, out.tool_calls = self.array.take()
            if final and not self.array.opened and not self.no_call(cut):  # no call in it: the text itself
                out.content = self.buffer                                     # (cut before a name: nothing)
            return out
        if self.tools is not None:
            c, calls = self.tools.feed(c)
            if final:
                c2, calls2 = self.tools.flush()
                c, calls = c + c2, calls + calls2
            if not self.opts.parallel_tool_calls:  # vLLM keeps the first call
                calls, self.auto_calls = calls[: max(0, 1 - self.auto_calls)], self.auto_calls + len(calls)
            out.tool_calls = calls
        out.content = c
        return out
