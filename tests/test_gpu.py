"""GPU checks (run on the device machine: `pytest -m gpu tests/test_gpu.py`); skipped on CPU with the reason."""

from __future__ import annotations

import pytest
import torch

from mtp_ray import LLM, SamplingParams

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (nvidia-h200-x2)")

PROMPTS = [[5, 17, 200, 31], list(range(40, 100)), [9] * 13, [300, 301, 302, 1000, 77, 78] * 5]


def greedy(llm: LLM, n: int = 32) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]


@needs_gpu
def test_gpu_fp32_matches_cpu_and_mtp_is_exact():
    cpu = greedy(LLM(device="cpu", dtype="float32"))
    gpu = greedy(LLM(device="cuda", dtype="float32"))
    assert gpu == cpu
    for k in (1, 3):
        assert greedy(LLM(device="cuda", dtype="float32", num_speculative_tokens=k)) == gpu


@needs_gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_fp32_drafts_as_the_cpu_drafts(graphs):
    """fp32 MTP on the GPU accepts what it accepts on the CPU: equal outputs alone would hide a draft-path fault (a
    wrong position or KV slot in the draft loop costs acceptance, never tokens). A near-tie may flip a draft or two
    between the devices' roundings, not more."""
    runs = []
    for dev, g in (("cpu", False), ("cuda", graphs)):
        llm = LLM(device=dev, dtype="float32", num_speculative_tokens=3, cuda_graphs=g)
        out = greedy(llm)
        runs.append((out, llm.engine.stats.drafted, llm.engine.stats.accepted))
    (cpu_out, cpu_drafted, cpu_accepted), (gpu_out, gpu_drafted, gpu_accepted) = runs
    assert gpu_out == cpu_out
    assert cpu_accepted > 0.3 * cpu_drafted  # the bundled MTP head drafts well (half its drafts on these prompts)
    assert abs(gpu_accepted - cpu_accepted) <= 3 and abs(gpu_drafted - cpu_drafted) <= 3, (runs[0][1:], runs[1][1:])


@needs_gpu
def test_a_token_budget_past_max_model_len_starts_and_serves():
    """max_num_batched_tokens > max_model_len (many short prompts a step): the warmup forward of the whole budget
    read rope table rows past max_model_len (an illegal memory access at engine start) before its positions
    wrapped."""
    llm = LLM(device="cuda", dtype="bfloat16", num_speculative_tokens=3, max_model_len=64,
              max_num_batched_tokens=1024)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [64 - len(p) for p in PROMPTS]


@needs_gpu
def test_gpu_bf16_runs_with_mtp():
    base = greedy(LLM(device="cuda", dtype="bfloat16"))
    llm = LLM(device="cuda", dtype="bfloat16", num_speculative_tokens=3)
    out = greedy(llm)
    assert all(len(o) == 32 for o in out)
    # bf16 verify batches differ in shape from k = 0 batches: tokens may differ after a near-tie, not wholesale
    same = sum(a == b for x, y in zip(out, base) for a, b in zip(x, y)) / sum(len(x) for x in base)
    assert same > 0.5
    assert llm.engine.stats.accepted > 0.3 * llm.engine.stats.drafted


@needs_gpu
def test_cuda_graphs_equal_eager_bf16():
    """Graph replays (target step, greedy draft loop) give the eager uniform path's tokens exactly."""
    for k in (0, 3):
        eager = greedy(LLM(device="cuda", dtype="bfloat16", num_speculative_tokens=k, cuda_graphs=False))
        llm = LLM(device="cuda", dtype="bfloat16", num_speculative_tokens=k)
        assert greedy(llm) == eager
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.target, "no target graph was captured"
        assert bool(graphs.draft) == bool(k), "the greedy draft loop should run as a graph"


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_graph_steps_equal_eager_mixed_steps(dtype):
    """Steps that admit prompts replay their token bucket's graph (engine/varlen_graphs.py: padded static batches,
    with empty sequences, rows that no sequence owns and snapshot entries in the GDN kernels): greedy outputs equal
    the eager mixed steps' (the same schedule: a 64-token budget, prompts in pieces beside running decodes), over
    three rounds whose later ones hit the prefix cache."""
    kw = {"device": "cuda", "dtype": dtype, "max_num_batched_tokens": 64, "max_num_seqs": 8, "split_prefill": False}
    prompts = PROMPTS + [list(range(500, 540)) * 2, [7] * 33, list(range(40, 100)) + [3, 4]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for buckets in ((), None):
        llm = LLM(mixed_graph_tokens=buckets, **kw)
        outs.append([[o.outputs[0].token_ids for o in llm.generate(ps, sp)] for ps in (prompts, prompts[::-1])])
        st = llm.engine.stats
        assert (st.mixed_graph_steps > 0) == (buckets is None) and st.mixed_batch_steps > 0
    assert outs[0] == outs[1]


@needs_gpu
def test_cuda_graphs_fp32_mtp_exact_and_sampling_reproducible():
    ref = greedy(LLM(device="cuda", dtype="float32", cuda_graphs=False))
    assert greedy(LLM(device="cuda", dtype="float32", num_speculative_tokens=3)) == ref
    # seeded sampling: target graph + eager draft loop (random drafts) = all eager, token for token
    sp = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=i, ignore_eos=True)
          for i in range(len(PROMPTS))]
    outs = []
    for graphs in (True, False):
        llm = LLM(device="cuda", dtype="float32", num_speculative_tokens=3, cuda_graphs=graphs)
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)])
    assert outs[0] == outs[1]


