"""DP x EP engine group on real Ray actors with gloo: lock-step, waves, dummy forwards, faults."""

from __future__ import annotations

import random
import time

import pytest

from mtp_ray import LLM, SamplingParams
from mtp_ray.rl.engine import launch_engine
from tests.helpers import settled_stats

GREEDY = {"temperature": 0, "ignore_eos": True}
SCHED = {"prefill_chunk": 16, "max_num_batched_tokens": 64, "max_num_seqs": 16}


def cfg(dp: int, k: int, **extra) -> dict:
    # (warmup forwards: none of these tests is about the warmup's served workload, and a group starts faster)
    c = {"spec": {"num_speculative_tokens": k}, "parallel": {"dp": dp}, "scheduler": dict(SCHED),
         "cache": {"block_size": 8}, "timeouts": {"collective_s": 20, "progress_s": 30}, "warmup": "forwards"}
    for key, val in extra.items():
        c.setdefault(key, {}).update(val)
    return c


def reference(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    llm = LLM(max_num_seqs=64)
    return [o.outputs[0].token_ids
            for o in llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens])]


PROMPTS = [list(range(10, 10 + n)) for n in (5, 30, 12, 70, 3, 21, 44, 8)]
MAX_TOKENS = [16, 9, 24, 12, 30, 5, 18, 20]


@pytest.fixture(scope="module")
def ref():
    return reference(PROMPTS, MAX_TOKENS)


def run(handle, prompts, max_tokens):
    import ray

    refs = [handle.generate.remote(p, {"max_tokens": m, **GREEDY}) for p, m in zip(prompts, max_tokens)]
    return ray.get(refs, timeout=300)


def stats(handle) -> dict:
    import ray

    return ray.get(handle.get_stats.remote())


@pytest.fixture(scope="module")
def dp3_k3(ray_cluster):
    h = launch_engine(cfg(3, 3))
    yield h
    ray_cluster.get(h.shutdown.remote())


# Groups that several tests share, one alive at a time: pytest runs the tests of one parameter of this
# module-scoped fixture together (in file order) and shuts the group down before the next one starts. A test
# that fails a rank comes after those that count from a fresh group, and leaves the group restarted and serving.
SHARED = {
    # a reduced draft vocabulary changes no output: the dp = 2 / k = 3 outputs and counts hold with it
    "dp2_k3_draft_vocab": cfg(2, 3, spec={"draft_vocab_size": 256}),
    # exact draft gathers, and the timeouts the rank-kill test asserts
    "dp2_k2_exact": cfg(2, 2, parallel={"draft_gathers": True},
                        timeouts={"collective_s": 8, "progress_s": 15, "queue_s": 0.5}),
    "dp2_k2_split": cfg(2, 2, scheduler={"split_prefill": True}, timeouts={"collective_s": 10, "progress_s": 20}),
}


@pytest.fixture(scope="module")
def shared(ray_cluster, request):
    name = getattr(request, "param", None)
    if name is None:  # (a test case that launches its own)
        yield None
        return
    h = launch_engine(SHARED[name])
    yield h
    ray_cluster.get(h.shutdown.remote())


@pytest.mark.parametrize("dp,k,draft_gathers,shared", [
    (2, 0, False, None), (2, 3, False, "dp2_k3_draft_vocab"), (3, 0, False, None), (2, 2, True, "dp2_k2_exact")],
    indirect=["shared"], scope="module", ids=["2-0-False", "2-3-False", "3-0-False", "2-2-True"])
