"""The CUDA-graph step logic, checked on the CPU: CudaGraphs with its capture replaced by an eager re-run that
writes the graph's static outputs in place (what a replay does). The static input buffers, padding to the graph
size, the device greedy acceptance, the draft-loop graph and the result block are then compared with the eager
engine token for token (fp32), without a GPU. Only the capture itself is left to the GPU tests."""

from __future__ import annotations

import pytest
import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.engine.graphs import CudaGraphs

PROMPTS = [[5, 17, 200, 31], list(range(40, 100)), [9] * 13, [300, 301, 302, 1000, 77, 78] * 5, [4, 4]]


class ReplayByRerun:
    """Stands in for a captured graph: replay() runs the function again and copies into the first outputs."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new = self.fn()
        olds, news = (self.out, new) if isinstance(self.out, tuple) else ((self.out,), (new,))
        for o, n in zip(olds, news, strict=True):
            o.copy_(n)


def emulated_capture(self: CudaGraphs, fn):
    """Stands in for CudaGraphs._capture: the function runs once (as on the GPU the eager warm-up run executes, the
    capture does not), and replays run it again."""
    self.barrier()
    out = fn()
    return ReplayByRerun(fn, out), out


@pytest.fixture
def emulated_graphs(monkeypatch):
    monkeypatch.setattr(CudaGraphs, "_capture", emulated_capture)


def with_graphs(llm: LLM, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> LLM:
    r = llm.engine.runner
    r.graphs = CudaGraphs(r.model, sizes, r.k, r.blocks_per_seq, llm.config.cache.block_size, r.device,
                          async_verify=llm.config.scheduler.async_verify, draft_vocab=r.draft_vocab)
    llm.engine.scheduler.split = True  # as with graphs on a GPU: decode steps never mix with prefill
    llm.engine.warmup()
    return llm


def run(llm: LLM, params: list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_graph_steps_equal_eager(emulated_graphs, k):
    greedy = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    eager = run(LLM(num_speculative_tokens=k, max_num_seqs=8), greedy)
    llm = with_graphs(LLM(num_speculative_tokens=k, max_num_seqs=8))
    assert run(llm, greedy) == eager
    st = llm.engine.stats
    assert st.device_greedy_steps > 0, "no step took the device greedy path"
    assert st.fused_steps == (st.device_greedy_steps if k else 0)  # one launch a step: target + draft loop
    g = llm.engine.runner.graphs
    assert set(g.target) == {1, 2, 4, 8} and set(g.draft) == set(g.fused) == ({1, 2, 4, 8} if k else set())
    # seeded sampling and log-probs: the target graph with the host path (and the eager draft loop)
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=i, logprobs=2 * (i % 2),
                              ignore_eos=True) for i in range(len(PROMPTS))]
    before = st.device_greedy_steps
    assert run(llm, sampled) == run(LLM(num_speculative_tokens=k, max_num_seqs=8), sampled)
    assert st.device_greedy_steps == before


def outputs(llm: LLM, prompts, params) -> list[tuple]:
    """Per request (token ids, finish reason, log-probs)."""
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].token_logprobs)
            for o in llm.generate(prompts, params)]


def same(got: list[tuple], ref: list[tuple]) -> bool:
    """Same tokens and finish reasons; log-probs within 1e-4 (a step's padded batch size may differ, and with it
    the last bits of an fp32 GEMM)."""
    return len(got) == len(ref) and all(
        g[:2] == r[:2] and len(g[2]) == len(r[2]) and all(abs(a - b) < 1e-4 for a, b in zip(g[2], r[2], strict=True))
        for g, r in zip(got, ref, strict=True))


def test_async_scheduling_equals_sync(emulated_graphs):
    """Async scheduling (k = 0): each graph step launches before the previous one is committed, its rows reading
    their tokens from the device. Same tokens, finish reasons and log-probs as the synchronous engine, through stops
    at EOS-like stop tokens (a row then runs one step too many and is dropped), max_tokens, max_model_len, a sampled
    request joining (host path with tokens in flight), and preemption (tight blocks)."""
    sync = with_graphs(LLM(max_num_seqs=8, async_scheduling=False))
    ref_ids = [o.outputs[0].token_ids for o in sync.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16,
                                                                                      ignore_eos=True))]
    # stop on a token each request generates mid-way (several requests stop at different steps)
    params = [SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[ids[3 + i]], logprobs=0)
              for i, ids in enumerate(ref_ids)]
    params[2] = SamplingParams(temperature=0, max_tokens=7 + 1, ignore_eos=True)
    params[4] = SamplingParams(temperature=0.9, seed=3, max_tokens=3, ignore_eos=True)  # then all greedy
    for kw in ({}, {"max_model_len": 70}, {"num_blocks": 16, "block_size": 8, "max_model_len": 80}):
        ref = outputs(with_graphs(LLM(max_num_seqs=8, async_scheduling=False, **kw)), PROMPTS, params)
        llm = with_graphs(LLM(max_num_seqs=8, **kw))
        assert same(outputs(llm, PROMPTS, params), ref), kw
        e = llm.engine
        assert e.stats.async_steps > 0 and e.greedy.inflight is None
        assert e.blocks.num_free_blocks == e.blocks.num_blocks - 1  # every block came back
        if "num_blocks" in kw:
            assert e.scheduler.num_preemptions > 0
    # a stop token as a request's first generated token: its next row is already in flight, then dropped
    first = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[ref_ids[0][1]])
    assert same(outputs(with_graphs(LLM(max_num_seqs=8)), PROMPTS[:2], [first] * 2), outputs(
        with_graphs(LLM(max_num_seqs=8, async_scheduling=False)), PROMPTS[:2], [first] * 2))


@pytest.mark.parametrize("k", [0, 2])
def test_async_scheduling_abort_and_drain(emulated_graphs, k):
    """A request aborted while its token (k > 0: its verify) is in flight ends with no more tokens; drain() commits
    what is in flight (group commands run after it); nothing leaks."""
    llm = with_graphs(LLM(max_num_seqs=8, num_speculative_tokens=k, async_verify=True))
    e = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), p, sp)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    for _ in range(50):  # prefill, then the first decode step is left in flight
        for o in e.step():
            got[o.request_id] += o.new_token_ids
        if e.greedy.inflight is not None:
            break
    assert e.greedy.inflight is not None, "no step was left in flight"
    aborted = e.abort_request("1")
    assert aborted is not None and aborted.finished and aborted.finish_reason == "abort"
    before = len(got["1"])
    e.drain()
    assert e.greedy.inflight is None
    for _ in range(3):
        for o in e.step():
            got[o.request_id] += o.new_token_ids
            assert o.request_id != "1"
    assert len(got["1"]) == before
    e.abort_all()
    while e.has_unfinished() or e.greedy.inflight is not None or e.pending_outputs:
        e.step()
    assert e.blocks.num_free_blocks == e.blocks.num_blocks - 1


@pytest.mark.parametrize("k", [0, 2])
def test_async_scheduling_with_min_tokens_and_late_joiners(emulated_graphs, k):
    """Requests that turn plain greedy later (min_tokens reached), a request for log-probs and one that arrives
    while a step is in flight: the same tokens as the synchronous engine, and steps did go async (k > 0: async
    verify steps)."""
    params = [SamplingParams(temperature=0, max_tokens=14, min_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, logprobs=1, ignore_eos=True)]

    def drive(llm: LLM) -> dict[str, list[int]]:
        e, got = llm.engine, {}
        for i, p in enumerate(params):
            e.add_request(str(i), PROMPTS[i], p)
        late = False
        while e.has_unfinished() or e.greedy.inflight is not None:
            for o in e.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if not late and len(got.get("1", [])) >= 4:  # joins mid-stream (in flight when async)
                e.add_request("late", PROMPTS[3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                late = True
        return got

    ref = drive(with_graphs(LLM(max_num_seqs=8, num_speculative_tokens=k, async_scheduling=False)))
    llm = with_graphs(LLM(max_num_seqs=8, num_speculative_tokens=k, async_verify=True))
    assert drive(llm) == ref and len(ref) == 4
    st = llm.engine.stats
    assert st.async_steps > 0
    # k > 0: every device-greedy step launched its draft loop with the target (the fused graph), those whose rows
    # turned plain greedy at the resolve before the launch too
    assert st.fused_steps == (st.device_greedy_steps if k else 0)


@pytest.mark.parametrize("k", [1, 3])
def test_async_verify_equals_sync(emulated_graphs, k):
    """Async verify steps (k > 0, scheduler.async_verify): a verify launches before the previous one is committed;
    its tokens, positions, KV slots and GDN slots come from the device. Same tokens, finish reasons and log-probs as
    the synchronous engine through stop tokens, max_tokens, max_model_len, a sampled request joining and preemption;
    every block and state slot comes back."""
    kw0 = {"num_speculative_tokens": k, "max_num_seqs": 8}
    sync = with_graphs(LLM(**kw0, async_scheduling=False))
    ref_ids = [o.outputs[0].token_ids for o in sync.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16,
                                                                                      ignore_eos=True))]
    params = [SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[ids[3 + i]], logprobs=0)
              for i, ids in enumerate(ref_ids)]
    params[2] = SamplingParams(temperature=0, max_tokens=7 + 1, ignore_eos=True)
    params[4] = SamplingParams(temperature=0.9, seed=3, max_tokens=3, ignore_eos=True)
    for kw in ({}, {"max_model_len": 70}, {"num_blocks": 17 - k, "block_size": 8, "max_model_len": 80}):
        sync = with_graphs(LLM(**kw0, async_scheduling=False, **kw))
        ref = outputs(sync, PROMPTS, params)
        llm = with_graphs(LLM(**kw0, async_verify=True, **kw))
        assert same(outputs(llm, PROMPTS, params), ref), kw
        e = llm.engine
        assert e.stats.async_steps > 0 and e.greedy.inflight is None
        assert e.stats.accepted == sync.engine.stats.accepted, kw  # the same drafts were verified
        assert e.blocks.num_free_blocks == e.blocks.num_blocks - 1
        assert len(e.blocks.free_slots) == e.runner.cache_shape.num_state_slots - 1 - e.runner.snapshot_slots
        if "num_blocks" in kw:
            assert e.scheduler.num_preemptions > 0
    # the drafts fed from the device are the ones the synchronous engine verifies: the same acceptance
    long = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * len(PROMPTS)
    llm, ref = with_graphs(LLM(**kw0, async_verify=True)), with_graphs(LLM(**kw0, async_scheduling=False))
    assert same(outputs(llm, PROMPTS, long), outputs(ref, PROMPTS, long))
    st = llm.engine.stats
    assert st.async_steps > 0 and st.accepted == ref.engine.stats.accepted > 0


@pytest.mark.parametrize("k", [1, 3])
def test_async_verify_launches_nothing_after_a_last_verify(emulated_graphs, k):
    """A lone request whose verify in flight may reach max_tokens: no step is launched on top of it (its row would
    be dropped, and at batch 1 such a launch is a whole step of host work); the tokens are the synchronous
    engine's whatever the count of tokens left (every verify length ends some request)."""
    kw = {"num_speculative_tokens": k, "max_num_seqs": 8}
    llm, ref = with_graphs(LLM(**kw, async_verify=True)), with_graphs(LLM(**kw, async_scheduling=False))
    for n in range(2, 18):
        sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)]
        assert same(outputs(llm, PROMPTS[1:2], sp), outputs(ref, PROMPTS[1:2], sp)), n
    st = llm.engine.stats
    assert st.async_steps > 0 and st.accepted == ref.engine.stats.accepted > 0
    assert st.device_greedy_steps == st.verify_steps  # every launched verify was committed


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_after_prefill_run_as_graph(emulated_graphs, k):
    """One rank with graphs: the drafts after a prefill come from the draft-loop graph (MTP step 1 eager up to the
    last k + 1 rows, the graph from there), chunked prompts too. Same tokens and the same accepted drafts as the
    eager engine; a step holding a prompt too short for it, or a sampled request, keeps the eager loop."""
    prompts = [list(range(40, 100)), [300, 301, 302, 1000, 77, 78] * 5, [9] * 13, list(range(500, 537))]
    greedy = [SamplingParams(temperature=0, max_tokens=10 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    kw = {"num_speculative_tokens": k, "max_num_seqs": 8, "prefill_chunk": 24}  # 60 / 30 / 37 tokens: chunked
    eager = LLM(**kw)
    llm = with_graphs(LLM(**kw))
    st = llm.engine.stats
    assert run(llm, greedy, prompts) == run(eager, greedy, prompts)
    assert st.draft_graphs_after_eager > 0
    assert st.accepted == eager.engine.stats.accepted and st.drafted == eager.engine.stats.drafted
    # a prompt of k + 1 tokens has no row before its last k + 1: its prefill step drafts eagerly
    before = st.draft_graphs_after_eager
    short = list(range(7, 8 + k))
    assert run(llm, greedy[:1], [short]) == run(eager, greedy[:1], [short])
    assert st.draft_graphs_after_eager == before
    sampled = [SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)]
    assert run(llm, sampled, prompts[:1]) == run(eager, sampled, prompts[:1])
    assert st.draft_graphs_after_eager == before


def test_drafts_after_prefill_graph_in_a_group_of_one(emulated_graphs):
    """A serving group of one rank (DPSync, world 1: the deployment on one GPU) has no EP exchange, so it drafts
    after a prefill from the draft-loop graph as the offline engine does; same tokens and accepted drafts as eager.
    A group of more ranks keeps the eager loop (docs/design.md, rule 4)."""
    from mtp_ray.config.model import ModelConfig
    from mtp_ray.engine.core import EngineCore
    from mtp_ray.parallel.context import DistContext
    from mtp_ray.parallel.sync import DPSync

    prompts = [list(range(40, 100)), [300, 301, 302, 1000, 77, 78] * 5]
    greedy = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
    kw = {"num_speculative_tokens": 3, "max_num_seqs": 8}
    eager = LLM(**kw)
    llm = LLM(**kw)
    experts = ModelConfig.from_pretrained(llm.config.model).num_experts
    sync = DPSync(DistContext(0, 1, experts, torch.device("cpu"), 60.0))
    assert sync.single_rank and sync.lockstep
    llm.engine = EngineCore(llm.config, sync=sync)
    with_graphs(llm)
    st = llm.engine.stats
    assert run(llm, greedy, prompts) == run(eager, greedy, prompts)
    assert st.draft_graphs_after_eager > 0
    assert st.accepted == eager.engine.stats.accepted and st.drafted == eager.engine.stats.drafted
    assert not DPSync(DistContext(0, 2, experts, torch.device("cpu"), 60.0)).single_rank


@pytest.mark.parametrize("graphs", [False, True])
def test_a_reduced_draft_vocabulary_keeps_the_output(emulated_graphs, monkeypatch, graphs):
    """spec.draft_vocab_size: the MTP head drafts from ids [0, N) only (eager loop and draft-loop graph); the
    verify keeps the whole vocabulary, so greedy output equals k = 0 and seeded sampling still runs; acceptance
    falls when the tokens the model writes lie past N."""
    from mtp_ray.model.qwen3_5 import Qwen3_5MoeForCausalLM

    n = 64
    widths: list[int] = []
    real = Qwen3_5MoeForCausalLM.draft_logits

    def recorded(self, hidden, vocab=0):
        out = real(self, hidden, vocab)
        widths.append(out.shape[-1])
        return out

    monkeypatch.setattr(Qwen3_5MoeForCausalLM, "draft_logits", recorded)
    greedy = [SamplingParams(temperature=0, max_tokens=20 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    plain = run(LLM(num_speculative_tokens=0, max_num_seqs=8), greedy)
    make = (lambda **kw: with_graphs(LLM(**kw))) if graphs else (lambda **kw: LLM(**kw))
    full = make(num_speculative_tokens=3, max_num_seqs=8)
    assert run(full, greedy) == plain
    assert set(widths) == {full.engine.runner.model_config.vocab_size}
    widths.clear()
    small = make(num_speculative_tokens=3, max_num_seqs=8, draft_vocab_size=n)
    assert run(small, greedy) == plain
    assert widths and set(widths) == {n}, "a draft forward read logits past the draft vocabulary"
    assert small.engine.stats.accepted < full.engine.stats.accepted
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=16) for i in range(len(PROMPTS))]
    assert all(len(t) == 16 for t in run(small, sampled))


def test_a_draft_vocabulary_past_the_model_s_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match="spec.draft_vocab_size"):
        LLM(num_speculative_tokens=3, draft_vocab_size=10**6)
    with pytest.raises(ValueError, match="spec.draft_vocab_size"):
        LLM(num_speculative_tokens=3, draft_vocab_size=-1)