@needs_gpu
def test_drafts_after_prefill_graph_equal_eager_drafts():
    """The drafts after a prefill from the draft-loop graph (MTP step 1 eager up to the last k + 1 rows): with
    max_tokens = k + 2 each request is a prefill and one verify of exactly those drafts, so equal accepted counts
    mean equal drafts; fp32, against an engine without graphs."""
    kw = {"device": "cuda", "dtype": "float32", "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = PROMPTS[1:] + [list(range(600, 700))]  # longer than k + 1 tokens (the graph needs a row before them)
    eager, llm = LLM(**kw, cuda_graphs=False), LLM(**kw)
    before = [e.engine.stats.snapshot() for e in (eager, llm)]
    for e in (eager, llm):
        for p in prompts:  # one at a time: every prefill step has a captured graph size
            e.generate([p], sp)
    now = [e.engine.stats.snapshot() for e in (eager, llm)]
    new = [{key: n[key] - b[key] for key in b if isinstance(b[key], (int, float))}  # counters (not histograms)
           for n, b in zip(now, before, strict=True)]
    assert new[1]["draft_graphs_after_eager"] == len(prompts) and new[0]["draft_graphs_after_eager"] == 0
    assert new[1]["accepted"] == new[0]["accepted"] > 0
    assert greedy(llm) == greedy(eager)


@needs_gpu
def test_cuda_graphs_recaptured_after_sleep(ray_cluster):
    """sleep frees the caches the graphs point at and drops the graphs; after wake_up new traffic recaptures and
    gives the same tokens (through the RL actor handle). The group has one rank: its drafts after a prefill come
    from the draft-loop graph (no EP exchange to keep in step), here every prompt being longer than k + 1 tokens
    (the graph decodes on top of a cached row)."""
    from mtp_ray.rl.engine import launch_engine

    h = launch_engine({"device": "cuda", "dtype": "bfloat16", "spec": {"num_speculative_tokens": 3}})
    params = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
    prompts = PROMPTS[1:]  # PROMPTS[0] has k + 1 tokens: a step holding it drafts eagerly
    try:
        first = ray_cluster.get(h.generate.remote(prompts, params))
        assert ray_cluster.get(h.get_stats.remote())["ranks"][0]["draft_graphs_after_eager"] > 0
        ray_cluster.get(h.sleep.remote(1))
        ray_cluster.get(h.wake_up.remote())
        second = ray_cluster.get(h.generate.remote(prompts, params))
        assert [r["token_ids"] for r in second] == [r["token_ids"] for r in first]
    finally:
        ray_cluster.get(h.shutdown.remote())


@needs_gpu
def test_offline_sleep_and_wake_up_recapture_the_graphs():
    """The offline LLM's sleep / wake_up (vLLM's names) on the GPU with CUDA graphs and MTP: level 1 (weights to the
    host and back) and level 2 (weights dropped, brought back by update_weights), each followed by the same greedy
    tokens from recaptured graphs; the device memory the caches held is given back while asleep."""
    from mtp_ray.model.loader import checkpoint_tensors

    llm = LLM(device="cuda", dtype="bfloat16", num_speculative_tokens=3)
    want = greedy(llm)
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    for level in (1, 2):
        llm.sleep(level)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() < awake / 2, (level, torch.cuda.memory_allocated(), awake)
        if level == 2:
            llm.update_weights([(n, read(None)) for n, _, read in checkpoint_tensors(llm.config.model)])
        llm.wake_up()
        assert greedy(llm) == want, level
        assert llm.engine.stats.graph_steps > 0, "woken without CUDA graphs"


@needs_gpu
def test_no_triton_recompiles_for_new_batch_shapes(ray_cluster):
    """Serving does not compile a Triton kernel per new batch shape (a compile stalls the whole group for ~1 s): after
    one pass over mixed prompt lengths and arrival patterns, a second pass with other lengths and batch compositions
    compiles nothing (the ranks' StallMonitor, through get_stats)."""
    import random

    from mtp_ray.rl.engine import launch_engine

    def burst(seed: int) -> list:
        rng = random.Random(seed)
        refs = []
        for _ in range(4):  # waves of different sizes: prefill steps of different token counts and widths
            ps = [[rng.randrange(3, 2000) for _ in range(rng.randint(3, 300))] for _ in range(rng.randint(1, 24))]
            refs += [h.generate.remote(p, {"temperature": 0, "max_tokens": rng.randint(2, 40), "ignore_eos": True})
                     for p in ps]
        return refs

    def compiles() -> int:
        return sum(r["stalls"]["triton_compiles"] for r in ray_cluster.get(h.get_stats.remote())["ranks"])

    h = launch_engine({"device": "cuda", "dtype": "bfloat16", "spec": {"num_speculative_tokens": 2},
                       "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048}})
    try:
        ray_cluster.get(burst(0))
        before = compiles()
        ray_cluster.get(burst(1))
        ray_cluster.get(burst(2))
        assert compiles() == before, ray_cluster.get(h.get_stats.remote())["ranks"][0]["stalls"]["recent_compiles"][-3:]
    finally:
        ray_cluster.get(h.shutdown.remote())


@needs_2_gpus
def test_dp2_on_two_gpus_equals_dp1(ray_cluster):
    from mtp_ray.rl.engine import launch_engine
    from tests.helpers import settled_stats

    ref = greedy(LLM(device="cuda", dtype="float32", num_speculative_tokens=2))
    h = launch_engine({"device": "cuda", "dtype": "float32", "spec": {"num_speculative_tokens": 2},
                       "parallel": {"dp": 2, "placement_strategy": "STRICT_PACK"}})
    try:
        res = ray_cluster.get(h.generate.remote(PROMPTS, {"temperature": 0, "max_tokens": 32, "ignore_eos": True}))
        assert [r["token_ids"] for r in res] == ref
        st = settled_stats(h)
        assert len({r["collectives"] for r in st["ranks"]}) == 1
        # decode steps ran as graphs on both ranks (DP-wide padded size), the draft loop as one graph too
        assert all(r["graph_steps"] > 0 and r["graph_draft_loops"] > 0 for r in st["ranks"])
    finally:
        ray_cluster.get(h.shutdown.remote())


@needs_gpu
def test_device_greedy_equals_host_path():
    """Plain greedy graph steps verify on the device (one small copy per step, the draft loop right after the
    target graph); a request for top log-probs takes the host path: same tokens, same log-probs."""
    for k in (0, 3):
        llm = LLM(device="cuda", dtype="float32", num_speculative_tokens=k)
        fast = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        before = llm.engine.stats.device_greedy_steps
        assert before > 0
        model = llm.engine.runner.model
        assert all(m.in_proj.fused for m in model.gdn_layers()) and all(a.qkv_proj.fused
                                                                        for a in model.attention_layers())
        slow = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2))
        assert llm.engine.stats.device_greedy_steps == before
        for f, s in zip(fast, slow, strict=True):
            assert f.outputs[0].token_ids == s.outputs[0].token_ids
            assert max(abs(a - b) for a, b in zip(f.outputs[0].token_logprobs, s.outputs[0].token_logprobs,
                                                          strict=True)) < 1e-4
        # a stop token inside the accepted drafts ends the request there, as on the host path
        ids = fast[1].outputs[0].token_ids
        end = ids.index(ids[5]) + 1  # the first occurrence of that token
        cut = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      stop_token_ids=[ids[5]]))
        assert cut[0].outputs[0].token_ids == ids[:end] and cut[0].outputs[0].finish_reason == "stop"


