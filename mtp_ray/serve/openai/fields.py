"""Strict request fields: every field of a request is honoured, accepted as harmless to ignore, or a 400 naming it,
on every route by the same rules (the table: field_table.py).

A silently ignored field changes what the client gets without telling it (a typo such as "temprature" would sample
at temperature 1), so unknown fields are refused, with the route's nearest known name as a hint; one set to null
changes nothing and is taken as absent (clients send options they leave unset as null).
"""

from __future__ import annotations

import difflib

from mtp_ray.serve.openai.errors import bad
from mtp_ray.serve.openai.field_table import BY_ROUTE, SAME, TAKE

# how a route names its fields in a 400: SGLang's sampling_params are "sampling_params.<name>"
_NOUN = {"sampling_params": ("sampling parameter", "sampling_params.")}


def check_fields(body: dict, route: str) -> None:
    """400 naming the first field of the body the route does not know (with the route's nearest name as a hint), or
    one it knows and refuses (field_table.py); a null field is as if absent."""
    rules = BY_ROUTE[route]
    noun, prefix = _NOUN.get(route, ("field", ""))
    for key, value in body.items():
        if value is None:  # a null field is as if absent (clients send unset options as null)
            continue
        rule = rules.get(key)
        if rule is None:
            raise bad(f"unknown {noun} '{key}'{_hint(key, route)}", prefix + key)
        if rule.kind in ("neutral", "refuse") and not any(_same(value, v) for v in rule.values):
            as_ = " or ".join(map(repr, (None, *rule.values)))
            raise bad(rule.why or f"'{prefix}{key}' is not supported (accepted only as {as_})", prefix + key)
    if rules.get("spaces_between_special_tokens") == TAKE and not flag(body, "spaces_between_special_tokens", True):
        raise bad("'spaces_between_special_tokens': false is not supported", "spaces_between_special_tokens")
    if rules.get("stream_options") == TAKE and body.get("stream_options") is not None and not flag(body, "stream"):
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")


def _hint(key: str, route: str) -> str:
    """" (did you mean 'x'?)": a field of another route that means the same here, else the nearest name the route
    knows (not another server's field accepted at its off value only: no one means those)."""
    known = [n for n, r in BY_ROUTE[route].items() if r.kind != "neutral" or r.why]
    near = [n for n in SAME.get(key, ()) if n in known][:1] or difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean '{near[0]}'?)" if near else ""


def _same(value, accepted) -> bool:
    """A neutral value: equal and of the same type (false is not 0), a number also as int or float (0.0 is 0)."""
    if value != accepted:
        return False
    num = (int, float)
    return type(value) is type(accepted) or (isinstance(value, num) and isinstance(accepted, num)
                                             and not isinstance(value, bool) and not isinstance(accepted, bool))


_BOOL_WORDS = {"true": True, "t": True, "yes": True, "y": True, "on": True, "1": True,
               "false": False, "f": False, "no": False, "n": False, "off": False, "0": False}


def flag(body: dict, key: str, default: bool = False) -> bool:
    """A boolean field (absent or null: the default). Also what pydantic's lax mode reads as one, as vLLM's and
    SGLang's request models do: 0 / 1 and "true" / "false" ("yes", "on", ...) in any case."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[v.strip().lower()]
    raise bad(f"'{key}' must be a boolean", key)


def unicode_text(s: str, field: str) -> str:
    """A string a tokenizer can take and a response can echo: UTF-8 encodable (JSON can carry lone surrogates, which
    UTF-8 cannot); 400 naming the field."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"'{field}' is not valid Unicode text (a lone surrogate at position {e.start})", field) from None
    return s
