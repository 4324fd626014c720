"""A DP group's graph steps on the CPU: two gloo ranks in spawned processes (no Ray), EP over the torch backend, CUDA
graphs emulated as in tests/test_graph_steps.py. One rank's rows are all plain greedy, so it replays the fused graph
(target forward and draft loop in one launch); the other holds a greedy request for log-probs, so it replays the
target graph, commits on the host and then replays the draft-loop graph. Each rank decides this alone: the EP
exchanges must still come in the same order on both (design.md, rule 4), so the group neither hangs nor changes a
token against one engine."""

from __future__ import annotations

import pytest

from tests.ep_ranks import run_ranks

K = 3
PROMPTS = [[5, 17, 200, 31, 8, 9], list(range(40, 70)), [9] * 13, [300, 301, 302, 1000, 77, 78] * 3]
# rank 0: PROMPTS[0, 1], plain greedy; rank 1: PROMPTS[2] for log-probs (not plain) and PROMPTS[3] plain
PARAMS = [dict(max_tokens=14), dict(max_tokens=9), dict(max_tokens=12, logprobs=1), dict(max_tokens=10)]


def _rank(rank: int, world: int, port: int, queue) -> None:
    try:
        import torch

        from mtp_ray import SamplingParams
        from mtp_ray.config.flat import engine_config
        from mtp_ray.config.model import ModelConfig
        from mtp_ray.engine.core import EngineCore
        from mtp_ray.engine.graphs import CudaGraphs
        from mtp_ray.parallel.context import DistContext
        from mtp_ray.parallel.ep import make_dispatcher
        from mtp_ray.parallel.sync import DPSync
        from tests.test_graph_steps import emulated_capture

        CudaGraphs._capture = emulated_capture  # this spawned process only
        torch.set_num_threads(1)
        cfg = engine_config(num_speculative_tokens=K, max_num_seqs=8, device="cpu", dtype="float32")
        mc = ModelConfig.from_pretrained(cfg.model)
        ctx = DistContext(rank, world, mc.num_experts, torch.device("cpu"), 60.0)
        ctx.init("127.0.0.1", port)
        core = EngineCore(cfg, ctx.expert_range, make_dispatcher("torch", ctx, mc.hidden_size, torch.float32, 0),
                          DPSync(ctx))
        r = core.runner
        r.graphs = CudaGraphs(r.model, (1, 2, 4), r.k, r.blocks_per_seq, cfg.cache.block_size, r.device,
                              ctx.barrier, async_verify=True, draft_vocab=r.draft_vocab)
        core.scheduler.split = True  # as with graphs on a GPU
        core.warmup()
        for i in (0, 1) if rank == 0 else (2, 3):
            core.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0, ignore_eos=True, **PARAMS[i]))
        got: dict[str, list[int]] = {}
        sync = core.sync
        for _ in range(500):  # one wave, as the rank worker's loop runs it
            for o in core.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            g = sync.step_table
            if g is not None and g.all_dummy and not g.any_unfinished:
                break
        st = core.stats
        queue.put((rank, got, st.fused_steps, st.device_greedy_steps, sync.counters["graph_draft_loops"],
                   sync.counters["forwards"], None))
    except Exception as e:  # reported, not raised: the other rank would wait for this one's collectives
        queue.put((rank, None, 0, 0, 0, 0, repr(e)))


@pytest.mark.timeout(300)
def test_fused_and_split_draft_graphs_in_one_group_equal_one_engine():
    from mtp_ray import LLM, SamplingParams

    res = run_ranks(_rank, 2, timeout=240)
    assert [r[-1] for r in res] == [None, None], res
    got = {**res[0][1], **res[1][1]}
    ref = LLM(num_speculative_tokens=K, max_num_seqs=8).generate(
        PROMPTS, [SamplingParams(temperature=0, ignore_eos=True, **p) for p in PARAMS])
    assert [got[str(i)] for i in range(len(PROMPTS))] == [o.outputs[0].token_ids for o in ref]
    (_, _, fused0, greedy0, loops0, fwd0, _), (_, _, fused1, greedy1, loops1, fwd1, _) = res
    assert fused0 > 0 and fused0 == greedy0  # rank 0: every plain-greedy graph step was one launch
    # rank 1, while its log-prob request ran: target graph -> host commit -> draft-loop graph, rank 0 fused
    assert loops1 - fused1 > loops0 - fused0
    assert loops0 == loops1 and fwd0 == fwd1  # the same draft loops and forwards on both ranks
