"""Speculative decoding internals: rejection sampling keeps the target distribution; GDN state rollback."""

from __future__ import annotations

import pytest
import torch

from mtp_ray import SamplingParams
from mtp_ray.config.flat import engine_config
from mtp_ray.engine.core import EngineCore
from mtp_ray.engine.rejection import accept_or_resample, verify
from mtp_ray.engine.sampler import Row, draw

# chi-square critical value, 5 degrees of freedom, alpha = 0.001
CHI2_5_001 = 20.515


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    n = counts.sum()
    expected = p * n
    return float(((counts - expected) ** 2 / expected).sum())


P = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
Q = torch.tensor([0.30, 0.10, 0.25, 0.05, 0.10, 0.20])


def emitted_counts(step, trials: int = 30000, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(P))
    for _ in range(trials):
        d = draw(Q, gen)
        counts[step(P, Q, d, gen)[1]] += 1
    return counts


def biased_resample(p, q, d, gen):
    """A deliberately wrong sampler: on rejection it resamples from p instead of the residual max(p - q, 0)."""
    ok, t = accept_or_resample(p, q, d, gen)
    return (ok, t) if ok else (False, draw(p, gen))


def test_rejection_sampling_preserves_target_distribution():
    assert chi_square(emitted_counts(accept_or_resample), P) < CHI2_5_001


def test_chi_square_test_rejects_a_biased_sampler():
    assert chi_square(emitted_counts(biased_resample), P) > CHI2_5_001


def test_verify_first_token_and_bonus_follow_target():
    """Through verify(): with k = 2 drafts drawn from q, the first emitted token ~ p."""
    logits = P.log().expand(3, -1).clone()
    params = SamplingParams(temperature=1.0)
    rows = [Row(params, [], 0, ()) for _ in range(3)]
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(len(P))
    for _ in range(20000):
        drafts = [draw(Q, gen), draw(Q, gen)]
        out = verify(logits, drafts, torch.stack([Q, Q]), rows, gen)
        counts[out[0]] += 1
        assert 1 <= len(out) <= 3
    assert chi_square(counts, P) < CHI2_5_001


def gdn_states(engine: EngineCore, req_id: str) -> list[torch.Tensor]:
    slot = engine.requests[req_id].state_slots[0]
    out = []
    for gdn in engine.runner.model.gdn_layers():
        out += [gdn.conv_state[slot].clone(), gdn.ssm_state[slot].clone()]
    return out


@pytest.mark.parametrize("accept", [0, 1, 3])
def test_gdn_rollback_equals_run_on_accepted_tokens(accept):
    """Verify [t, d1, d2, d3] with `accept` correct drafts: the committed conv + recurrent states equal those of a
    k = 0 engine that only ever saw the accepted tokens."""
    prompt = [11, 400, 27, 31, 99, 123, 7, 64, 200, 5]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = EngineCore(engine_config(block_size=4))
    ref.add_request("r", prompt, params)
    ref.step()  # prefill -> t1
    ref_states = []
    for _ in range(4):  # decode t1..t4: states after t1, after t2, ...
        ref.step()
        ref_states.append(gdn_states(ref, "r"))
    truth = ref.requests["r"].output_ids  # t1..t5

    eng = EngineCore(engine_config(block_size=4, num_speculative_tokens=3))
    eng.add_request("r", prompt, params)
    eng.step()  # prefill -> t1, MTP drafts
    req = eng.requests["r"]
    assert req.output_ids == truth[:1]
    wrong = [(t + 1) % 2048 for t in truth[1:4]]  # certainly not the target token
    req.drafts = truth[1 : 1 + accept] + wrong[accept:]  # drafts for t2, t3, t4
    eng.step()
    assert req.output_ids == truth[: accept + 2]
    assert req.num_computed == len(prompt) + accept + 1
    for got, want in zip(gdn_states(eng, "r"), ref_states[accept]):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
