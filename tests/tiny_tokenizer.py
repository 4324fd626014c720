"""The bundled tiny model's tokenizer, loaded once per test session (for the tests of the front door's translations,
which need real text <-> token ids but no engine), and helpers to read what those translations return."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

TINY = str(Path(__file__).resolve().parents[1] / "mtp_ray" / "assets" / "tiny-qwen35-mtp")


@functools.cache
def tokenizer():
    from mtp_ray.prompts import load_tokenizer

    return load_tokenizer(TINY)


_ID = re.compile(r"^(resp|rs|msg|fc|toolu|call)_([0-9a-f]+)$")


def stable_ids(obj):
    """obj with every generated id (a prefix and 24 or 32 random hex digits) replaced by "<prefix>#<k>", k counting
    the distinct ids of that prefix in order of first appearance: the same id stays the same name, so a test can
    compare whole bodies exactly and still see which item an event names."""
    seen: dict[str, str] = {}

    def walk(x):
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        m = _ID.match(x) if isinstance(x, str) else None
        if m is None:
            return x
        prefix, digits = m.groups()
        assert len(digits) in (24, 32), x
        if x not in seen:
            seen[x] = f"{prefix}#{sum(v.startswith(prefix + '#') for v in seen.values())}"
        return seen[x]

    return walk(obj)


def named_events(events: list[str]) -> list[dict]:
    """Server-sent events of the form "event: <type>\\ndata: <json>\\n\\n" (the Responses and Messages streams) ->
    their data, each checked to name the same type in both lines."""
    out = []
    for e in events:
        assert e.endswith("\n\n"), e
        head, data = e[:-2].split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert head == f"event: {body['type']}", e
        out.append(body)
    return out


def data_events(events: list[str]) -> list:
    """Server-sent events of the form "data: <json>\\n\\n" -> their data ("[DONE]" kept as the string)."""
    out = []
    for e in events:
        assert e.startswith("data: ") and e.endswith("\n\n"), e
        raw = e[6:-2]
        out.append(raw if raw == "[DONE]" else json.loads(raw))
    return out
