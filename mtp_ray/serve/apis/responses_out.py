"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: a request becomes a chat completion body
(serve/apis/responses_in.py), and the chat answer becomes a Response: a reasoning item, a message item,
function_call items, usage in the Responses names; streamed, the chat chunks become the Responses events
(response.created ... response.completed).

Stateless: nothing is stored, so `previous_response_id`, `conversation` and `background` are refused (send the
whole conversation in `input`); every other field is honoured or refused by name, as on the other routes.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from mtp_ray.serve.apis.responses_in import chat_body, text_format
from mtp_ray.serve.openai.chat_output import call_dropped
from mtp_ray.serve.openai.ids import new_id
from mtp_ray.serve.parsers.reasoning import THINK_CLOSE


def front(body: dict, model: str) -> tuple[dict, Shell]:
    """A Responses request -> (its chat body, the Shell that answers it)."""
    return chat_body(body), Shell(body, model)



def _usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens_details": {
                "reasoning_tokens": (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)}}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)]}


class TextLogprobs:
    """Which of a chat choice's log-prob entries (one per generated token, reasoning included) are the message
    text's: all of them when the output starts as text, those after the token that closes the reasoning (its
    </think>) when it starts as reasoning. Fed in order, chunk by chunk or at once; entries that come before
    anything says how the output starts (text held back) wait for it."""

    def __init__(self):
        self.inside: bool | None = None  # in the reasoning (None: not known yet)
        self.seen = ""  # the reasoning's token text so far (to find its </think>)
        self.waiting: list[dict] = []

    def text_entries(self, entries: list[dict], starts: str | None) -> list[dict]:
        """starts: "reasoning" or "text" once the output shows which it starts as, else None."""
        if self.inside is None:
            if starts is None:
                self.waiting += entries
                return []
            self.inside, entries, self.waiting = starts == "reasoning", self.waiting + entries, []
        out = []
        for e in entries:
            if not self.inside:
                out.append(e)
                continue
            self.seen += e.get("token") or ""
            self.inside = THINK_CLOSE not in self.seen
        return out


def _entries(choice: dict) -> list[dict]:
    return ((choice.get("logprobs") or {}).get("content")) or []


def _call_item(call: dict) -> dict:
    """A chat tool call -> a function_call item."""
    return {"id": new_id("fc", 32), "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def _items(reasoning: str | None, content: str | None, calls: list[dict], status: str,
           logprobs: list[dict]) -> list[dict]:
    return (([_reasoning_item(new_id("rs", 32), reasoning)] if reasoning else [])
            + ([_message_item(new_id("msg", 32), content, status, logprobs)] if content else [])
            + [_call_item(c) for c in calls])


