"""Beam search (mtp_ray/beam_search.py): the bookkeeping against a hand-worked example, vLLM's BeamSearchParams
checks, and LLM.beam_search on the bundled model (MTP k = 3) against the engine's own greedy output and log-probs.
The server's use_beam_search is tested in test_serve_structured.py."""

from __future__ import annotations

import math

import pytest

from mtp_ray import LLM, BeamSearchParams, SamplingParams
from mtp_ray.beam_search import BeamSearch, beam_score
from mtp_ray.request_output import Logprob

PROMPTS = ["def parse(self, text):\n    ", "The capital of France is", [11, 22, 33, 44]]


def cands(**lps: float) -> dict[int, Logprob]:
    """{token: Logprob} from t<id>=logprob keywords, likeliest first (as a step's top-n comes)."""
    order = sorted(((int(k[1:]), v) for k, v in lps.items()), key=lambda kv: -kv[1])
    return {t: Logprob(v, i + 1) for i, (t, v) in enumerate(order)}


def test_the_bookkeeping_of_a_hand_worked_search():
    """Width 2, end token 0, length_penalty 0 (scores are cumulative log-probs): step 1 from [9] keeps 1 and 2
    (0 ends a beam: completed); step 2 extends both, keeps the two best live ones; the result is the two best of
    completed + live."""
    p = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0)
    s = BeamSearch([9], p, eos_ids=(0,))
    assert s.pending() == [[9]]
    s.advance([cands(t1=-0.5, t0=-1.0, t2=-1.2, t3=-3.0)])
    assert [b.tokens for b in s.beams] == [[9, 1], [9, 2]] and [b.tokens for b in s.completed] == [[9, 0]]
    assert s.pending() == [[9, 1], [9, 2]]
    s.advance([cands(t4=-1.0, t5=-2.0, t0=-0.1, t6=-4.0), cands(t7=-0.05, t8=-0.2, t0=-5.0, t9=-6.0)])
    assert s.pending() == []  # max_tokens steps ran
    best = s.results()
    # [9, 1, 0]: -0.6, [9, 0]: -1.0 beat the live [9, 2, 7]: -1.25 and [9, 2, 8]: -1.4 ([9, 1, 4]: -1.5 is out)
    assert [(b.tokens, b.finish_reason) for b in best] == [([9, 1, 0], "stop"), ([9, 0], "stop")]
    assert math.isclose(best[0].cum_logprob, -0.6) and best[0].logprobs[1][0].logprob == -0.1
    assert [b.tokens for b in s.beams] == [[9, 2, 7], [9, 2, 8]]
    # length_penalty 1 (vLLM's default): a score is the mean log-prob over the length, prompt counted, an end
    # token not
    assert math.isclose(beam_score(best[0], (0,), 1.0), -0.6 / 2)
    # ignore_eos: an end token is a token like any other, so no beam completes
    s = BeamSearch([9], BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True, length_penalty=0.0), (0,))
    s.advance([cands(t1=-0.5, t0=-0.4, t2=-1.2)])
    assert [(b.tokens, b.finish_reason) for b in s.results()] == [([9, 0], "length"), ([9, 1], "length")]


@pytest.mark.parametrize("kw,field", [({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"),
                                      ({"beam_width": True}, "beam_width"), ({"max_tokens": 0}, "max_tokens"),
                                      ({"length_penalty": float("nan")}, "length_penalty"),
                                      ({"temperature": -1}, "temperature"), ({"ignore_eos": "no"}, "ignore_eos")])
def test_bad_beam_search_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field) as e:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})
    assert e.value.param == field


@pytest.fixture(scope="module")
def llm():
    return LLM(num_speculative_tokens=3, block_size=4, prefill_chunk=16, max_model_len=128)


def test_width_one_without_end_tokens_is_greedy(llm):
    """One beam that never completes keeps the likeliest token each step: the greedy output, exactly."""
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for o, g in zip(outs, greedy, strict=True):
        (seq,) = o.sequences
        assert seq.tokens == g.prompt_token_ids + g.outputs[0].token_ids
        assert math.isclose(seq.cum_logprob, g.outputs[0].cumulative_logprob, abs_tol=1e-4)


def test_each_beam_is_scored_by_the_models_own_log_probs(llm):
    """beam_width sequences per prompt, distinct, best first by vLLM's score; each one's cum_logprob is what the
    engine gives its tokens when they are the prompt (prompt_logprobs); its text is the whole sequence decoded."""
    p = BeamSearchParams(beam_width=3, max_tokens=6)
    outs = llm.beam_search(PROMPTS, p)
    tok, eos = llm.get_tokenizer(), llm.engine.eos_ids
    for prompt, o in zip(PROMPTS, outs, strict=True):
        n_prompt = len(llm.encode(prompt)[1])
        seqs = o.sequences
        assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) == 3
        scores = [beam_score(s, eos, 1.0) for s in seqs]
        assert scores == sorted(scores, reverse=True)
        for s in seqs:
            gen = s.tokens[n_prompt:]
            assert 1 <= len(gen) <= 6 and len(s.logprobs) == len(gen)
            assert (s.finish_reason == "stop") == (gen[-1] in eos) and all(t not in eos for t in gen[:-1])
            scored = llm.generate([s.tokens], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
            want = sum(scored[n_prompt + i][t].logprob for i, t in enumerate(gen))
            assert math.isclose(s.cum_logprob, want, abs_tol=1e-3), (s.cum_logprob, want)
            assert s.text == tok.decode(s.tokens)
    # one step: the beams are the beam_width likeliest first tokens, as the engine's top log-probs rank them
    one = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=1, ignore_eos=True))
    top = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, logprobs=4, ignore_eos=True))
    for o, g in zip(one, top, strict=True):
        ranked = sorted(g.outputs[0].logprobs[0].items(), key=lambda kv: kv[1].rank)[:4]
        assert [s.tokens[-1] for s in o.sequences] == [t for t, _ in ranked]


def test_bad_beam_search_calls_are_value_errors(llm):
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams(n=2))
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    with pytest.raises(ValueError, match="max_tokens|context"):  # prompt + max_tokens past max_model_len
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=200))
    # concurrency_limit: prompts searched a few at a time, the same results
    p = BeamSearchParams(beam_width=2, max_tokens=3)
    assert [[s.tokens for s in o.sequences] for o in llm.beam_search(PROMPTS, p, concurrency_limit=1)] == \
        [[s.tokens for s in o.sequences] for o in llm.beam_search(PROMPTS, p)]