def _stopping_params(ref: list[list[int]]) -> list[dict]:
    """Greedy requests that stop at different steps: on a token each generates (EOS-like), or at max_tokens."""
    sp = [{"temperature": 0, "max_tokens": 32, "stop_token_ids": [ids[4 + 3 * i]]} for i, ids in enumerate(ref)]
    sp[-1] = {"temperature": 0, "max_tokens": 21, "ignore_eos": True}
    return sp


@needs_gpu
@pytest.mark.parametrize("k", [0, 3])
def test_async_scheduling_equals_sync(k):
    """Graph steps launch before the previous step is committed (inputs from the device, results through pinned
    buffers; k = 3: async verify steps, the next verify's inputs and GDN slots moved on the device): same tokens,
    finish reasons and accepted drafts as the synchronous engine, fp32."""
    kw = {"device": "cuda", "dtype": "float32", "num_speculative_tokens": k}
    sync_llm, llm = LLM(**kw, async_scheduling=False), LLM(**kw, async_verify=True)
    ref = greedy(sync_llm)
    assert greedy(llm) == ref
    sp = [SamplingParams(**d) for d in _stopping_params(ref)]
    before = (sync_llm.engine.stats.accepted, llm.engine.stats.accepted)
    sync, fast = sync_llm.generate(PROMPTS, sp), llm.generate(PROMPTS, sp)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in fast] == [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in sync]
    assert llm.engine.stats.async_steps > 0 and llm.engine.greedy.inflight is None
    # the drafts fed from the device are the ones the synchronous engine verified
    assert llm.engine.stats.accepted - before[1] == sync_llm.engine.stats.accepted - before[0]


