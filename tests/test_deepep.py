"""The DeepEP EP backend: its protocol choice (pure functions of the gathered table), its use of the deep_ep API
on two gloo ranks against a CPU stand-in of that API (tests/fake_deep_ep.py), its errors through the public entry
point, and (GPU, deep_ep installed) a dp = 2 group on two GPUs."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from mtp_ray.parallel.dp_meta import EP_LOW_LATENCY, EP_NORMAL, DPMeta, Gathered, draft_tables
from tests.ep_ranks import rank_setup, run_ranks

LL = 6  # low-latency capacity (tokens per rank) in these tests


def table(tokens: list[int], decoding: bool, ll: int = LL) -> Gathered:
    return Gathered(tuple(DPMeta(num_tokens=n, batch_size=n, is_decoding=int(decoding), is_dummy=0, graph_ok=1)
                          for n in tokens), ll_max_tokens=ll)


def test_low_latency_only_for_global_decode_that_fits_the_buffers():
    assert table([3, 6], True).ep_mode == EP_LOW_LATENCY
    assert table([3, 7], True).ep_mode == EP_NORMAL  # one rank over the capacity: the whole group goes normal
    assert table([3, 2], False).ep_mode == EP_NORMAL
    assert table([300, 7], True, ll=0).ep_mode == EP_LOW_LATENCY  # torch backend: unbounded
    assert table([3, 6], True).pick_graph_size((4, 8)) == 8
    assert table([3, 7], True).pick_graph_size((4, 8)) == 0  # no graph without the low-latency exchange


def test_draft_forwards_keep_the_target_protocol():
    # a verify batch over the capacity takes the normal protocol; its one-token draft forwards would fit, but
    # rule 4 keeps them on the target's protocol
    target = Gathered(tuple(DPMeta(num_tokens=4 * b, batch_size=b, is_decoding=1, is_dummy=0) for b in (2, 3)),
                      ll_max_tokens=LL)
    assert target.ep_mode == EP_NORMAL
    first, later = draft_tables(target)
    assert first.ep_mode == later.ep_mode == EP_NORMAL and later.max_num_tokens <= LL
    target = Gathered(tuple(DPMeta(num_tokens=2 * b, batch_size=b, is_decoding=1, is_dummy=0) for b in (2, 3)),
                      ll_max_tokens=LL)
    assert all(t.ep_mode == EP_LOW_LATENCY for t in draft_tables(target))


# forwards every rank runs in turn: (tokens on rank 0, tokens on rank 1, decode?) and the protocol expected
STEPS = [((5, 7), False, EP_NORMAL), ((3, 4), True, EP_LOW_LATENCY), ((2, 6), True, EP_LOW_LATENCY),
         ((4, 1), False, EP_NORMAL), ((6, 6), True, EP_LOW_LATENCY), ((7, 2), True, EP_NORMAL)]


def _rank_main(rank: int, world: int, port: int, queue) -> None:
    from tests import fake_deep_ep

    sys.modules["deep_ep"] = fake_deep_ep
    try:
        from mtp_ray.parallel.ep.deepep import DeepEPDispatcher

        e, h, inter, k = 8, 16, 8, 3
        ctx, full, mine = rank_setup(rank, world, port, e, h, inter)
        disp = DeepEPDispatcher(ctx, h, LL)
        modes, errs = [], []
        for i, (tokens, decoding, _) in enumerate(STEPS):
            ctx.set_forward(table(list(tokens), decoding))
            gi = torch.Generator().manual_seed(100 * i + rank)
            t = tokens[rank]
            x = torch.randn(t, h, generator=gi)
            ids = torch.stack([torch.randperm(e, generator=gi)[:k] for _ in range(t)])
            w = torch.softmax(torch.randn(t, k, generator=gi), -1)
            with torch.no_grad():
                out, ref = disp(x, ids, w, mine), full(x, ids, w)
            modes.append(ctx.last_ep_mode)
            errs.append(float((out - ref).abs().max()))
            ctx.forward = None
        queue.put((rank, modes, errs, disp.cleanings, None))
        ctx.shutdown()
    except Exception as ex:  # reported to the test, which would otherwise wait for a rank that died
        queue.put((rank, None, None, None, repr(ex)))


def test_deepep_dispatcher_on_two_ranks_against_the_api_stand_in():
    """Every protocol the table picks gives each rank's tokens the output of all experts computed in one place;
    the low-latency buffer is cleaned exactly when the group comes from the normal protocol."""
    results = run_ranks(_rank_main, 2)
    expected = [m for _, _, m in STEPS]
    for rank, modes, errs, cleanings, err in results:
        assert err is None, f"rank {rank}: {err}"
        assert modes == expected
        assert max(errs) < 1e-5, errs
        assert cleanings == 2  # before steps 1 and 4: after a normal-protocol forward


def test_deepep_backend_refuses_what_it_cannot_run(monkeypatch):
    from types import SimpleNamespace

    from mtp_ray.parallel.ep import make_dispatcher
    from tests import fake_deep_ep

    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match=r"num_experts \(8\) divisible by parallel.dp \(3\)"):
        make_dispatcher("deepep", SimpleNamespace(num_experts=8, world=3, device=cuda), 16, torch.bfloat16, 4)
    with pytest.raises(ValueError, match="runs on CUDA in bfloat16 .got device cpu, dtype float32"):
        make_dispatcher("deepep", SimpleNamespace(num_experts=8, world=2, device=cpu), 16, torch.float32, 4)
    with pytest.raises(ValueError, match="ep_backend must be 'torch' or 'deepep'"):
        make_dispatcher("nccl", SimpleNamespace(num_experts=8, world=2, device=cpu), 16, torch.float32, 4)


def test_deepep_backend_errors_through_the_group(ray_cluster):
    """ep_backend deepep where it cannot run: a clear error from the group start, not a hang."""
    from mtp_ray.rl.engine import launch_engine

    cfg = {"parallel": {"dp": 2, "ep_backend": "deepep"}, "timeouts": {"collective_s": 20, "start_s": 120}}
    want = "not installed" if importlib.util.find_spec("deep_ep") is None else "runs on CUDA in bfloat16"
    with pytest.raises(Exception, match=want):
        launch_engine(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="deep_ep is not installed")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_deepep_dp2_on_two_gpus(ray_cluster, tmp_path):
    """A dp = 2 group over DeepEP (normal prefill, low-latency decode inside the CUDA graphs) at the Qwen3.5-35B-A3B
    layer shapes (DeepEP's kernels take hidden 2048; 4 layers, random weights) serves greedy requests through the
    actor handle. bf16, and DeepEP's combine sums in its own order, so tokens are compared loosely with dp = 1."""
    import json

    from mtp_ray.rl.engine import launch_engine

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "bench"))
    try:  # only while importing: bench/kernels.py would pass for transformers' `kernels` package
        from decode import hf_config
    finally:
        sys.path.pop(0)

    (tmp_path / "config.json").write_text(json.dumps(hf_config(4)))
    prompts = [list(range(10 + i, 40 + i)) for i in range(16)]
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    outs = {}
    for dp, backend in ((1, "torch"), (2, "deepep")):
        h = launch_engine({"model": str(tmp_path), "load_format": "dummy", "device": "cuda",
                           "scheduler": {"max_model_len": 256, "max_num_seqs": 16},
                           "parallel": {"dp": dp, "ep_backend": backend, "placement_strategy": "STRICT_PACK"}})
        try:
            outs[dp] = [o["token_ids"] for o in ray_cluster.get([h.generate.remote(p, params) for p in prompts])]
            if dp == 2:
                st = ray_cluster.get(h.get_stats.remote())
                assert st["health"]["restarts"] == 0
                assert all(r["graph_steps"] > 0 for r in st["ranks"])  # low-latency exchange inside the graphs
        finally:
            ray_cluster.get(h.shutdown.remote())
    assert all(len(o) == 24 for o in outs[2])
    same = sum(a[0] == b[0] for a, b in zip(outs[1], outs[2], strict=True))
    assert same >= 8, f"only {same} of 16 requests agree on their first token"