def test_dp_outputs_equal_dp1(ray_cluster, ref, dp, k, draft_gathers, shared):
    h = shared or launch_engine(cfg(dp, k, parallel={"draft_gathers": draft_gathers}))
    try:
        assert [r["token_ids"] for r in run(h, PROMPTS, MAX_TOKENS)] == ref
        st = settled_stats(h)
        assert st["health"]["restarts"] == 0
        assert len({r["collectives"] for r in st["ranks"]}) == 1  # every rank issued the same collectives
        assert len({r["forwards"] for r in st["ranks"]}) == 1
        for r in st["ranks"]:  # one DPMeta gather per step covers its k draft forwards, unless exact mode asks
            steps = r["forwards"] // (1 + k)
            assert r["gathers"] >= (r["forwards"] if draft_gathers else steps)
            assert draft_gathers or k == 0 or r["gathers"] < r["forwards"]
    finally:
        if shared is None:
            ray_cluster.get(h.shutdown.remote())


@pytest.mark.parametrize("shared", ["dp2_k3_draft_vocab"], indirect=True, scope="module")
def test_dp2_mtp_with_a_reduced_draft_vocabulary_equals_dp1(ray_cluster, ref, shared):
    """spec.draft_vocab_size in a DP group (set from the engine config on every rank): same tokens as dp = 1, every
    rank the same collectives."""
    h = shared
    assert [r["token_ids"] for r in run(h, PROMPTS, MAX_TOKENS)] == ref
    st = settled_stats(h)
    assert st["health"]["restarts"] == 0 and len({r["collectives"] for r in st["ranks"]}) == 1


def test_dp2_mtp3_near_max_model_len_finishes_and_equals_dp1(ray_cluster):
    """Requests that run into max_model_len on one rank while the other rank keeps drafting (vllm #44185: a rank
    that skipped its draft forwards near the limit left its peer alone in the MoE exchange, and the group hung).
    Here every rank runs all k draft forwards (dummies where it has nothing to draft), the requests end with
    "length" at the limit, and the tokens equal dp = 1's."""
    import ray

    limit = 48
    prompts = [list(range(10, 10 + n)) for n in (40, 3, 44, 6, 30)]
    want = [o.outputs[0].token_ids for o in LLM(max_model_len=limit, num_speculative_tokens=3).generate(
        prompts, SamplingParams(max_tokens=100, **GREEDY))]
    assert all(len(p) + len(w) == limit for p, w in zip(prompts, want))  # every one ran into the limit
    h = launch_engine(cfg(2, 3, scheduler={"max_model_len": limit}))
    try:
        res = ray.get([h.generate.remote(p, {"max_tokens": 100, **GREEDY}) for p in prompts], timeout=120)
        assert [r["token_ids"] for r in res] == want
        assert all(r["stop_reason"] == "length" for r in res)
    finally:
        ray.get(h.shutdown.remote())


def test_dp2_seeded_mtp_samples_under_preemption_equal_dp1(ray_cluster):
    """Ranks whose KV cache runs out preempt and recompute at their own points; a preempted request verifies the
    drafts it held after the recompute, so seeded samples at k = 3 equal dp = 1 with room to spare (get_stats
    counts each rank's preemptions)."""
    import ray

    prompts = [[100 + 7 * i + j for j in range(30)] for i in range(8)]
    params = [{"temperature": 1.0, "seed": 5 + i, "max_tokens": 24, "ignore_eos": True} for i in range(8)]
    want = [o.outputs[0].token_ids for o in LLM(num_speculative_tokens=3, max_model_len=64).generate(
        prompts, [SamplingParams(**p) for p in params])]
    h = launch_engine(cfg(2, 3, scheduler={"max_model_len": 64}, cache={"num_blocks": 20, "prefix_caching": False}))
    try:
        res = ray.get([h.generate.remote(pr, p) for pr, p in zip(prompts, params)], timeout=300)
        assert [r["token_ids"] for r in res] == want
        assert all(r["num_preemptions"] > 0 for r in stats(h)["ranks"])
    finally:
        ray.get(h.shutdown.remote())


def test_group_of_one_computes_experts_in_place(ray_cluster, ref):
    """A dp = 1 group owns every expert: same tokens as the plain engine and no EP exchange with itself."""
    h = launch_engine(cfg(1, 2))
    try:
        assert [r["token_ids"] for r in run(h, PROMPTS, MAX_TOKENS)] == ref
        (rank,) = stats(h)["ranks"]
        assert rank["forwards"] > 0 and rank["collectives"] == 0
    finally:
        ray_cluster.get(h.shutdown.remote())


