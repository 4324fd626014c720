"""Prefix caching in the engine (CPU, fp32): outputs equal with the cache on and off, k = 0 and 3, dp = 1 and 2,
over shared prefixes that do and do not end on a block boundary and prefixes longer than a prefill chunk; the
cache is used (hits counted); a small cache evicts and leaks nothing; a weight update forgets cached prefixes."""

from __future__ import annotations

import random

import pytest

from mtp_ray import LLM, BeamSearchParams, SamplingParams
from tests.test_graph_steps import emulated_graphs, with_graphs  # noqa: F401 (a fixture)

BLOCK = 8
KW = {"block_size": BLOCK, "prefill_chunk": 24, "max_num_batched_tokens": 96, "max_num_seqs": 8}
OFF = {"enable_prefix_caching": False}  # on by default


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 2000) for _ in range(61)]  # longer than a prefill chunk, not block-aligned
    out = [system + [rng.randrange(3, 2000) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    out += [system[:32], system[:33], system[:31], system[:40] + [7] * 9]  # ends on / beside a block boundary
    out += [list(range(200, 300))] * 2  # the same prompt twice (n = 2)
    return out


def rounds(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    """The workload three times: the first fills the cache, the others hit it (in another order the last time)."""
    def gen(ps):
        return [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    first = gen(prompts)
    return [first, gen(prompts), gen(prompts[::-1])[::-1]]


def settled(llm: LLM) -> None:
    """Nothing held after the workload: every block free or cached, every state slot back."""
    b = llm.engine.blocks
    b.check([])
    assert b.num_free_blocks == b.num_blocks - 1
    assert len(b.free_slots) == llm.engine.runner.cache_shape.num_state_slots - 1 - llm.engine.runner.snapshot_slots


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_and_seeded_outputs_equal_with_the_cache_on_and_off(k):
    prompts = workload()
    for params in (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=12, ignore_eos=True)):
        off = rounds(LLM(num_speculative_tokens=k, **OFF, **KW), prompts, params)
        llm = LLM(num_speculative_tokens=k, enable_prefix_caching=True, prefix_snapshots=16, **KW)
        on = rounds(llm, prompts, params)
        assert on == off
        st = llm.engine.blocks.prefix_stats()
        # the 2nd and 3rd rounds find every prompt's full blocks but the last token's (the 1st finds a few)
        assert st["prefix_cache_hits"] > 0.5 * st["prefix_cache_queries"] > 0, st
        settled(llm)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_prefix_left_by_a_one_token_request_drafts_as_a_fresh_prefill(request, graphs):
    """A request that ends at its first token (max_tokens = 1: a cache warm-up, a scoring call) drafts nothing, but
    the blocks it names hold MTP KV too: a later request on that prefix must draft as after its own prefill. Equal
    outputs would not show it (a draft from unwritten KV costs acceptance, never tokens): the counts must match.
    graphs: the GPU step logic on the CPU (emulated graphs: the draft loop after an eager prefill as one replay)."""
    prompts = workload()[:5] + workload(1)[:3]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    if graphs:
        request.getfixturevalue("emulated_graphs")

    def second_requests(first: int) -> tuple[list, list, int]:
        llm = LLM(num_speculative_tokens=3, enable_prefix_caching=True, prefix_snapshots=16, **KW)
        llm = with_graphs(llm) if graphs else llm
        outs, counts = [], []
        for p in prompts:
            if first:
                llm.generate([p], SamplingParams(temperature=0, max_tokens=first))
            s0 = llm.engine.stats.snapshot()
            outs.append(llm.generate([p], params)[0].outputs[0].token_ids)
            s1 = llm.engine.stats.snapshot()
            counts.append((s1["drafted"] - s0["drafted"], s1["accepted"] - s0["accepted"]))
        settled(llm)
        assert bool(llm.engine.stats.draft_graphs_after_eager) == graphs  # the path under test was taken
        return outs, counts, llm.engine.blocks.prefix_stats()["prefix_cache_hits"]

    fresh, after_one, after_full = second_requests(0), second_requests(1), second_requests(16)
    assert after_one[2] >= after_full[2] > fresh[2]  # the second requests start from the first ones' blocks
    assert sum(a for _, a in fresh[1]) > 0.3 * sum(d for d, _ in fresh[1])
    assert after_one[:2] == after_full[:2] == fresh[:2]


@pytest.mark.parametrize("seeded", [False, True])
def test_a_small_cache_evicts_and_leaks_nothing(seeded):
    """Seeded: the two runs preempt at other points (the cache changes what fits), and a preempted request verifies
    the drafts it held after its recompute, so its seeded stream stays in step."""
    prompts = workload(1) * 2
    params = SamplingParams(temperature=0.9 if seeded else 0, seed=3, max_tokens=8, ignore_eos=True)
    small = dict(KW, num_blocks=48, max_model_len=200)  # a few sequences' worth: cached prefixes get evicted
    off_llm = LLM(num_speculative_tokens=3, **OFF, **small)
    off = rounds(off_llm, prompts, params)
    llm = LLM(num_speculative_tokens=3, enable_prefix_caching=True, **small)
    assert rounds(llm, prompts, params) == off
    st = llm.engine.blocks.prefix_stats()
    assert st["evictions"] > 0 and st["prefix_cache_hits"] > 0, st
    print("preemptions on / off:", llm.engine.scheduler.num_preemptions, off_llm.engine.scheduler.num_preemptions)
    settled(llm)


def test_prompt_logprobs_requests_do_not_take_cached_prefixes():
    llm = LLM(enable_prefix_caching=True, **KW)
    p = workload()[0]
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([p], plain)
    scored = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    want = LLM(**OFF, **KW).generate([p], scored)
    got = llm.generate([p], scored)
    assert got[0].prompt_logprobs == want[0].prompt_logprobs and len(got[0].prompt_logprobs) == len(p)


@pytest.mark.parametrize("k", [0, 3])
def test_dp2_group_with_the_cache_equals_dp1_without_and_forgets_it_on_new_weights(ray_cluster, k):
    from mtp_ray.rl.engine import launch_engine

    prompts = workload(2)
    greedy = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}

    def group(caching: bool):
        return launch_engine({"spec": {"num_speculative_tokens": k}, "parallel": {"dp": 2},
                              "cache": {"block_size": BLOCK, "prefix_caching": caching},
                              "scheduler": {"prefill_chunk": 24, "max_num_batched_tokens": 96, "max_num_seqs": 8},
                              "timeouts": {"collective_s": 20, "progress_s": 30}, "warmup": "forwards"})

    def run(h) -> list[list[int]]:
        return [r["token_ids"] for r in ray_cluster.get([h.generate.remote(p, greedy) for p in prompts], timeout=300)]

    # a layer-0 weight: every KV and GDN state after it changes, so a stale cached prefix would change the output
    name = "model.layers.0.input_layernorm.weight"
    on, off = group(True), group(False)
    try:
        ref = run(off)
        assert run(on) == ref and run(on) == ref
        stats = ray_cluster.get(on.get_stats.remote())["ranks"]
        assert sum(r["prefix_cache"]["prefix_cache_hits"] for r in stats) > 0
        w = dict(LLM(**KW).engine.runner.model.named_parameters())[name].detach() * 1.5
        for h in (on, off):
            ray_cluster.get(h.update_weights.remote([(name, w)]))
        new_ref = run(off)
        assert new_ref != ref  # the update matters
        assert run(on) == new_ref
        assert all(r["prefix_cache"]["named_blocks"] > 0 for r in ray_cluster.get(on.get_stats.remote())["ranks"])
    finally:
        for h in (on, off):
            ray_cluster.get(h.shutdown.remote())


@pytest.mark.parametrize("k", [0, 3])
def test_n_samples_of_one_prompt_share_its_prefill(k):
    """n = 4 samples arrive together: three wait for the first to publish the prompt's blocks (a few steps) and
    resume from them, so the prompt is prefilled once (plus each sample's last partial block); outputs equal the
    uncached engine's, which prefills it four times."""
    prompt = workload()[0]  # 78 tokens: 9 full blocks before the last token
    params = SamplingParams(n=4, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    off = LLM(num_speculative_tokens=k, **OFF, **KW)
    llm = LLM(num_speculative_tokens=k, enable_prefix_caching=True, **KW)
    want = [o.token_ids for o in off.generate([prompt], params)[0].outputs]
    assert [o.token_ids for o in llm.generate([prompt], params)[0].outputs] == want
    st = llm.engine.blocks.prefix_stats()
    full = (len(prompt) - 1) // BLOCK * BLOCK
    assert st["requests_queried"] == 4 and st["prefix_cache_hits"] == 3 * full, st
    computed = llm.engine.stats.iteration_tokens_sum - off.engine.stats.iteration_tokens_sum
    assert computed == -3 * full  # the same decode steps; three prompts' full blocks never fed again
    settled(llm)


def test_server_reports_cached_tokens_and_counters(ray_cluster):
    """Through `serve run`'s app (the cache on, as by default) with vLLM's flags enable_prompt_tokens_details,
    enable_force_include_usage and max_logprobs -1: a repeated prompt reports usage.prompt_tokens_details
    .cached_tokens and streams the same completion; /metrics counts queries and hits; every stream chunk has the
    usage so far; a request's logprobs -1 gets the whole vocabulary."""
    import json
    from pathlib import Path

    import requests
    import yaml
    from ray import serve

    from mtp_ray.serve.app import build_app

    port = 8033
    spec = yaml.safe_load((Path(__file__).resolve().parent.parent / "deployments" / "qwen35_mtp.yaml").read_text())
    spec = spec["applications"][0]
    spec["args"]["group"] = {"num_replicas": 1}
    spec["args"]["engine"].setdefault("cache", {})["prefix_caching"] = True
    spec["args"]["server"].update(enable_prompt_tokens_details=True, enable_force_include_usage=True,  # vLLM's flags
                                  return_tokens_as_token_ids=True)
    spec["args"]["engine"]["max_logprobs"] = -1  # (vLLM's --max-logprobs -1: up to the whole vocabulary)
    spec["args"]["engine"]["warmup"] = "none"  # (CPU: a faster start; the warmup has tests of its own)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(spec["args"]), name="prefix", route_prefix="/")
    try:
        prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 3
        body = {"model": "tiny-qwen35-mtp", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        url = f"http://127.0.0.1:{port}"
        first = requests.post(f"{url}/v1/completions", json=body, timeout=120).json()
        second = requests.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        n_prompt = first["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < n_prompt and cached % 16 == 0, (cached, n_prompt)  # whole blocks, never the last token
        import time

        deadline = time.monotonic() + 20
        while True:  # the ranks' counters reach /metrics with the group's next poll of them
            lines = [ln for ln in requests.get(f"{url}/metrics", timeout=30).text.splitlines()
                     if ln.startswith("mtp_ray:prefix_cache_hits_total")]
            if sum(float(ln.rsplit(" ", 1)[1]) for ln in lines) == cached or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert sum(float(ln.rsplit(" ", 1)[1]) for ln in lines) == cached, lines
        # vLLM's cache_salt: a salted request shares cached prefixes only with the same salt
        def cached_with(salt: str) -> int:
            r = requests.post(f"{url}/v1/completions", json={**body, "cache_salt": salt}, timeout=120).json()
            assert r["choices"][0]["text"] == first["choices"][0]["text"]
            return r["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert [cached_with("tenant-a"), cached_with("tenant-a"), cached_with("tenant-b")] == [0, cached, 0]
        r = requests.post(f"{url}/v1/completions", json={**body, "cache_salt": ""}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        # enable_force_include_usage: a stream that asks for no usage has it in every chunk (so far), then a last
        # chunk with the whole usage, cached tokens included (as vLLM's final usage chunk)
        r = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "tiny-qwen35-mtp", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "min_tokens": 8, "temperature": 0, "stream": True})
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        assert len(events) > 2 and all("usage" in e for e in events), r.text
        counts = [e["usage"]["completion_tokens"] for e in events]
        assert counts == sorted(counts) and counts[-1] == 8 and not events[-1]["choices"], counts
        assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
                   for e in events)
        assert "prompt_tokens_details" in events[-1]["usage"] and "prompt_tokens_details" not in events[0]["usage"]
        # max_logprobs -1: a request's -1 gets every token's log-prob (the bundled vocabulary: 2048; as ids, the
        # server's return_tokens_as_token_ids, since several ids decode to the same string, which the legacy
        # format's keys would merge); a request may still ask for the strings
        r = requests.post(f"{url}/v1/completions", timeout=120, json={**body, "max_tokens": 2, "logprobs": -1}).json()
        assert [len(t) for t in r["choices"][0]["logprobs"]["top_logprobs"]] == [2048, 2048], r["usage"]
        assert all(t.startswith("token_id:") for t in r["choices"][0]["logprobs"]["tokens"])
        r = requests.post(f"{url}/v1/completions", timeout=120, json={
            **body, "max_tokens": 2, "logprobs": 0, "return_tokens_as_token_ids": False}).json()
        assert "".join(r["choices"][0]["logprobs"]["tokens"]) == r["choices"][0]["text"]
        r = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "tiny-qwen35-mtp", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": -1, "prompt_logprobs": -1}).json()
        assert [len(e["top_logprobs"]) for e in r["choices"][0]["logprobs"]["content"]] == [2048, 2048]
        assert r["prompt_logprobs"][0] is None and all(len(p) == 2048 for p in r["prompt_logprobs"][1:])
    finally:
        serve.delete("prefix")
        serve.shutdown()


@pytest.mark.parametrize("k", [0, 3])
def test_a_shared_system_prompt_is_snapshotted_where_prompts_diverge(k):
    """Prompts that share only a system prompt: the second one alone publishes a snapshot where it leaves the
    first one's cached blocks, so the third resumes there; sent together, the later ones wait for the first to
    reach the shared boundary and resume there too. Greedy outputs equal the uncached engine's."""
    rng = random.Random(7)
    system = [rng.randrange(3, 2000) for _ in range(45)]  # 5 full blocks of 8, then 5 more tokens

    def user() -> list[int]:
        return system + [rng.randrange(3, 2000) for _ in range(rng.randint(3, 30))]

    alone, together = [user() for _ in range(3)], [user() for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    off = LLM(num_speculative_tokens=k, **OFF, **KW)
    llm = LLM(num_speculative_tokens=k, enable_prefix_caching=True, **KW)
    ix = llm.engine.blocks.index
    hits = []
    for p in alone:
        before = ix.hit_tokens
        assert llm.generate([p], params)[0].outputs[0].token_ids == off.generate([p], params)[0].outputs[0].token_ids
        hits.append(ix.hit_tokens - before)
    assert hits == [0, 0, 40]  # the 2nd computed the system prompt again, but left a snapshot at its end
    llm.engine.invalidate_prefixes()
    before = ix.hit_tokens
    got = [o.outputs[0].token_ids for o in llm.generate(together, params)]
    assert got == [o.outputs[0].token_ids for o in off.generate(together, params)]
    assert ix.hit_tokens - before == 3 * 40
    settled(llm)


def test_cache_salt_keeps_tenants_prefixes_apart():
    """vLLM's cache_salt: a request takes cached blocks only from requests with the same salt (none: the unsalted
    ones); the output is the same whatever the salt."""
    llm = LLM(**KW)
    prompt = list(range(300, 341))

    def run(salt: str | None):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, cache_salt=salt))
        return out[0].outputs[0].token_ids, out[0].num_cached_tokens

    want, _ = run(None)
    assert [run(s) for s in ("a", "a", "b", None)] == [(want, 0), (want, 40), (want, 0), (want, 40)]
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="").validate()
    # vLLM's prompt dicts carry it too: {"prompt_token_ids": ..., "cache_salt": ...}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (c,) = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "c"}], greedy)
    assert (c.outputs[0].token_ids, c.num_cached_tokens) == (want, 0)
    (c,) = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "c"}], greedy)
    assert c.num_cached_tokens == 40
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": "c"}], SamplingParams(cache_salt="d"))
    hits = llm.engine.blocks.prefix_stats()["prefix_cache_hits"]
    llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "e"}], BeamSearchParams(beam_width=2, max_tokens=1))
    assert llm.engine.blocks.prefix_stats()["prefix_cache_hits"] == hits  # under a new salt: nothing to take
    settled(llm)


