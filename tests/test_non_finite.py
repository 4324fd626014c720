"""A model whose logits are not finite for one request (a NaN weight row its prompt reads) fails that request with
the model's error; the others in the same steps keep their tokens and the engine serves on (it used to raise in
the sampler's multinomial and stop the whole step)."""

from __future__ import annotations

import pytest
import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.sampler import draft_probs, probs
from mtp_ray.runtime.messages import ModelError, RequestError, request_error
from mtp_ray.serve.cluster.groups import GroupClient

PROMPTS = [list(range(10, 30)), [7, 300, 21, 9, 88], list(range(50, 60))]
POISONED = 300  # its embedding row is NaN: only the second prompt reads it
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)


def set_row(llm: LLM, row: torch.Tensor | float) -> torch.Tensor:
    """Token POISONED's embedding row set to `row`; returns the row it had."""
    emb = llm.engine.runner.model.model.embed_tokens.weight
    old = emb[POISONED].clone()
    with torch.no_grad():
        emb[POISONED] = row
    return old


@pytest.mark.parametrize("k", [0, 2])
def test_a_request_with_non_finite_logits_fails_alone(k):
    llm = LLM(num_speculative_tokens=k)
    before = {name: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
              for name, sp in (("greedy", GREEDY), ("sampled", SAMPLED))}
    old = set_row(llm, float("nan"))
    for name, sp in (("greedy", GREEDY), ("sampled", SAMPLED)):
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, sp)]
        bad = outs[1]
        assert bad.finish_reason == "error" and "not finite" in bad.error, (name, bad)
        assert bad.token_ids == [], name  # its first token already had no finite logit
        assert [o.token_ids for o in (outs[0], outs[2])] == [before[name][0], before[name][2]], name
        assert all(o.finish_reason == "length" for o in (outs[0], outs[2]))
    set_row(llm, old)  # the original row back: the engine serves as before
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == before["greedy"]


@pytest.mark.parametrize("k", [0, 2])
def test_constraints_that_rule_out_every_token_are_the_requests_error(k):
    """allowed_token_ids [5] with token 5 banned as a bad word: no token is left. The request ends with its own error
    (a 400 over HTTP), where it used to sample from the whole vocabulary (the masks' -inf turned finite)."""
    llm = LLM(num_speculative_tokens=k)
    word = llm.get_tokenizer().decode([5])
    for t in (0, 1.0):
        out = llm.generate(["def main("], SamplingParams(temperature=t, allowed_token_ids=[5], bad_words=[word],
                                                         max_tokens=4))[0].outputs[0]
        assert out.finish_reason == "error" and "rule out every token" in out.error and out.token_ids == [], out
        assert llm.generate(["def main("], SamplingParams(temperature=t, allowed_token_ids=[5], max_tokens=3)
                            )[0].outputs[0].token_ids == [5, 5, 5]


def test_a_tiny_temperature_is_the_argmax_not_uniform():
    """Shifted by their max before the temperature divides them, logits far below zero cannot all overflow to -inf
    (they became the smallest finite value each: a uniform draw)."""
    x = torch.tensor([-3.0e38, -3.1e38, -3.2e38])
    assert probs(x, SamplingParams(temperature=1e-8)).tolist() == [1.0, 0.0, 0.0]


def test_a_draft_without_finite_logits_proposes_token_zero():
    q = draft_probs(torch.full((5,), float("nan")), 0.7)
    assert q.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert torch.allclose(draft_probs(torch.tensor([0.0, 1.0]), 1.0), torch.softmax(torch.tensor([0.0, 1.0]), -1))


def test_the_models_error_is_a_500_that_says_it():
    """Over HTTP the model's failure is no 400 (the request was valid) and no anonymous 500: it says what failed."""

    class Handle:
        def options(self, **_):
            return self

    client = GroupClient(Handle(), queue_s=1, retry_after_s=1)
    err = client.classify(ModelError("the model's logits are not finite at output token 0 (NaN / inf): ..."))
    assert err.status == 500 and "not finite" in err.message
    assert client.classify(RequestError("prompt must not be empty")).status == 400
    fault = StepOutput("r", [], [], [], True, "error", error="x", model_fault=True)
    assert isinstance(request_error(fault), ModelError)
    assert isinstance(request_error(StepOutput("r", [], [], [], True, "error", error="x")), RequestError)