def test_dp3_mtp3_outputs_equal_dp1(dp3_k3, ref):
    assert [r["token_ids"] for r in run(dp3_k3, PROMPTS, MAX_TOKENS)] == ref


def test_single_request_runs_dummy_forwards_on_idle_ranks(dp3_k3):
    before = {r["rank"]: r for r in stats(dp3_k3)["ranks"]}
    out = run(dp3_k3, [PROMPTS[1]], [12])[0]
    assert out["token_ids"] == reference([PROMPTS[1]], [12])[0]
    after = {r["rank"]: r for r in stats(dp3_k3)["ranks"]}
    dummies = sorted(after[r]["dummy_forwards"] - before[r]["dummy_forwards"] for r in after)
    steps = after[0]["forwards"] - before[0]["forwards"]
    # the two idle ranks ran a dummy for every forward (target and drafts) of the serving rank; the serving
    # rank itself only for draft steps with nothing to draft (after a non-last chunk, after its last token)
    assert dummies[1] == dummies[2] == steps > 0
    assert dummies[0] < steps


def test_stats_split_each_ranks_steps_into_host_phases_and_stalls(dp3_k3):
    """get_stats, per rank: host time per phase of its steps (PhaseClock: the laps split each step's wall time), its
    stalls (GC pauses, Triton compiles: none on the CPU) and when its latest request arrived."""
    before = {r["rank"]: r for r in stats(dp3_k3)["ranks"]}
    t0 = time.monotonic()
    run(dp3_k3, PROMPTS[:3], [6, 6, 6])
    after = {r["rank"]: r for r in stats(dp3_k3)["ranks"]}
    for rank, a in after.items():
        b, e = before[rank]["phases"].get("eager", {}), a["phases"]["eager"]  # CPU: every step is eager
        d = {name: v - b.get(name, 0.0) for name, v in e.items()}
        assert d["steps"] > 0 and {"schedule", "gather", "inputs", "launch", "commit", "publish"} <= set(e)
        laps = sum(v for name, v in d.items() if name not in ("steps", "wall", "cpu", "inbox", "publish"))
        assert 0 < laps <= d["wall"] + 1e-6 and d["cpu"] > 0
        st = a["stalls"]
        assert st["gc_s"] >= 0 and sum(st["gc_collections"]) >= 0 and st["triton_compiles"] == 0
    assert max(a["last_add_monotonic"] for a in after.values()) >= t0


def test_rank_profiles_its_next_steps_through_the_worker_handle(dp3_k3):
    """An operator's view of where a rank's step time goes: cProfile of the engine thread over its next N steps."""
    import ray

    workers = ray.get(dp3_k3.worker_handles.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="steps must be > 0"):
        ray.get(workers[0].profile_steps.remote(0))
    refs = [w.profile_steps.remote(3, 60.0, rank == 1) for rank, w in enumerate(workers)]
    time.sleep(0.3)
    with pytest.raises(ray.exceptions.RayTaskError, match="already running"):
        ray.get(workers[0].profile_steps.remote(2))
    run(dp3_k3, PROMPTS[:2], [4, 4])
    for rank, prof in enumerate(ray.get(refs, timeout=60)):
        assert prof["rank"] == rank and set(prof) <= {"rank", "graph", "eager", "device"}
        assert sum(p["steps"] for k, p in prof.items() if k in ("graph", "eager")) == 3
        assert ("device" in prof) == (rank == 1)  # torch.profiler where asked: on the CPU its host ops
        assert rank != 1 or (prof["device"]["steps"] == 3 and prof["device"]["ops"])
        eager = prof["eager"]  # CPU: no graphs
        assert eager["step_ms"] > 0 and eager["functions"] and all(f["calls_per_step"] > 0 for f in eager["functions"])