@pytest.mark.parametrize("k", [0, 3])
def test_a_miss_prefills_in_as_many_steps_as_without_the_cache(k):
    """A prompt nobody shared yet: its snapshot is taken inside its prefill piece, not by cutting the piece there
    (a miss would pay one more step: bench/prefix.py `unique`), and the same prompt then resumes from it."""
    kw = {**KW, "prefill_chunk": 96}
    prompt = list(range(300, 341))  # 41 tokens: its snapshot point (40) lies inside its one prefill piece
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    off, on = LLM(num_speculative_tokens=k, **OFF, **kw), LLM(num_speculative_tokens=k, **kw)
    want = off.generate([prompt], params)[0].outputs[0].token_ids
    assert on.generate([prompt], params)[0].outputs[0].token_ids == want
    assert on.engine.stats.steps == off.engine.stats.steps
    assert on.engine.blocks.prefix_stats()["snapshots"] == 1
    again = on.generate([prompt], params)[0]
    assert again.outputs[0].token_ids == want and again.num_cached_tokens == 40
    settled(on)


@pytest.mark.parametrize("k", [0, 3])
def test_a_step_never_writes_one_snapshot_slot_twice(monkeypatch, k):
    """More snapshot points in one step than the pool holds (a burst of new prompts, two points each, a pool of 2):
    the step takes what fits and skips the rest, never giving one slot to two snapshots of the same forward (the
    device could leave either); outputs still equal the uncached engine's."""
    import mtp_ray.engine.core as core_mod
    from mtp_ray.engine import prefix_steps

    seen: list[list[int]] = []

    def plan(sched, blocks):
        prefix_steps.plan_snapshots(sched, blocks)
        seen.append([slot for s in sched for _, slot in s.snapshots])

    monkeypatch.setattr(core_mod, "plan_snapshots", plan)
    rng = random.Random(5)
    system = [rng.randrange(3, 2000) for _ in range(20)]
    prompts = [system + [rng.randrange(3, 2000) for _ in range(30)] for _ in range(6)]  # points 16 and 48
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kw = {**KW, "prefill_chunk": 96, "max_num_batched_tokens": 512}
    want = rounds(LLM(num_speculative_tokens=k, **OFF, **kw), prompts, params)
    llm = LLM(num_speculative_tokens=k, prefix_snapshots=2, **kw)
    assert rounds(llm, prompts, params) == want
    assert max(map(len, seen)) == 2 and all(len(set(s)) == len(s) for s in seen), seen
    settled(llm)


