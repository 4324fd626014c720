"""Graphs for steps that admit prompts (engine/varlen_graphs.py), checked on the CPU as tests/test_graph_steps.py
checks the decode graphs: the capture replaced by an eager re-run that writes the static output in place. The
packing into the static buffer, the padding to the token bucket, the empty sequences, the snapshot entries and the
mixed scheduling (k = 0: decode rows beside the new prompts) are compared with the eager engine token for token
(fp32). The kernels on padded static batches are checked on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.config.engine import GraphConfig
from mtp_ray.engine.inputs import build, target_pieces
from mtp_ray.engine.varlen_graphs import VarlenGraphs, default_buckets, pack
from tests.test_graph_steps import emulated_capture, emulated_graphs, with_graphs  # noqa: F401 (a fixture)

PROMPTS = [[5, 17, 200, 31], list(range(40, 100)), [9] * 13, [300, 301, 302, 1000, 77, 78] * 5, [4, 4],
           list(range(500, 540)) * 2]


@pytest.fixture
def emulated_mixed(monkeypatch, emulated_graphs):  # noqa: F811
    monkeypatch.setattr(VarlenGraphs, "_capture", emulated_capture)  # (the decode graphs' stand-in serves both)


def with_mixed_graphs(llm: LLM, buckets: tuple[int, ...] = (8, 32, 64, 256), split: bool | None = None) -> LLM:
    """The decode graphs and the mixed-step graphs as a GPU engine has them (split scheduling as the engine picks
    it, unless given: off for k = 0)."""
    r, core = llm.engine.runner, llm.engine
    r.varlen = VarlenGraphs(r.model, buckets, llm.config.scheduler.max_num_seqs, r.blocks_per_seq, r.device,
                            q=core.k + 1)
    with_graphs(llm)
    core.scheduler.split = core.k > 0 if split is None else split
    core.warmup()  # again, now with the mixed graphs captured
    return llm


def outputs(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("k, split", [(0, False), (2, True), (2, False)])
def test_mixed_graph_steps_equal_eager(emulated_mixed, k, split):
    """A step budget of 64 tokens: the prompts come in pieces over several steps, beside the decodes of those
    already in (unsplit: in the same step; k > 0: verify rows, their rollback states as snapshot entries)."""
    kw = dict(num_speculative_tokens=k, max_num_seqs=8, max_num_batched_tokens=64)
    greedy = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    eager = outputs(LLM(**kw), greedy)
    llm = with_mixed_graphs(LLM(**kw), buckets=(8, 32, 64), split=split)
    st = llm.engine.stats
    assert outputs(llm, greedy) == eager
    assert st.mixed_graph_steps > 0 and set(llm.engine.runner.varlen.graphs) == {8, 32, 64}
    assert st.eager_tokens == 0, "every step within the buckets"
    assert (st.mixed_batch_steps > 0) == (not split), "unsplit: decode rows ride along with the new prompts"
    # seeded sampling (the host path after a mixed graph) and prompt log-probs (every row's logits)
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=i, logprobs=1, prompt_logprobs=i % 2,
                              ignore_eos=True) for i in range(len(PROMPTS))]
    assert outputs(llm, sampled) == outputs(LLM(**kw), sampled)


def test_prefix_hits_and_snapshots_through_mixed_graphs(emulated_mixed):
    """Prompts sharing a 48-token prefix: snapshots inside pieces and restored states go through the static
    buffer's snapshot entries; the outputs equal prefix caching off."""
    shared = list(range(100, 148))
    prompts = [shared + [7, i, 9 + i] for i in range(5)] + [shared + list(range(60, 90))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    off = [o.outputs[0].token_ids for o in LLM(enable_prefix_caching=False).generate(prompts, sp)]
    llm = with_mixed_graphs(LLM(max_num_seqs=8))
    for _ in range(2):  # the second round hits the first's blocks
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == off
    assert llm.engine.stats.mixed_graph_steps > 0
    assert llm.engine.blocks.index.hit_tokens > 0


def test_steps_past_the_buckets_run_eager(emulated_mixed):
    """A step past the largest bucket (or holding a piece past the short-piece limit) runs the eager forward."""
    llm, ref = with_mixed_graphs(LLM(max_num_seqs=8), buckets=(16,)), LLM(max_num_seqs=8)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    st = llm.engine.stats
    for prompts, graphed in (([[4, 4], [5, 17, 200, 31]], True), (PROMPTS, False)):
        eager_tokens = st.eager_tokens
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
        assert (st.eager_tokens == eager_tokens) == graphed
    assert st.mixed_graph_steps == 1


def test_pack_pads_to_the_bucket():
    """The static layout of a general batch: rows past its tokens write no KV, sequences past its own are empty,
    snapshot ranges per sequence, block tables only for its own rows."""
    llm = LLM(max_num_seqs=8)
    core = llm.engine
    for i, p in enumerate(PROMPTS[:3]):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=2))
    sched = core.scheduler.schedule()
    inp = build(target_pieces(sched), core.blocks)
    inp.batch.snapshots = [(1, 16, 5), (1, 48, 6)]
    r = core.runner
    g = VarlenGraphs(r.model, (128,), 8, r.blocks_per_seq, r.device)
    lay = g.layout(128)
    flat, used = pack(inp, lay, 8, r.blocks_per_seq)
    full = torch.zeros(lay.total, dtype=torch.long)
    full[:used] = torch.from_numpy(flat)
    v = lay.views(full)
    t = inp.num_tokens
    assert v["slots"][t:].eq(-1).all() and v["ids"][t:].eq(0).all()
    assert v["cu"].tolist() == inp.batch.cu_seqlens + [t] * (8 - 3)
    assert v["snap_ptr"].tolist() == [0, 0, 2, 2, 2, 2, 2, 2, 2] and v["snap_j"][:2].tolist() == [16, 48]
    assert used == lay.fields["tables"][0] + 3 * r.blocks_per_seq
    assert torch.equal(v["tables"][:3, : inp.batch.block_tables.shape[1]], inp.batch.block_tables)


def test_default_buckets_follow_the_step_budget():
    assert default_buckets(512) == (16, 32, 64, 128, 256, 384, 512)
    assert default_buckets(100) == (16, 32, 64, 100)
    assert default_buckets(8192)[-1] == 2048
    for bad in (5, [0, 16], ["16"]):
        with pytest.raises(ValueError, match="graphs.mixed_tokens"):
            GraphConfig(mixed_tokens=bad)