@needs_2_gpus
@pytest.mark.parametrize("k", [0, 2])
def test_dp2_async_scheduling_on_two_gpus_equals_dp1(ray_cluster, k):
    """dp = 2 with async scheduling (k = 0, the default; k = 2 with async verify) equals a synchronous dp = 1
    engine, fp32."""
    from mtp_ray.rl.engine import launch_engine
    from tests.helpers import settled_stats

    sync = LLM(device="cuda", dtype="float32", num_speculative_tokens=k, async_scheduling=False)
    ref = greedy(sync)
    sp = _stopping_params(ref)
    want = [o.outputs[0].token_ids for o in sync.generate(PROMPTS, [SamplingParams(**d) for d in sp])]
    h = launch_engine({"device": "cuda", "dtype": "float32", "spec": {"num_speculative_tokens": k},
                       "scheduler": {"async_verify": True},
                       "parallel": {"dp": 2, "placement_strategy": "STRICT_PACK"}})
    try:
        res = ray_cluster.get(h.generate.remote(PROMPTS, {"temperature": 0, "max_tokens": 32, "ignore_eos": True}))
        assert [r["token_ids"] for r in res] == ref
        refs = [h.generate.remote(p, d) for p, d in zip(PROMPTS, sp, strict=True)]  # in flight together
        assert [r["token_ids"] for r in ray_cluster.get(refs)] == want
        st = settled_stats(h)
        assert len({r["collectives"] for r in st["ranks"]}) == 1
        assert all(r["async_steps"] > 0 for r in st["ranks"])
    finally:
        ray_cluster.get(h.shutdown.remote())


@needs_gpu
def test_constrained_and_plain_rows_in_graph_steps_on_the_gpu():
    """Grammar-constrained greedy rows (masks applied on the device) next to plain greedy rows in the same graph
    steps: the same tokens at k = 0 and k = 3, the plain rows as when alone, the JSON valid; prompt log-probs on the
    GPU equal the CPU's (fp32)."""
    import json

    from mtp_ray.engine.sampling_params import StructuredOutputs

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "s": {"type": "string", "maxLength": 6}}, "required": ["n", "s"]}
    cons = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(json=schema)),
            SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(regex=r"[a-z]{3}\d+")),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=[300, 301, 302])]
    outs = {}
    for k in (0, 3):
        llm = LLM(device="cuda", dtype="float32", num_speculative_tokens=k)
        res = llm.generate(PROMPTS, cons)
        outs[k] = [o.outputs[0].token_ids for o in res]
        json.loads(res[0].outputs[0].text)
        assert set(outs[k][3]) <= {300, 301, 302}
        alone = llm.generate(PROMPTS[2], cons[2])[0].outputs[0].token_ids
        assert outs[k][2] == alone
    assert outs[0] == outs[3]
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    gpu = LLM(device="cuda", dtype="float32").generate(PROMPTS[1], sp)[0].prompt_logprobs
    cpu = LLM(device="cpu", dtype="float32").generate(PROMPTS[1], sp)[0].prompt_logprobs
    for g, c, t in zip(gpu[1:], cpu[1:], PROMPTS[1][1:], strict=True):
        assert abs(g[t].logprob - c[t].logprob) < 1e-3


