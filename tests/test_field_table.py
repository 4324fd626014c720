"""The request-field table (serve/openai/field_table.py) and the one check that applies it on every route: the table
is consistent, what an adapter passes on is a field of the route it passes to, every route's 400 for an unknown field
gives the nearest name, the rules are the same everywhere, and docs/api.md lists the fields as the table has them.
No Ray, no engine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mtp_ray.serve.apis import anthropic, responses_in, sglang
from mtp_ray.serve.openai.errors import ApiError
from mtp_ray.serve.openai.field_table import BY_ROUTE, FIELDS, ROUTES, SAMPLING_FIELDS, TAKEN, names, renames
from mtp_ray.serve.openai.fields import check_fields

ENGINE = ("completions", "chat", "tokenize", "detokenize")  # the routes whose parsers take fields themselves
# adapter route -> the route its body is passed to
PASSES_TO = {"responses": "chat", "messages": "chat", "count_tokens": "chat", "generate": "completions",
             "sampling_params": "completions"}
PREFIX = {"sampling_params": "sampling_params."}
DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def refused(body: dict, route: str) -> ApiError:
    with pytest.raises(ApiError) as e:
        check_fields(body, route)
    assert e.value.status == 400
    return e.value


# ---- the table ----
def test_rows_are_consistent():
    assert set(BY_ROUTE) == set(ROUTES)
    for f in FIELDS.values():
        assert set(f.rules) <= set(ROUTES), f.name
        for route, rule in f.rules.items():
            assert rule.kind in ("take", "pass", "map", "ignore", "neutral", "refuse"), (f.name, route)
            assert (rule.kind == "take") <= (route in ENGINE), f"{f.name}: an adapter route passes or maps, {route}"
            assert (rule.kind in ("pass", "map")) <= (route not in ENGINE), f"{f.name}: {route} takes it itself"
            assert rule.kind != "refuse" or rule.why, f"{f.name}: refused on {route} without a reason"
            assert not rule.values or rule.kind in ("neutral", "refuse"), (f.name, route)
        if f.sampling:  # a SamplingParams field: completions and chat take it
            assert f.rules.get("completions") == f.rules.get("chat") and f.rules["chat"].kind == "take", f.name
        assert f.to is None or f.rules.get("sampling_params").kind == "pass", f.name
    for route in ROUTES:
        taken, refused_ = set(names(route, *TAKEN)), set(names(route, "refuse"))
        assert taken and not taken & refused_, route
    # a later sampling row wins: lmdeploy's min_new_tokens over min_tokens, as before
    assert list(SAMPLING_FIELDS).index("min_new_tokens") > list(SAMPLING_FIELDS).index("min_tokens")
    assert SAMPLING_FIELDS["temperature"] == ("temperature", (int, float))


@pytest.mark.parametrize("route", sorted(PASSES_TO))
def test_what_an_adapter_passes_is_a_field_where_it_goes(route):
    """Responses and Messages pass to chat fields chat takes; /generate passes to completions fields it knows (some
    at their neutral values only: its own checks apply there); sampling_params under their completion names."""
    dst = BY_ROUTE[PASSES_TO[route]]
    kinds = ("take",) if PASSES_TO[route] == "chat" or route == "sampling_params" else ("take", "ignore", "neutral")
    for name, target in renames(route).items():
        assert target in dst and dst[target].kind in kinds, f"{route} passes {name} as {target}: {dst.get(target)}"


def test_the_adapters_pass_what_the_table_says():
    """Each adapter's pass-through set is the table's, and each passed field arrives in the body it builds."""
    passed = names("responses", "pass")
    assert set(responses_in._PASSED) == set(passed)
    out = responses_in.chat_body({"input": "x", **dict.fromkeys(passed, 1)})
    assert all(out[k] == 1 for k in passed), out
    passed = names("messages", "pass")
    out = anthropic.chat_body({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                               **dict.fromkeys(passed, 1)})
    assert all(out[k] == 1 for k in passed), out
    assert anthropic.chat_body({"model": "m", "messages": [{"role": "user", "content": "x"}]}, count_only=True) == \
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    passed, sampling = names("generate", "pass"), renames("sampling_params")
    out, _ = sglang.front({"text": "x", "sampling_params": dict.fromkeys(sampling, 1), **dict.fromkeys(passed, 2)},
                          "m", None)
    assert all(out[k] == 2 for k in passed) and all(out[v] == 1 for v in sampling.values()), out
    assert sampling["max_new_tokens"] == "max_tokens" and sampling["sampling_seed"] == "seed"


# ---- one check, the same rules on every route ----
HINTS = [  # (route, the field sent, the name hinted)
    ("completions", "temprature", "temperature"), ("chat", "temprature", "temperature"),
    ("chat", "tool_choise", "tool_choice"), ("tokenize", "promt", "prompt"), ("detokenize", "tokns", "tokens"),
    ("responses", "instructons", "instructions"), ("responses", "max_tokens", "max_output_tokens"),
    ("messages", "systen", "system"), ("messages", "max_completion_tokens", "max_tokens"),
    ("messages", "stop", "stop_sequences"), ("count_tokens", "mesages", "messages"),
    ("generate", "input_id", "input_ids"), ("generate", "sampling_param", "sampling_params"),
    ("sampling_params", "temprature", "temperature"), ("sampling_params", "max_tokens", "max_new_tokens"),
    ("sampling_params", "seed", "sampling_seed"), ("completions", "max_output_tokens", "max_tokens"),
]


@pytest.mark.parametrize("route,sent,hinted", HINTS)
def test_every_route_names_an_unknown_field_with_the_nearest_name(route, sent, hinted):
    e = refused({sent: 1}, route)
    noun = "sampling parameter" if route == "sampling_params" else "field"
    assert e.message == f"unknown {noun} '{sent}' (did you mean '{hinted}'?)", e.message
    assert e.param == PREFIX.get(route, "") + sent


@pytest.mark.parametrize("route", ROUTES)
def test_the_rules_are_the_same_on_every_route(route):
    """null is as if absent (an unknown field too); ignored fields pass at any value; neutral and refused ones at null
    and their listed values only, else a 400 naming them (with the reason); a typo of a name the route knows is a
    400 whose hint is a name the route knows."""
    rules, prefix = BY_ROUTE[route], PREFIX.get(route, "")
    check_fields({"no_such_field": None, **dict.fromkeys(rules)}, route)
    check_fields({k: "anything" for k, r in rules.items() if r.kind == "ignore"}, route)
    for name, rule in rules.items():
        if rule.kind not in ("neutral", "refuse"):
            continue
        for v in rule.values:
            check_fields({name: v}, route)
        e = refused({name: "not-a-neutral-value"}, route)
        assert e.param == prefix + name, e.param
        assert e.message == rule.why if rule.why else "is not supported (accepted only as None" in e.message, e.message
    for name, rule in rules.items():  # (another server's field at its off value only is no one's hint)
        if len(name) > 4 and (rule.kind != "neutral" or rule.why):
            e = refused({name[:-1] + "Q": 1}, route)
            hint = re.search(r"did you mean '(\w+)'", e.message)
            assert hint and hint[1] in rules, (name, e.message)


def test_neutral_values_and_what_changed():
    check_fields({"background": False}, "responses")  # an explicit neutral value, kept
    assert refused({"background": True}, "responses").message == "background responses are not supported"
    assert refused({"previous_response_id": False}, "responses").param == "previous_response_id"  # (was accepted)
    check_fields({"truncation": "disabled", "stream_options": {"include_usage": True}}, "responses")
    assert "must be \"disabled\"" in refused({"truncation": "auto"}, "responses").message
    for ok in (0, 0.0, None):
        check_fields({"priority": ok}, "completions")
    for bad in (1, False, "0"):
        assert "priorities are not supported" in refused({"priority": bad}, "chat").message
    check_fields({"modalities": ["text"], "kwargs": {}, "return_hidden_states": False}, "chat")
    assert refused({"kwargs": {"a": 1}}, "completions").message == "'kwargs' is not supported (accepted only as " \
        "None or {})"
    assert refused({"return_hidden_states": 0}, "completions").param == "return_hidden_states"  # (0 is not false)
    assert refused({"modalities": ["audio"]}, "chat").param == "modalities"
    e = refused({"custom_params": {"a": 1}}, "sampling_params")
    assert e.param == "sampling_params.custom_params" and "not supported" in e.message
    check_fields({"stream_interval": 8, "custom_params": None, "nope": None}, "sampling_params")  # (nope: was a 400)
    check_fields({"text": "x", "nope": None}, "generate")  # (was a 400)
    assert refused({"session_params": {"id": 1}}, "generate").message == "sessions are not supported"
    assert "not supported" in refused({"session_params": {"id": 1}}, "completions").message
    assert refused({"chat_template": "x"}, "chat").message.startswith("a chat template from the request")
    assert refused({"container": "c"}, "count_tokens").message == "containers are not supported"
    assert refused({"temperature": 0}, "count_tokens").param == "temperature"  # (count_tokens does not sample)
    # the value checks that stay in check_fields: where the route takes the field
    assert refused({"spaces_between_special_tokens": False}, "completions").param == "spaces_between_special_tokens"
    assert refused({"stream_options": {}}, "chat").param == "stream_options"
    check_fields({"stream_options": {}, "stream": True}, "chat")


# ---- docs/api.md says what the table does ----
def _doc_tables() -> list[tuple[str, list[str], list[list[str]]]]:
    """(section, header, rows) of every table in docs/api.md."""
    tables, section, cur = [], "", None
    for line in DOCS.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:]
        if not line.startswith("|"):
            cur = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cur is None:
            cur = (section, cells, [])
            tables.append(cur)
        elif not set(cells[0]) <= set("-: "):
            cur[2].append(cells)
    return tables


def _names(cell: str) -> set[str]:
    """The field names a cell names: each `code` span's leading name (`text.format` -> text)."""
    return {m[1] for m in re.finditer(r"`([a-z_][a-z0-9_]*)", cell)}