class Shell:
    """The fields of a Response that echo the request, and its id and time."""

    def __init__(self, body: dict, model: str):
        self.id, self.created = new_id("resp", 32), int(time.time())
        self.body, self.model = body, model

    def response(self, status: str, output: list[dict], usage: dict | None, finish: str | None = None) -> dict:
        b = self.body
        fmt = text_format(b)  # (chat_body refused a text that is no object)
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "model": self.model, "output": output, "usage": usage,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                "parallel_tool_calls": b.get("parallel_tool_calls", True), "tool_choice": b.get("tool_choice", "auto"),
                "tools": b.get("tools") or [], "text": {"format": fmt or {"type": "text"}},
                "reasoning": b.get("reasoning"), "metadata": b.get("metadata"), "previous_response_id": None,
                "store": False, "truncation": "disabled", "user": b.get("user")}

    def convert(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """A chat stream -> the Responses events."""
        return Events(self).convert(chunks)

    def whole(self, chat: dict) -> dict:
        """A chat completion -> the Response."""
        c = chat["choices"][0]
        msg, finish = c["message"], c["finish_reason"]
        # the message text's log-probs (none unless `include` asked for them)
        lps = TextLogprobs().text_entries(_entries(c), "reasoning" if msg.get("reasoning") else "text")
        output = _items(msg.get("reasoning"), msg.get("content"), msg.get("tool_calls") or [], _status(finish), lps)
        return self.response(_status(finish), output, _usage(chat["usage"]), finish)


class Events:
    """A chat completion stream (its chunks as dicts) -> the Responses stream's events, in order: each output item
    opened, its deltas, closed, before the next; the last event response.completed (or .incomplete) with usage."""

    def __init__(self, shell: Shell):
        self.shell, self.seq = shell, 0
        self.output: list[dict] = []  # closed items
        self.open: dict | None = None  # the item being streamed: {"kind", "id", "text"}
        self.finish: str | None = None
        self.logprobs = TextLogprobs()
        self.pending: list[dict] = []  # the message text's log-prob entries not sent with a delta yet

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def opening(self) -> list[str]:
        r = self.shell.response("in_progress", [], None)
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _start(self, kind: str) -> list[str]:
        out = self._close() if self.open is not None and self.open["kind"] != kind else []
        if self.open is not None:
            return out
        self.open = {"kind": kind, "id": new_id("rs" if kind == "reasoning" else "msg", 32), "text": ""}
        i, item_id = len(self.output), self.open["id"]
        item = ({"id": item_id, "type": "reasoning", "summary": [], "content": []} if kind == "reasoning" else
                {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []})
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
        return out + [  # the part before its deltas: OpenAI's clients add deltas to the part at content_index
            self._event("response.output_item.added", output_index=i, item=item),
            self._event("response.content_part.added", item_id=item_id, output_index=i, content_index=0, part=part)]

    def _delta(self, kind: str, text: str) -> list[str]:
        out = self._start(kind)
        assert self.open is not None
        self.open["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {}
        if kind != "reasoning":
            extra = {"logprobs": self.pending}
            self.open.setdefault("logprobs", []).extend(self.pending)
            self.pending = []
        return out + [self._event(name, item_id=self.open["id"], output_index=len(self.output), content_index=0,
                                  delta=text, **extra)]

    def _close(self) -> list[str]:
        o, self.open = self.open, None
        if o is None:
            return []
        i, text = len(self.output), o["text"]
        if o["kind"] == "reasoning":
            item = _reasoning_item(o["id"], text)
            out = [self._event("response.reasoning_text.done", item_id=o["id"], output_index=i, content_index=0,
                               text=text),
                   self._event("response.content_part.done", item_id=o["id"], output_index=i, content_index=0,
                               part=item["content"][0])]
        elif o["kind"] == "call":  # (closed by the next item, or at the end: a call cut short is incomplete)
            item = {**o["item"], "arguments": text, "status": "incomplete" if self._call_cut() else "completed"}
            out = [self._event("response.function_call_arguments.done", item_id=o["id"], output_index=i,
                               name=item["name"], arguments=text)]
        else:
            lps = o.get("logprobs", []) + self.pending
            self.pending = []
            item = _message_item(o["id"], text, _status(self.finish), lps)
            out = [self._event("response.output_text.done", item_id=o["id"], output_index=i, content_index=0,
                               text=text, logprobs=lps),
                   self._event("response.content_part.done", item_id=o["id"], output_index=i, content_index=0,
                               part=item["content"][0])]
        self.output.append(item)
        return out + [self._event("response.output_item.done", output_index=i, item=item)]

    def _call(self, call: dict) -> list[str]:
        """A chat tool-call delta: a new call (it has an id) opens a function_call item; one without an id carries
        more arguments of the open call (a forced tool_choice's arguments, streamed as generated). Closed by the next
        item or the end."""
        out: list[str] = []
        if "id" in call:
            out = self._close()
            item = {**_call_item(call), "arguments": ""}
            self.open = {"kind": "call", "id": item["id"], "text": "", "item": item}
            out.append(self._event("response.output_item.added", output_index=len(self.output),
                                   item={**item, "status": "in_progress"}))
        args = call["function"].get("arguments") or ""
        if not args:
            return out
        assert self.open is not None and self.open["kind"] == "call", "arguments without a call"
        self.open["text"] += args
        return out + [self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=len(self.output), delta=args)]

    def _call_cut(self) -> bool:
        """The response ended with a forced call cut short (call_dropped): at max_output_tokens, or a `required`
        one by a stop (it ends "tool_calls" when whole)."""
        choice = self.shell.body.get("tool_choice", "auto")
        return call_dropped("named" if isinstance(choice, dict) else choice,
                            self.finish if self.finish in ("length", "stop") else None)

    def chunk(self, chunk: dict) -> list[str]:
        """One chat chunk -> its events (the usage chunk closes the response)."""
        if "error" in chunk:
            self.finish = "error"
            return [self._event("error", code=chunk["error"].get("code"), message=chunk["error"]["message"],
                                param=chunk["error"].get("param"))]
        out: list[str] = []
        for c in chunk.get("choices") or []:
            d = c.get("delta") or {}
            starts = "reasoning" if d.get("reasoning") else "text" if d.get("content") or d.get("tool_calls") else None
            self.pending += self.logprobs.text_entries(_entries(c), starts)
            if d.get("reasoning"):
                out += self._delta("reasoning", d["reasoning"])
            if d.get("content"):
                out += self._delta("message", d["content"])
            for call in d.get("tool_calls") or []:
                out += self._call(call)
            self.finish = c.get("finish_reason") or self.finish
        if chunk.get("usage") is not None and not chunk.get("choices"):
            out += self._close()
            status, output = _status(self.finish), self.output
            if self._call_cut():  # a forced call cut short is no call: the final Response is the whole one's (no
                output = [o for o in output if o["type"] != "function_call"]  # function_call item), though its
                # arguments were streamed as generated
            out.append(self._event(f"response.{status}", response=self.shell.response(
                status, output, _usage(chunk["usage"]), self.finish)))
        return out

    async def convert(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """The chat route's chunks -> the Responses events (no [DONE]: the Responses stream ends with its last
        event)."""
        for e in self.opening():
            yield e
        async for body in chunks:
            for e in self.chunk(body):
                yield e
