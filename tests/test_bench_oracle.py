"""bench/oracle.py (the decode benchmark's oracle-draft mode) on the CPU: the bundled model's shapes with random
fp32 weights, the CUDA graphs emulated (tests/test_graph_steps.py). Drafts that are the target's own greedy
continuation are all accepted and the committed tokens are that continuation; corrupted drafts are all rejected;
in between, the acceptance length follows the rate. No speed is asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from mtp_ray.config.model import ModelConfig
from tests.test_graph_steps import emulated_graphs  # noqa: F401 (a fixture)

# bench/ on the path only while importing: it holds a kernels.py that transformers would take for the `kernels` package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
try:
    from decode import BLOCK, inputs, prepare, random_model
    from oracle import continuation_length, oracle_rows, positions_needed
finally:
    sys.path.pop(0)

ASSET = Path(__file__).resolve().parents[1] / "mtp_ray" / "assets" / "tiny-qwen35-mtp" / "config.json"


@pytest.mark.parametrize("bsz", [1, 3])
def test_oracle_drafts_are_accepted_at_the_set_rate(emulated_graphs, bsz):  # noqa: F811
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf_dict(json.loads(ASSET.read_text()))
    k, context, steps, cpu = 3, 20, 12, torch.device("cpu")
    width = (context + positions_needed(steps, k) + BLOCK) // BLOCK + 1
    model = random_model(cfg, cpu, torch.float32)
    prepare(model, bsz, width, 1 + bsz + bsz * (k + 1), torch.float32, cpu)

    def make(ctx: int, q: int):
        return inputs(bsz, ctx, width, cfg.vocab_size, cpu, q)

    with torch.inference_mode():
        out = oracle_rows(model, bsz, context, width, k, [1.0, 0.0, 0.5], steps, make, cpu, BLOCK)
    perfect, none, half = out["runs"]
    assert perfect["mean_acceptance_length"] == k + 1 and perfect["agreement"] == 1.0
    assert perfect["tokens"] == bsz * (steps - 1) * (k + 1)
    assert none["mean_acceptance_length"] == 1.0 and none["agreement"] == 1.0
    assert 1.0 < half["mean_acceptance_length"] < k + 1 and half["agreement"] == 1.0
    # fp32: the plain steps and the verify agree on the whole continuation
    assert out["plain"]["common_prefix_with_verify_tokens"] == [continuation_length(steps, k) + 1] * bsz
    assert out["plain"]["tokens"] > 0 and all(r["tokens_per_s"] > 0 for r in out["runs"])