def test_chunked_prefill_decode_and_idle_in_one_step(dp3_k3):
    """Rank 0 decodes (k = 3) while rank 1 prefills a 100-token prompt in 16-token chunks and rank 2 idles."""
    before = {r["rank"]: r for r in stats(dp3_k3)["ranks"]}
    prompts, mt = [PROMPTS[0], list(range(100, 200))], [60, 4]
    out = run(dp3_k3, prompts, mt)
    assert [o["token_ids"] for o in out] == reference(prompts, mt)
    after = {r["rank"]: r for r in stats(dp3_k3)["ranks"]}
    delta = {r: {k: after[r][k] - before[r][k] for k in ("chunk_steps", "mixed_steps", "decode_steps")}
             for r in after}
    assert max(d["chunk_steps"] for d in delta.values()) >= 4
    assert delta[0]["mixed_steps"] >= 4  # the table is the same on every rank
    assert stats(dp3_k3)["health"]["restarts"] == 0


@pytest.mark.slow
def test_stress_random_arrivals_and_wave_edge_bursts(ray_cluster, dp3_k3):
    stress(dp3_k3)


@pytest.mark.slow
@pytest.mark.parametrize("shared", ["dp2_k2_split"], indirect=True, scope="module")
def test_stress_with_split_prefill_steps(ray_cluster, shared):
    """The scheduling used with CUDA graphs (prefill and decode never in one step, turns agreed by the group) under
    the same random arrivals and wave-edge bursts: same tokens, lock-step kept, no mixed batch on any rank."""
    h = shared
    stress(h, n=150)
    ranks = stats(h)["ranks"]
    assert all(r["mixed_batch_steps"] == 0 and r["uniform_steps"] > 0 for r in ranks)
    # turns come from the gathered table, so uniform decode steps line up across ranks (graph-eligible)
    assert len({r["uniform_group_steps"] for r in ranks}) == 1 and ranks[0]["uniform_group_steps"] > 0


def stress(handle, n: int = 300) -> None:
    import ray

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    mts = [rng.randint(1, 24) for _ in range(n)]
    ref = reference(prompts, mts)
    pending, results = [], {}
    start = min(r["waves"] for r in ray.get(handle.get_stats.remote())["ranks"])  # a shared group has run before
    i, edges, ended = 0, 0, start
    while i < n:
        if rng.random() < 0.15 and pending:
            # let everything finish, then land a burst on the wave edge. A burst sent as the last result arrives may
            # reach the group before it agrees it is idle (the race this aims at), so only every other edge waits
            # until the wave has ended: those edges are certain, the others race.
            ray.wait(pending, num_returns=len(pending), timeout=300)
            edges += 1
            if edges % 2 == 0:
                ended = wait_for_wave_end(handle, ended)
            burst = rng.randint(5, 25)
        else:
            burst = 1
            time.sleep(rng.choice([0, 0, 0.002, 0.01, 0.03]))
        for _ in range(burst):
            if i < n:
                ref_i = handle.generate.remote(prompts[i], {"max_tokens": mts[i], **GREEDY})
                pending.append(ref_i)
                results[ref_i] = i
                i += 1
    outs = ray.get(pending, timeout=600)
    got = [None] * n
    for r, o in zip(pending, outs):
        got[results[r]] = o["token_ids"]
    assert got == ref
    st = settled_stats(handle)
    assert st["health"]["restarts"] == 0
    assert len({r["collectives"] for r in st["ranks"]}) == 1
    assert edges >= 2 and min(r["waves"] for r in st["ranks"]) - start >= edges // 2, (start, edges, st["ranks"])