def test_on_by_default_and_off_by_the_yaml_switch():
    """The default engine caches prefixes; `cache: {prefix_caching: false}` (the YAML form) turns it off: no snapshot
    slots, nothing looked up, no cached-token count reported."""
    from mtp_ray.config.engine import EngineConfig
    from mtp_ray.engine.core import EngineCore

    assert EngineConfig.from_dict({}).cache.prefix_caching
    core = EngineCore(EngineConfig.from_dict({"cache": {"block_size": BLOCK, "prefix_caching": False}}))
    assert not core.blocks.caching and core.runner.snapshot_slots == 0
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    on = LLM(**KW)
    for _ in range(2):
        assert on.generate([list(range(300, 341))], params)[0].num_cached_tokens is not None
    assert on.engine.blocks.prefix_stats()["prefix_cache_hits"] == 40
    core.add_request("a", list(range(300, 341)), params)
    core.add_request("b", list(range(300, 341)), params)
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert {o.num_cached_tokens for o in outs} == {None} and core.blocks.prefix_stats()["prefix_cache_queries"] == 0


def test_prefix_benchmark_runs_and_the_cache_saves_the_shared_prefill(tmp_path):
    """bench/prefix.py end to end, small (CPU): prefill tokens computed drop by at least the shared share, same
    outputs (no speed assertion)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "prefix.json"
    subprocess.run([sys.executable, str(root / "bench/prefix.py"), "--k", "0", "--conversations", "2", "--turns", "2",
                    "--samples", "3", "--answer", "8", "--out", str(out)], check=True, cwd=root, timeout=600,
                   capture_output=True)
    res = json.loads(out.read_text())["workloads"]
    for name, w in res.items():
        assert w["outputs_equal"] and w["drop_at_least_shared"], w
        assert (w["cache_on"]["shared"] > 0.3) == (name != "unique"), (name, w)


@pytest.mark.parametrize("layout", ["gqa6_int3", "mha_types"])
def test_other_layer_layouts_with_the_cache_on_equal_off(tmp_path, layout):
    """Random checkpoints of other layouts (attention / GDN interleaving, GQA ratios, tied embeddings), k = 3."""
    from tests.helpers import make_checkpoint

    make_checkpoint(tmp_path, layout, seed=3)
    rng = random.Random(4)
    system = [rng.randrange(3, 97) for _ in range(29)]
    prompts = [system + [rng.randrange(3, 97) for _ in range(rng.randint(1, 12))] for _ in range(5)] + [system[:24]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    off = rounds(LLM(str(tmp_path), num_speculative_tokens=3, **OFF, **KW), prompts, params)
    llm = LLM(str(tmp_path), num_speculative_tokens=3, enable_prefix_caching=True, **KW)
    assert rounds(llm, prompts, params) == off
    assert llm.engine.blocks.prefix_stats()["prefix_cache_hits"] > 0
    settled(llm)


def test_sleep_and_wake_up_forget_cached_prefixes(ray_cluster):
    """After sleep (caches freed) and wake_up (caches zeroed) a cached prefix would read zeros: it is forgotten, and
    the next request computes it again with the same result."""
    from mtp_ray.rl.engine import launch_engine

    p = workload(5)[0]
    greedy = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
    h = launch_engine({"spec": {"num_speculative_tokens": 3}, "cache": {"block_size": BLOCK, "prefix_caching": True},
                       "scheduler": {"prefill_chunk": 24, "max_num_batched_tokens": 96, "max_num_seqs": 8},
                       "warmup": "forwards"})
    try:
        first = ray_cluster.get(h.generate.remote(p, greedy))["token_ids"]
        assert ray_cluster.get(h.generate.remote(p, greedy))["token_ids"] == first

        def hits() -> int:
            return ray_cluster.get(h.get_stats.remote())["ranks"][0]["prefix_cache"]["prefix_cache_hits"]

        before = hits()
        assert before > 0
        for level in (1, 2):
            ray_cluster.get(h.sleep.remote(level))
            if level == 2:  # the weights come back through update_weights (the checkpoint's own)
                from mtp_ray.config.engine import BUNDLED_MODEL
                from mtp_ray.model.loader import checkpoint_tensors

                ray_cluster.get(h.update_weights.remote([(n, read(None)) for n, _, read
                                                         in checkpoint_tensors(BUNDLED_MODEL)]))
            ray_cluster.get(h.wake_up.remote())
            assert ray_cluster.get(h.generate.remote(p, greedy))["token_ids"] == first
            assert hits() == before  # recomputed, not taken from a forgotten cache
    finally:
        ray_cluster.get(h.shutdown.remote())


@pytest.mark.parametrize("k", [0, 3])
def test_cache_with_graph_steps_and_async_scheduling_equals_off(emulated_graphs, k):  # noqa: F811
    """The GPU step logic on the CPU (tests/test_graph_steps.py: graphs emulated by re-running, split prefill,
    device greedy, async scheduling and async verify): restored snapshots feed graph decode / verify steps."""
    prompts = workload(3)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    want = rounds(LLM(num_speculative_tokens=k, **OFF, **KW), prompts, params)
    llm = with_graphs(LLM(num_speculative_tokens=k, enable_prefix_caching=True, prefix_snapshots=16, **KW))
    assert rounds(llm, prompts, params) == want
    assert llm.engine.stats.device_greedy_steps > 0 and llm.engine.blocks.prefix_stats()["prefix_cache_hits"] > 0
    settled(llm)


@pytest.mark.parametrize("k", [0, 3])
def test_random_arrivals_and_aborts_in_a_small_cache(k):
    """The engine API under random arrivals of prompts sharing prefixes, aborts (publishers included, while others
    wait for them) in a small cache that must evict: no hang, every finished request's tokens equal the uncached
    engine's for its prompt, and the block / slot invariants hold at every step and come back at the end."""
    from mtp_ray.config.flat import engine_config
    from mtp_ray.engine.core import EngineCore

    rng = random.Random(11)
    stems = [[rng.randrange(3, 2000) for _ in range(rng.randint(8, 50))] for _ in range(4)]
    prompts = [rng.choice(stems) + [rng.randrange(3, 2000) for _ in range(rng.randint(0, 12))] for _ in range(40)]
    prompts += [prompts[3]] * 3 + [prompts[7]] * 2  # repeats (n > 1 style)
    mts = [rng.randint(1, 14) for _ in prompts]
    ref = LLM(num_speculative_tokens=k, **OFF, **KW).generate(
        prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in mts])
    want = [o.outputs[0].token_ids for o in ref]
    core = EngineCore(engine_config(num_speculative_tokens=k, enable_prefix_caching=True, prefix_snapshots=6,
                                    num_blocks=34, max_model_len=200, **KW))
    got: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    order = list(range(len(prompts)))
    live: set[int] = set()
    steps = 0
    while order or core.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 3])):
            if order:
                i = order.pop(0)
                core.add_request(str(i), prompts[i], SamplingParams(temperature=0, max_tokens=mts[i], ignore_eos=True))
                got[i], live = [], live | {i}
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            core.abort_request(str(victim))
            live.discard(victim)
            finished[victim] = "abort"
        for o in core.step():
            i = int(o.request_id)
            got[i] += o.new_token_ids
            if o.finished:
                finished[i] = o.finish_reason
                live.discard(i)
        core.blocks.check(core.scheduler.running + list(core.scheduler.waiting))
        steps += 1
        assert steps < 5000, "no progress"
    done = [i for i, r in finished.items() if r == "length"]
    assert len(done) > 30 and core.blocks.index.evictions > 0 and core.blocks.index.hit_tokens > 0
    assert all(got[i] == want[i] for i in done), [i for i in done if got[i] != want[i]]
    core.blocks.check([])
    assert core.blocks.num_free_blocks == core.blocks.num_blocks - 1