def documented() -> dict[str, set[str]]:
    """route -> the fields docs/api.md's field tables list for it."""
    docs: dict[str, set[str]] = {r: set() for r in ROUTES}
    for section, header, rows in _doc_tables():
        if not header[0].endswith("field"):
            continue
        for cells in rows:
            if section.startswith("Completions and chat"):
                routes = [r for tag, r in (("cmpl", "completions"), ("chat", "chat")) if tag in cells[1]]
            elif section.startswith("Responses"):
                routes = ["responses"]
            elif section.startswith("Messages"):
                routes = ["messages"]
            else:
                assert "/generate" in section, section
                routes = ["sampling_params" if "sampling_params" in header[0] else "generate"]
            assert routes, cells
            for r in routes:
                docs[r] |= _names(cells[0])
    count = re.search(r"^`count_tokens` takes (.*)$", DOCS.read_text(), re.M)
    docs["count_tokens"] = _names(count[1])
    return docs


@pytest.mark.parametrize("route", ["completions", "chat", "responses", "messages", "count_tokens", "generate",
                                   "sampling_params"])
def test_docs_list_every_field_a_route_takes_and_no_other(route):
    docs = documented()[route]
    missing = set(names(route, *TAKEN)) - docs
    assert not missing, f"docs/api.md lists no row for {sorted(missing)} on {route}"
    unknown = docs - set(BY_ROUTE[route])
    assert not unknown, f"docs/api.md lists {sorted(unknown)} on {route}, which the field table does not know there"
