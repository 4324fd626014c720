"""Output constraints and prompt log-probs in the engine (no Ray): grammars exact under MTP, masked rejection
sampling keeps the masked target distribution, allowed_token_ids, prompt log-probs equal to the engine's own
scoring, chunked or not."""

from __future__ import annotations

import json

import pytest
import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.engine.grammar import GrammarCompiler, closed
from mtp_ray.engine.rejection import verify
from mtp_ray.engine.sampler import Row, draw
from mtp_ray.engine.sampling_params import ParamError, StructuredOutputs
from mtp_ray.llm import BUNDLED_MODEL
from tests.test_spec_decode import CHI2_5_001, P, Q, chi_square

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "name": {"type": "string", "maxLength": 8},
                                           "kind": {"enum": ["a", "bb", "ccc"]}},
          "required": ["id", "name", "kind"]}
CONSTRAINTS = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=r"[a-z]+_\d{1,3}(, [a-z]+_\d{1,3}){0,3}"),
               StructuredOutputs(choice=["return None", "pass", "raise ValueError"]),
               StructuredOutputs(grammar='start: "x = " NUM ("+" NUM)*\nNUM: /[0-9]{1,2}/'),
               StructuredOutputs(json_object=True)]
PROMPTS = ["def f(x):\n    ", "import os\n", "class A:\n    def g(self):\n        "]


@pytest.fixture(scope="module")
def engines():
    return {k: LLM(num_speculative_tokens=k, device="cpu", block_size=4, prefill_chunk=16, max_model_len=512)
            for k in (0, 3)}


def test_greedy_constrained_output_is_the_same_tokens_for_k0_and_k3(engines):
    params = [SamplingParams(temperature=0, max_tokens=50, structured_outputs=c) for c in CONSTRAINTS]
    got = {}
    for k, llm in engines.items():
        outs = llm.generate([p for p in PROMPTS for _ in params], [sp for _ in PROMPTS for sp in params])
        got[k] = [o.outputs[0].token_ids for o in outs]
        texts = [o.outputs[0].text for o in outs]
        for i, t in enumerate(texts):
            if i % len(params) in (0, 4):
                json.loads(t)
            if i % len(params) == 2:
                assert t in CONSTRAINTS[2].choice
    assert got[0] == got[3]


def test_sampled_constrained_output_always_parses(engines):
    llm = engines[3]
    outs = llm.generate(PROMPTS * 4, SamplingParams(temperature=1.2, max_tokens=80, seed=7,
                                                    structured_outputs={"json": SCHEMA}))
    for o in outs:
        v = json.loads(o.outputs[0].text)
        assert set(v) == {"id", "name", "kind"} and v["kind"] in ("a", "bb", "ccc") and 0 <= v["id"] <= 999
    assert sum(o.outputs[0].spec["num_accepted_tokens"] for o in outs) > 0


def test_masked_verify_keeps_the_masked_target_distribution():
    """A mask that forbids tokens 1 and 3: drafts of them are always rejected and the emitted token follows
    p restricted to the allowed tokens, renormalised."""
    allowed = torch.tensor([True, False, True, False, True, True])
    p = torch.where(allowed, P, 0.0)
    p = p / p.sum()
    logits = P.log().expand(3, -1).clone()
    rows = [Row(SamplingParams(temperature=1.0), [], 0, (), allowed) for _ in range(3)]
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(len(P))
    for _ in range(20000):
        drafts = [draw(Q, gen), draw(Q, gen)]
        out = verify(logits, drafts, torch.stack([Q, Q]), rows, gen)
        assert all(allowed[t] for t in out)
        counts[out[0]] += 1
    keep = allowed.nonzero().flatten()
    assert chi_square(counts[keep], p[keep]) < CHI2_5_001


def test_masks_along_drafts_leave_the_grammar_where_it_was():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    g = GrammarCompiler(BUNDLED_MODEL, 2048, (0,)).grammar(StructuredOutputs(choice=["hello world"]), (0,))
    drafts = tok.encode("hello world", add_special_tokens=False)
    before = g.allowed()
    masks = g.masks_along(drafts + [5])
    assert len(masks) == len(drafts) + 2 and torch.equal(g.allowed(), before)
    assert all(masks[i][d] for i, d in enumerate(drafts)) and masks[-1][0]  # the end is allowed at the end
    g.commit(drafts[0])
    assert torch.equal(g.allowed(), masks[1])


