"""Output constraints from a request: OpenAI's response_format, vLLM's structured_outputs and guided_* fields,
SGLang's regex / ebnf / json_schema, and the grammar that enforces a `required` or named tool_choice.

At most one source may constrain a request (two would have to agree; the client means one of them): a second is a
400 naming it. The engine compiles and enforces the result (engine/grammar.py).
"""

from __future__ import annotations

import json
from typing import Any

from mtp_ray.engine.sampling_params import ParamError, StructuredOutputs
from mtp_ray.serve.openai.errors import bad


def _json_schema(v: Any, field: str) -> dict:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise bad(f"'{field}' is not valid JSON: {e}", field) from None
    if not isinstance(v, dict):
        raise bad(f"'{field}' must be a JSON schema (an object)", field)
    return v


def _response_format(fmt: Any) -> StructuredOutputs | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad("'response_format' must be an object with a 'type'", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise bad("'response_format.json_schema' must be an object with a 'schema'", "response_format")
        return StructuredOutputs(json=_json_schema(spec.get("schema", spec.get("json_schema")), "response_format"))
    raise bad(f"'response_format' type {kind!r} is not supported (text, json_object, json_schema)",
              "response_format")


def _sources(body: dict) -> list[tuple[str, Any]]:
    """(field, constraint builder input) for every constraint field present."""
    out = []
    for key in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "regex", "ebnf", "json_schema"):
        if body.get(key) is not None:
            out.append((key, body[key]))
    return out


def _build(key: str, v: Any) -> StructuredOutputs | None:
    if key == "response_format":
        return _response_format(v)
    if key == "structured_outputs":
        if isinstance(v, dict) and isinstance(v.get("json"), str):
            v = {**v, "json": _json_schema(v["json"], key)}
        return StructuredOutputs.coerce(v)
    if key in ("guided_json", "json_schema"):
        return StructuredOutputs(json=_json_schema(v, key))
    if key in ("guided_regex", "regex"):
        return StructuredOutputs(regex=v)
    if key == "guided_choice":
        return StructuredOutputs(choice=v)
    return StructuredOutputs(grammar=v)  # guided_grammar, ebnf


def constraint(body: dict, tool_schema: dict | None = None) -> StructuredOutputs | None:
    """The request's one output constraint (None: free text). tool_schema: the JSON schema a forced tool call
    must follow (tool_choice required / named)."""
    found = []
    for key, v in _sources(body):
        try:
            spec = _build(key, v)
        except ParamError as e:
            raise bad(f"'{key}': {e}", key) from None
        if spec is not None:
            found.append((key, spec))
    if tool_schema is not None:  # a forced call overrides response_format (vLLM), not a second explicit grammar
        found = [f for f in found if f[0] != "response_format"] + [("tool_choice", StructuredOutputs(json=tool_schema))]
    if len(found) > 1:
        raise bad(f"'{found[1][0]}' and '{found[0][0]}' both constrain the output: send one", found[1][0])
    return found[0][1] if found else None


def tool_call_schema(tools: list[dict], choice: Any, parallel: bool) -> tuple[dict | None, str | None]:
    """tool_choice -> (the schema a forced call follows, the named function): "required" is a JSON array of
    {"name", "parameters"} objects (one item when parallel_tool_calls is false); a named function is that
    function's parameters. "auto" / "none": (None, None)."""
    if choice in (None, "auto", "none"):
        return None, None
    by_name = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if choice == "required":
        defs: dict = {}  # each tool's $defs / definitions, hoisted: "#/$defs/X" refers to the combined schema's root
        items = []
        for n, p in by_name.items():
            p = dict(p)
            for key in ("$defs", "definitions"):
                for name, sub in (p.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                        raise bad(f"tools define {key} {name!r} differently: give them distinct names", "tools")
            items.append({"type": "object", "properties": {"name": {"enum": [n]}, "parameters": p},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **defs}
        if not parallel:
            schema["maxItems"] = 1
        return schema, None
    name = choice["function"]["name"]
    if name not in by_name:
        raise bad(f"tool_choice names function {name!r}, which is not in 'tools'", "tool_choice")
    return by_name[name], name