def wait_for_wave_end(handle, seen: int, timeout: float = 30.0) -> int:
    """Poll until every rank has finished more than `seen` waves; returns the new count (the same on every rank)."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        waves = [r["waves"] for r in ray.get(handle.get_stats.remote())["ranks"]]
        if min(waves) > seen:
            return min(waves)
        assert time.monotonic() < deadline, f"no wave ended within {timeout} s of an idle group: {waves}"
        time.sleep(0.005)


@pytest.mark.slow
def test_burst_of_1000_short_requests(ray_cluster):
    h = launch_engine(cfg(2, 1, scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 256}))
    try:
        outs = run(h, [[5 + i % 50, 7, 9] for i in range(1000)], [3] * 1000)
        assert len(outs) == 1000 and all(len(o["token_ids"]) == 3 for o in outs)
        st = stats(h)
        assert st["health"]["restarts"] == 0 and st["health"]["healthy"]
        calls = st["health"]["add_calls"]  # a burst reaches each rank in a few add_many calls, not one per request
        assert all(c >= 1 for c in calls) and sum(calls) < 750, calls  # one call each: 1000
    finally:
        ray_cluster.get(h.shutdown.remote())


@pytest.mark.slow
@pytest.mark.parametrize("shared", ["dp2_k2_exact"], indirect=True, scope="module")
def test_killed_rank_fails_inflight_requests_and_group_restarts(ray_cluster, ref, shared):
    import ray

    h = shared
    restarts = ray.get(h.health.remote())["restarts"]
    workers = ray.get(h.worker_handles.remote())
    long = [h.generate.remote(list(range(10, 40)), {"max_tokens": 3000, **GREEDY}) for _ in range(4)]
    time.sleep(2.0)
    t0 = time.monotonic()
    ray.kill(workers[1])
    for r in long:
        with pytest.raises(ray.exceptions.RayTaskError, match="engine group failed"):
            ray.get(r, timeout=60)
    assert time.monotonic() - t0 < 30
    # while it restarts, a new request waits at most timeouts.queue_s, then fails with the cause
    t1 = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match=r"GroupUnavailable: the engine group is (re)?starting, "
                                                          r"not ready after 0.5s; last failure: rank [01] "):
        ray.get(h.generate.remote([5, 6, 7], {"max_tokens": 2, **GREEDY}), timeout=30)
    assert time.monotonic() - t1 < 3
    deadline = time.monotonic() + 120
    while not ray.get(h.health.remote())["healthy"] and time.monotonic() < deadline:
        time.sleep(0.5)
    health = ray.get(h.health.remote())
    assert health["healthy"] and health["restarts"] == restarts + 1
    assert "rank 1" in health["last_failure"]
    assert [r["token_ids"] for r in run(h, PROMPTS, MAX_TOKENS)] == ref


@pytest.mark.slow
def test_a_stopped_idle_rank_fails_the_group_within_the_collective_timeout(ray_cluster, ref):
    """A rank whose process stops while the group is idle (no request, so no collective times out): its unanswered
    poll fails the group within timeouts.collective_s and the group restarts and serves; it was noticed only when
    a request met it."""
    import os
    import signal

    import ray

    h = launch_engine(cfg(1, 1, timeouts={"collective_s": 3, "progress_s": 15}))
    pid = None
    try:
        worker = ray.get(h.worker_handles.remote())[0]
        pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while ray.get(h.health.remote())["state"] == "ready":
            assert time.monotonic() - t0 < 3 + 5, ray.get(h.health.remote())
            time.sleep(0.2)
        deadline = time.monotonic() + 120
        while not ray.get(h.health.remote())["healthy"]:
            assert time.monotonic() < deadline, ray.get(h.health.remote())
            time.sleep(0.5)
        health = ray.get(h.health.remote())
        assert health["restarts"] == 1 and "rank 0 did not answer the group's poll for 3s" in health["last_failure"]
        assert run(h, PROMPTS[:1], MAX_TOKENS[:1])[0]["token_ids"] == ref[0]
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # killed by the restart, as it should be
                pass
        ray.get(h.shutdown.remote())


@pytest.mark.slow
@pytest.mark.parametrize("shared", ["dp2_k2_split"], indirect=True, scope="module")
@pytest.mark.parametrize("level", [1, 2])
def test_a_rank_lost_while_asleep_restarts_asleep(ray_cluster, ref, level, shared):
    """A rank dies while the engine sleeps: the restarted ranks sleep again at the same level, so wake_up (after
    an update for level 2) works and requests held meanwhile are served; they hung when the group said asleep and
    its new ranks were not (wake_up refused: 'not asleep')."""
    import ray

    h = shared
    restarts = ray.get(h.health.remote())["restarts"]
    ray.get(h.sleep.remote(level))
    ray.kill(ray.get(h.worker_handles.remote())[0])
    deadline = time.monotonic() + 120
    while ray.get(h.health.remote())["restarts"] <= restarts or not ray.get(h.health.remote())["healthy"]:
        assert time.monotonic() < deadline, ray.get(h.health.remote())
        time.sleep(0.5)
    assert ray.get(h.health.remote())["sleeping"] == level
    mem = ray.get(h.get_stats.remote())["memory"]  # per rank: the restarted ranks hold what sleep frees
    assert all(m["asleep"] and m["cache_bytes"] == 0 for m in mem), mem
    assert all(m["weights_bytes"] == 0 for m in mem) == (level == 2), mem
    held = h.generate.remote(PROMPTS[0], {"max_tokens": MAX_TOKENS[0], **GREEDY})
    if level == 2:  # the weights are gone: the same ones again, as a trainer would send them
        from mtp_ray.config.engine import BUNDLED_MODEL
        from mtp_ray.model.loader import checkpoint_tensors

        ray.get(h.update_weights.remote([(n, read(None)) for n, _, read in checkpoint_tensors(BUNDLED_MODEL)]))
    ray.get(h.wake_up.remote(), timeout=120)
    assert ray.get(held, timeout=120)["token_ids"] == ref[0]


def test_injected_local_ep_decision_is_named_not_hung(ray_cluster):
    t0 = time.monotonic()
    with pytest.raises(Exception, match="rank 1 used|odd one out: rank 1"):
        launch_engine(cfg(3, 1, parallel={"inject_ep_flip_rank": 1}, timeouts={"collective_s": 10}))
    assert time.monotonic() - t0 < 60


def _settled_cpus(ray) -> float:
    """Available CPUs once the count held still for a second (an earlier test's group may still be going)."""
    last, deadline = ray.available_resources().get("CPU"), time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = ray.available_resources().get("CPU")
        if now == last:
            break
        last = now
    return last


def _cpus_return_to(ray, before: float) -> bool:
    deadline = time.monotonic() + 15  # the resource view catches up asynchronously
    while ray.available_resources().get("CPU") < before and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU") >= before


def test_failed_start_gives_back_its_ranks_resources(ray_cluster):
    """A group whose ranks fail at start (here a cache too small for one sequence) or whose placement group never
    becomes ready gives its bundles back; each failed launch used to keep dp CPUs (GPUs) reserved until the job
    ended, so the next launch on a full cluster waited for resources."""
    def ranks() -> set[str]:  # other tests' groups (module fixtures) may be alive beside this one
        return {a for a in ray_cluster.util.list_named_actors() if "mtp_ray_rank" in a}

    before, alive = _settled_cpus(ray_cluster), ranks()
    for _ in range(2):
        with pytest.raises(Exception, match="cache.num_blocks=3 cannot hold one sequence"):
            launch_engine(cfg(2, 0, cache={"num_blocks": 3}))
    assert _cpus_return_to(ray_cluster, before)
    with pytest.raises(Exception, match="placement group of 2 rank bundles .* was not ready after timeouts.start_s"):
        launch_engine(cfg(2, 0, parallel={"cpus_per_rank": 64}, timeouts={"start_s": 2}))
    assert _cpus_return_to(ray_cluster, before)
    assert ranks() == alive
    # more DP ranks than experts (EP shards them): named before any rank starts
    with pytest.raises(Exception, match="parallel.dp=9 exceeds the model's num_experts=8"):
        launch_engine(cfg(9, 0))
    assert _cpus_return_to(ray_cluster, before)


def test_command_queued_during_a_waves_last_step_still_runs():
    """A group command that arrives after the wave's last DPMeta was gathered (so the table shows no command and
    the wave ends) starts the next wave; it used to wait forever (seen as a rare hang of sleep / wake_up)."""
    import threading

    from mtp_ray.config.engine import EngineConfig
    from mtp_ray.parallel.context import free_port
    from mtp_ray.runtime.messages import AddRequest, GroupCommand
    from mtp_ray.runtime.worker import RankWorker

    w = RankWorker(EngineConfig.from_dict(cfg(1, 0)), 0, 1)
    w.init("127.0.0.1", free_port(), [None])
    try:
        step, result = w.core.step, {}

        def racing_step(next_cmd: int = 0):
            outs = step(next_cmd)  # this step's DPMeta is gathered: any command queued now is not in its table
            table = w.core.sync.step_table
            if table is not None and table.all_dummy and not table.any_unfinished and "started" not in result:
                result["started"] = True
                cmd = GroupCommand(1, "update_weights", ({},))
                t = threading.Thread(target=lambda: result.update(out=w.command(cmd)), daemon=True)
                t.start()
                while not w.cmds:
                    time.sleep(0.001)
            return outs

        w.core.step = racing_step
        w.add_many([AddRequest("r0", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2))])
        deadline = time.monotonic() + 30
        while "out" not in result and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "out" in result, f"the command never ran (wave {w.wave}, start_wanted {w.start_wanted})"
    finally:
        w.shutdown()
        w.ctx.shutdown()