def test_bad_constraints_name_the_field(engines):
    for bad in ({"regex": "[a-"}, {"json": "{nope"}, {"grammar": "start: undefined_rule"}, {"choice": []},
                {"regex": "a", "choice": ["b"]}, {"jsn": {}}):
        with pytest.raises(ParamError) as e:
            engines[0].generate("x", SamplingParams(structured_outputs=bad))
        assert e.value.param == "structured_outputs", bad
    assert engines[0].generate("x", SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still serving


def test_constraints_past_the_budgets_name_the_limit():
    """Sizes are checked where a constraint is made, before anything compiles it or sends it to a rank."""
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    for kw in ({"json": deep}, {"json": json.dumps(deep)}, {"choice": [str(i) for i in range(5000)]},
               {"regex": "a" * 300_000}, {"choice": ["x" * 200_000, "y" * 100_000]},
               {"json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}):
        with pytest.raises(ParamError, match="past the limit") as e:
            StructuredOutputs(**kw)
        assert e.value.param == "structured_outputs"
    StructuredOutputs(json={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}})


def test_a_constraint_that_fails_to_compile_fails_again_without_compiling(monkeypatch):
    from mtp_ray.engine import grammar

    calls = []
    real = grammar._checked

    def counted(key: str) -> str:
        calls.append(key)
        return real(key)

    monkeypatch.setattr(grammar, "_checked", counted)
    spec = StructuredOutputs(regex="[unclosed-")
    for _ in range(3):
        with pytest.raises(ParamError, match="structured_outputs"):
            grammar.check_grammar(spec)
    assert len(calls) == 1
    ok = StructuredOutputs(regex="[ab]+")
    assert grammar.check_grammar(ok) and grammar.check_grammar(ok)


def test_a_compile_past_the_serving_budget_is_a_400_not_a_wait(monkeypatch):
    """The group compiles a new constraint within min(COMPILE_S, 0.8 x queue_s): past it a ParamError (a 400 at the
    front door) naming the budget, remembered for the same constraint."""
    import asyncio
    import time as _time
    from types import SimpleNamespace

    from mtp_ray.engine import grammar
    from mtp_ray.runtime import group

    monkeypatch.setattr(group, "check_grammar", lambda spec: _time.sleep(1.0))
    fake = SimpleNamespace(cfg=SimpleNamespace(timeouts=SimpleNamespace(queue_s=0.25)))
    spec = StructuredOutputs(regex="slow+")
    with pytest.raises(ParamError, match="did not compile within 0.2s"):
        asyncio.run(group.EngineGroup._compile(fake, spec))
    monkeypatch.undo()
    with pytest.raises(ParamError, match="did not compile within"):  # remembered: no second compile
        grammar.check_grammar(spec)
    grammar._FAILED.clear()


def test_closed_schema_forbids_unlisted_properties_only_where_unsaid():
    s = closed({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
                "$defs": {"d": {"properties": {"x": {}}, "additionalProperties": True}}})
    assert s["additionalProperties"] is False and s["properties"]["a"]["additionalProperties"] is False
    assert s["$defs"]["d"]["additionalProperties"] is True
    assert "additionalProperties" not in closed({"type": "object"})


def test_allowed_token_ids_and_stop_reason(engines):
    for k, llm in engines.items():
        o = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=1, max_tokens=12,
                                                    allowed_token_ids=[300, 301, 302]))[0].outputs[0]
        assert set(o.token_ids) <= {300, 301, 302} and len(o.token_ids) == 12, k  # as vLLM: the end token too
        # ids the model ranks below its end token: greedy still takes only them
        o = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=[100, 200]))[0]
        assert set(o.outputs[0].token_ids) <= {100, 200} and o.outputs[0].finish_reason == "length", k
    o = engines[0].generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20,
                                                       structured_outputs={"choice": ["x"]}))[0].outputs[0]
    assert o.text == "x" and o.finish_reason == "stop" and o.stop_reason is None


@pytest.mark.parametrize("chunk", [4, 256])
def test_prompt_logprobs_equal_the_engines_scoring_of_each_next_token(chunk):
    """Position i's prompt log-prob is the raw log-prob the engine gives prompt[i] after prompt[:i] (read off a
    one-token generation restricted to that token: log-probs are the raw model's)."""
    llm = LLM(num_speculative_tokens=2, device="cpu", block_size=4, prefill_chunk=chunk, max_model_len=512)
    ids = llm.tokenizer.encode("def add(a, b):\n    return a + b\n", add_special_tokens=False)
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3))[0]
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        want = llm.generate(ids[:i], SamplingParams(max_tokens=1, allowed_token_ids=[ids[i]], ignore_eos=True)
                            )[0].outputs[0].token_logprobs[0]
        assert plp[i][ids[i]].logprob == pytest.approx(want, abs=1e-5)
        assert 3 <= len(plp[i]) <= 4 and max(v.logprob for v in plp[i].values()) <= 0
    plain = llm.generate(ids, SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_constraint_after_the_reasoning_block_leaves_the_reasoning_free():
    """Thinking on (the server sets `after="</think>"`): free text until the block closes, then only the constraint;
    masks along drafts roll back across the boundary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]},
                             after="</think>")
    g = GrammarCompiler(BUNDLED_MODEL, 2048, (0,)).grammar(spec, (0,))
    assert int(g.allowed().sum()) > 1000  # reasoning: (almost) anything
    ids = tok.encode("I think a = 1.\n</think>\n\n", add_special_tokens=False)
    masks = g.masks_along(ids)
    assert all(masks[i][d] for i, d in enumerate(ids)) and torch.equal(g.allowed(), masks[0])
    for t in ids:
        g.commit(t)
    allowed = g.allowed().nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]).strip() in ("", "{", '{"') for t in allowed)
    for t in tok.encode('{"a": 2}', add_special_tokens=False):
        assert g.allowed()[t]
        g.commit(t)
    assert g.finished


def test_a_slow_grammar_compiles_off_the_step_and_can_be_aborted(engines):
    """A large schema compiles for about a second or more: meanwhile the engine's steps run the other requests
    (its rank's DP peers would otherwise wait in lock-step), and the request can be aborted before it starts."""
    core = engines[0].engine
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{1,5}[0-9]{2,4}"}
                                            for i in range(1500)}}
    core.add_request("big", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4,
                                                      structured_outputs={"json": big}))
    core.add_request("gone", [5, 6, 7], SamplingParams(structured_outputs={"json": {**big, "title": "x"}}))
    core.add_request("plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert core.abort_request("gone").finish_reason == "abort"
    done: dict[str, list] = {}
    while core.has_unfinished():
        for o in core.step():
            done.setdefault(o.request_id, []).append(o)
            if o.finished and o.request_id == "plain":
                assert "big" in core.compiling  # the plain request ran to its end while the schema compiled
    assert done["big"][-1].finished and "gone" not in done
    assert sum(len(o.new_token_ids) for o in done["plain"]) == 6