@needs_gpu
def test_warmup_leaves_nothing_to_compile_for_the_first_requests(tmp_path):
    """A fresh engine (own process, empty Triton cache) meets no Triton compile after its warmup under requests
    arriving as a server sees them (bench/cold_compiles.py: single prompts of every length residue, mixed steps,
    bursts, a prompt longer than a chunk, greedy and sampled); a failure names each kernel and its specialization."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "cold.json"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    subprocess.run([sys.executable, str(root / "bench/cold_compiles.py"), "--k", "0", "--out", str(out)],
                   check=True, env=env, cwd=root, timeout=540, capture_output=True)
    res = json.loads(out.read_text())
    assert res["compiles_in_warmup"] > 0  # the hook saw the warmup's compiles: a silent hook cannot pass this
    assert res["compiles_after_warmup"] == 0, json.dumps(res["after_warmup"], indent=1)[:4000]


@needs_gpu
@pytest.mark.parametrize("k", [0, 3])
def test_prefix_caching_on_the_gpu_equals_off(k):
    """Prefix caching with CUDA graphs and async scheduling, resuming from restored GDN snapshots (fp32: token
    identity is an fp32 claim, so GDN prefill takes the per-sequence path; fla's snapshots are checked in
    test_gdn_prefill.py): three rounds of shared-prefix prompts, greedy and seeded, equal with the cache on and
    off; the cache is used."""
    import random

    rng = random.Random(0)
    system = [rng.randrange(3, 2000) for _ in range(150)]
    prompts = [system + [rng.randrange(3, 2000) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    prompts += [system[:128], system[:129], list(range(300, 700))]
    kw = {"device": "cuda", "dtype": "float32", "num_speculative_tokens": k, "prefill_chunk": 96}
    for sp in (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
               SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True)):
        outs = []
        for on in (False, True):
            llm = LLM(enable_prefix_caching=on, **kw)
            outs.append([[o.outputs[0].token_ids for o in llm.generate(ps, sp)]
                         for ps in (prompts, prompts, prompts[::-1])])
            if on:
                assert llm.engine.blocks.prefix_stats()["prefix_cache_hits"] > 0
        assert outs[0] == outs[1]


@needs_gpu
def test_sleep_gives_back_the_device_memory_it_claims(ray_cluster):
    """sleep(1) and sleep(2) free every device byte they report (weights, caches, the graphs' pools, the fused
    projection buffers), measured in the rank (torch.cuda.memory_allocated / memory_reserved) and on the device
    (mem_get_info); wake_up takes it back and serves the same tokens (k = 3, graphs)."""
    from mtp_ray.config.engine import BUNDLED_MODEL
    from mtp_ray.model.loader import checkpoint_tensors
    from mtp_ray.rl.engine import launch_engine

    h = launch_engine({"device": "cuda", "dtype": "bfloat16", "spec": {"num_speculative_tokens": 3}})
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    try:
        first = ray_cluster.get(h.generate.remote(PROMPTS, params))
        for level in (1, 2):
            awake = ray_cluster.get(h.get_stats.remote())["memory"][0]  # rank 0's ModelRunner.memory()
            asleep = ray_cluster.get(h.sleep.remote(level))[0]
            claimed = awake["weights_bytes"] + awake["cache_bytes"]
            assert asleep["weights_bytes"] == 0 and asleep["cache_bytes"] == 0
            freed = awake["device_allocated_bytes"] - asleep["device_allocated_bytes"]
            returned = asleep["device_free_bytes"] - awake["device_free_bytes"]
            released = awake["device_reserved_bytes"] - asleep["device_reserved_bytes"]  # not kept in torch's pool
            assert freed >= claimed and released >= claimed, (level, awake, asleep)
            assert returned >= 0.95 * claimed, (level, awake, asleep)
            if level == 2:
                ray_cluster.get(h.update_weights.remote([(n, read(None)) for n, _, read
                                                         in checkpoint_tensors(BUNDLED_MODEL)]))
            ray_cluster.get(h.wake_up.remote())
            again = ray_cluster.get(h.generate.remote(PROMPTS, params))
            assert [r["token_ids"] for r in again] == [r["token_ids"] for r in first]
    finally:
        ray_cluster.get(h.shutdown.remote())


@needs_gpu
def test_pdl_launches_equal_plain_launches():
    """Programmatic dependent launch (layers/triton/pdl.py) changes when a kernel starts, never what it computes:
    bf16 with MTP k = 3, graphs and eager prefill, token for token the same with PDL off."""
    from mtp_ray.layers.triton import pdl

    if torch.cuda.get_device_capability()[0] >= 9:
        assert pdl.launch_args(torch.device("cuda"))["PDL"], "Hopper, but this Triton cannot launch with PDL"
    pdl.set_enabled(False)
    try:
        off = greedy(LLM(device="cuda", dtype="bfloat16", num_speculative_tokens=3), 48)
    finally:
        pdl.set_enabled(None)
    assert greedy(LLM(device="cuda", dtype="bfloat16", num_speculative_tokens=3), 48) == off