def test_abort_that_overtakes_its_add_drops_the_request():
    """The rank actor runs calls on several threads in no set order, so a request cancelled while its add was in
    flight can have its abort run first. The add that follows is dropped (an aborted output goes out) rather than
    decoding to max_tokens with nobody reading; an abort of a live request still ends it."""
    import threading

    from mtp_ray.config.engine import EngineConfig
    from mtp_ray.parallel.context import free_port
    from mtp_ray.runtime.messages import AddRequest, unpack_step
    from mtp_ray.runtime.worker import RankWorker

    def finished(deadline: float) -> dict[str, str]:
        out: dict[str, str] = {}
        while time.monotonic() < deadline and len(out) < 2:
            for msg in w.poll(0.2)["msgs"]:
                out.update({o.request_id: o.finish_reason for o in unpack_step(msg)[1] if o.finished})
        return out

    def add(rid: str, ids: list[int]) -> None:
        w.add_many([AddRequest(rid, ids, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))])

    w = RankWorker(EngineConfig.from_dict(cfg(1, 0)), 0, 1)
    w.init("127.0.0.1", free_port(), [None])
    try:
        w.abort("early")
        add("early", [5, 6, 7])
        add("live", [8, 9, 10])
        while w.core.stats.steps < 3:
            time.sleep(0.01)
        w.abort("live")
        assert finished(time.monotonic() + 30) == {"early": "abort", "live": "abort"}
        assert w.aborts == {"received": 2, "unknown": 1} and not w.early_aborts
        assert w.core.stats.aborted == 1 and not w.core.has_unfinished()
    finally:
        w.shutdown()
        for t in threading.enumerate():  # the engine thread ends its wave and exits before the collectives go
            if t.name == "rank0-engine":
                t.join(30)
        w.ctx.shutdown()


def test_rendezvous_store_listens_on_the_given_address_only():
    """Rank 0's TCPStore is bound to the address the group rendezvous on (the node's IP), not every interface: bound
    to 127.0.0.2, it is not reachable at 127.0.0.1 (both loopback addresses on Linux)."""
    import socket

    import torch
    import torch.distributed as dist

    from mtp_ray.parallel.context import DistContext, free_port

    port = free_port()
    ctx = DistContext(0, 1, 4, torch.device("cpu"), 10.0)
    ctx.init("127.0.0.2", port)
    try:
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        dist.destroy_process_group()
