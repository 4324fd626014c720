"""The calls of a `required` tool_choice, read from its output while it is generated.

The grammar (serve/openai/structured.py: forced_schema) makes that output a JSON array of {"name": ..., "parameters":
{...}} objects, name first. `CallArray.feed` takes the text piece by piece and keeps, per call, its name (once its
string is complete) and the raw text of its parameters object so far; `take` returns what is new since the last
take: more arguments of the call streamed last, and the calls opened since. Streamed or whole, a call's arguments
are the same text: the parameters as generated (also when max_tokens cut them).
"""

from __future__ import annotations

import json

from mtp_ray.serve.parsers.tool_calls import ToolCall


class CallArray:
    def __init__(self):
        self.depth = 0  # [ = 1, a call object = 2, its parameters = 3 and deeper
        self.in_str = self.esc = False
        self.literal = ""  # the string literal being read at depth 2 (a key, or the name)
        self.key: str | None = None  # the last key read in the current call object
        self.calls: list[list] = []  # [name or None, arguments so far] per call object seen
        self.opened = 0  # calls whose name is known, in order (a call opens once it has its name)
        self.sent = 0  # calls handed out by take
        self.sent_args = 0  # arguments of the last call handed out, already handed out

    def feed(self, text: str) -> None:
        for ch in text:
            d = self.depth
            if d >= 3:  # inside a call's parameters: everything is argument text
                self.calls[-1][1] += ch
            if self.in_str:
                if d == 2:
                    self.literal += ch
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if d == 2:
                        self._string(json.loads(self.literal))
                continue
            if ch == '"':
                self.in_str = True
                self.literal = ch if d == 2 else ""
            elif ch in "{[":
                if d == 1 and ch == "{":
                    self.calls.append([None, ""])
                    self.key = None
                elif d == 2 and self.key == "parameters":
                    self.calls[-1][1] = ch
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1

    def _string(self, s: str) -> None:
        """A string at depth 2: a key, or the name's value (the string after the key "name")."""
        call = self.calls[-1]
        if self.key == "name" and call[0] is None:
            call[0] = s
            self.opened += 1
            self.key = "name:done"
        else:
            self.key = s

    def take(self) -> tuple[str, list[ToolCall]]:
        """(more arguments of the call handed out last, the calls opened since) since the last take."""
        more = ""
        if self.sent:
            args = self.calls[self.sent - 1][1]
            more, self.sent_args = args[self.sent_args :], len(args)
        new = [ToolCall(name, args) for name, args in self.calls[self.sent : self.opened]]
        if new:
            self.sent, self.sent_args = self.opened, len(self.calls[self.opened - 1][1])
        return more, new
