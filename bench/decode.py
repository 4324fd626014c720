"""Decode step time on a random-weight model with the Qwen3.5-35B-A3B layer shapes, next to the memory roofline.

    python bench/decode.py [--layers 40] [--batches 1 8 64 256] [--context 1024] [--fp8] [--out bench/results/x.json]
                           [--config path/to/config.json]

Shapes (the public Qwen3.5-35B-A3B config): hidden 2048, 40 layers (3 Gated DeltaNet : 1 gated attention), 16 query /
2 KV heads of 256, GDN 16 key / 32 value heads of 128, 256 experts (top 8) of 512, a 512 shared expert, vocab 248320.
bf16 weights, one GPU, no MTP. Each sequence has `context` tokens in its KV cache. A step is the target forward
of B sequences x 1 token plus the lm_head, timed as a CUDA graph replay (median of 20) and eagerly (median of 5).
With --mtp-k k (default 3) the model also has its MTP layer, and the MTP step (the target verify of B x (k + 1)
tokens + the k-step greedy draft loop, both graphs) is timed next to the plain step: plain / MTP step is the bound
on (MTP speedup / mean acceptance length) from device time alone. The kernels of the batch-1 step (or those of
--kernel-batches) are listed, from a capture without PDL (each kernel's own time).
With --pdl-ab / --pairs-ab each step is timed again, right after, as it ran before that switch (launches without
PDL; per-pair expert GEMVs up to one pair a local expert). With --fp8 the plain steps run again on the same shapes
with FP8-resident weights (Qwen's FP8 format: e4m3, 128 x 128 block scales, router / shared-expert gate / embedding /
lm_head left in bf16): FP8 step / bf16 step per batch.

With --config the shapes are that checkpoint config's (bench/serve.py times the model it serves this way: its
capacity figures) instead of the 35B-A3B ones; --layers is then ignored.

Roofline: the bytes a step must move at least (every dense weight once, the routed experts actually selected,
the embedding rows, KV read for every context token, GDN state read and written, fp32 logits written) over the
device bandwidth measured in the same run (device-to-device copy, bytes read + written).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

# bench/ is on the path (the script's own folder)
from oracle import oracle_rows, positions_needed
from roofline import bandwidth, draft_bytes, step_bytes

from mtp_ray.config.model import ModelConfig
from mtp_ray.engine.cache import CacheShape, bind_caches
from mtp_ray.engine.graphs import CudaGraphs
from mtp_ray.engine.inputs import StepInputs, uniform_layout
from mtp_ray.layers import moe
from mtp_ray.layers.context import ForwardBatch, UniformDecode
from mtp_ray.layers.linear import fuse_projections
from mtp_ray.layers.moe import SparseMoE
from mtp_ray.layers.rope import bind_rope_tables
from mtp_ray.model.dummy import init_dummy_weights
from mtp_ray.model.fp8 import Fp8Format, config_fp8, make_fp8
from mtp_ray.model.qwen3_5 import Qwen3_5MoeForCausalLM

BLOCK = 16


def hf_config(layers: int, mtp: bool = False) -> dict:
    """The Qwen3.5-35B-A3B text config (HF config.json form), cut to `layers` layers (3 GDN : 1 attention)."""
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": layers,
        "layer_types": [types[i % 4] for i in range(layers)], "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "partial_rotary_factor": 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "vocab_size": 248320,
        "max_position_embeddings": 262144, "mtp_num_hidden_layers": int(mtp), "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "eos_token_id": 0,
    }


def config(layers: int, mtp: bool = False) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_config(layers, mtp))


# Qwen's FP8 releases: e4m3 weights, 128 x 128 block scales; the router, the shared expert's gate, the embedding
# and the lm_head unquantized
FP8 = Fp8Format(block=(128, 128), not_convert=("lm_head", "embed_tokens", "mlp.gate.", "shared_expert_gate"))


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16, fp8: bool = False
                 ) -> Qwen3_5MoeForCausalLM:
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0)
    model = model.to(dtype)  # dtype on meta first: no fp32 copy on the GPU
    if fp8:
        make_fp8(model, FP8, config_fp8(FP8))
    model = model.to_empty(device=device).eval()
    init_dummy_weights(model, seed=0)
    return model


def plain_step(model: Qwen3_5MoeForCausalLM, cfg: ModelConfig, bsz: int, context: int, width: int,
               dev: torch.device, bw: float, kernels: bool) -> dict:
    """The plain decode step of bsz sequences: graph and eager times, roofline, experts hit (and the kernels)."""
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    inp = inputs(bsz, context, width, cfg.vocab_size, dev)
    graphs = CudaGraphs(model, (bsz,), 0, width, BLOCK, dev)
    with torch.inference_mode():
        experts_hit = count_experts(moes, lambda: model(inp.input_ids, inp.positions, inp.batch))
        eager = timed(lambda: model.compute_logits(model(inp.input_ids, inp.positions, inp.batch)), 5)
        graphs.run_target(inp, bsz)
        g = graphs.target[bsz][0]
        graph = timed(g.replay, 20)
        table = kernel_table_without_pdl(model, inp, bsz, width, dev)[0] if kernels else None
    by = step_bytes(model, cfg, bsz, context, experts_hit)
    floor = by["total"] / bw
    row = {"batch": bsz, "graph_step_ms": round(graph * 1e3, 3), "eager_step_ms": round(eager * 1e3, 3),
           "roofline_ms": round(floor * 1e3, 3), "graph_over_roofline": round(graph / floor, 2),
           "achieved_GBps": round(by["total"] / graph / 1e9, 1), "tokens_per_s": round(bsz / graph, 1),
           "mean_experts_hit_per_layer": round(sum(experts_hit) / len(experts_hit), 1), "bytes": dict(by)}
    if table is not None:
        row["kernels"] = table
    return row


def prepare(model: Qwen3_5MoeForCausalLM, max_b: int, width: int, slots: int, dtype: torch.dtype,
            dev: torch.device) -> None:
    """Caches for max_b sequences of `width` blocks and `slots` GDN state slots, filled with random context, as the
    engine binds them (rope tables, fused projections)."""
    bind_caches(model, CacheShape(1 + max_b * width, BLOCK, slots), dtype, dev)
    bind_rope_tables(model, width * BLOCK, dtype, dev)
    fuse_projections(model)
    for gdn in model.gdn_layers():
        gdn.ssm_state.normal_(0, 0.1)
    for attn in model.attention_layers():
        attn.kv_cache.normal_()


def inputs(bsz: int, context: int, width: int, vocab: int, device: torch.device, q: int = 1) -> StepInputs:
    """B sequences x q new tokens at positions context .. context + q - 1 (q > 1: an MTP verify with snapshots),
    packed in the graphs' input layout (the engine's build_uniform layout)."""
    lay = uniform_layout(bsz, q, width, spec=q > 1)
    packed = torch.zeros(lay.total, dtype=torch.long, device=device)
    v = lay.views(packed)
    v["tables"].copy_(1 + torch.arange(bsz * width, device=device).view(bsz, width))  # block 0 stays reserved
    v["ctx"].fill_(context)
    v["pos"].copy_((v["ctx"][:, None] + torch.arange(q, device=device)).reshape(-1))  # [B * q]
    pos = v["pos"]
    v["slots"].copy_(v["tables"].repeat_interleave(q, 0).gather(1, (pos // BLOCK)[:, None])[:, 0] * BLOCK
                     + pos % BLOCK)
    v["state"].copy_(1 + torch.arange(bsz, device=device))
    if q > 1:
        v["spec"].copy_(1 + bsz + torch.arange(bsz * q, device=device).view(bsz, q))
    v["ids"].copy_(torch.randint(0, vocab, (bsz * q,), device=device))
    u = UniformDecode(q, v["ctx"], v["state"], v["spec"] if q > 1 else None)
    return StepInputs(v["ids"], pos, ForwardBatch.decode(u, v["tables"], v["slots"]), [[b] for b in range(bsz)],
                      packed)


def kernel_table_without_pdl(model: Qwen3_5MoeForCausalLM, inp, bsz: int, width: int, dev: torch.device,
                             k: int = 0, next_ids: torch.Tensor | None = None) -> tuple[list, list | None]:
    """(the target step's kernels: plain, or the verify of k + 1 tokens; with k the draft loop's from next_ids)
    from a capture without PDL: with PDL a kernel starts early and its time includes the wait for the one before it
    (the steps' own times are taken with PDL, as served)."""
    from mtp_ray.layers.triton import pdl  # (Triton: GPU machines only)

    prev = pdl.set_enabled(False)
    try:
        graphs = CudaGraphs(model, (bsz,), k, width, BLOCK, dev)
        graphs.run_target(inp, bsz)
        target = kernel_table(graphs.target[bsz][0].replay)
        if not k:
            return target, None
        graphs.run_drafts(next_ids, torch.full((bsz,), k, device=dev), bsz)
        return target, kernel_table(graphs.draft[bsz][0].replay)
    finally:
        pdl.set_enabled(prev)


def kernel_table(fn, steps: int = 10) -> list[dict]:
    """The device kernels of `fn` (a graph replay): name, count and microseconds per call, heaviest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in p.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    ev.sort(key=lambda e: -e.self_device_time_total)
    return [{"kernel": e.key[:90], "count": round(e.count / steps, 1), "us": round(e.self_device_time_total / steps, 1)}
            for e in ev]


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    t = sorted(times[2:])
    return t[len(t) // 2]


def count_experts(moes: list[SparseMoE], forward) -> list[int]:
    """Distinct experts each call of a MoE layer in `moes` routes its tokens to during forward() (eager, routers
    wrapped)."""
    hits: list[int] = []
    for m in moes:
        def counted(x, route=m.route):
            ids, w = route(x)
            hits.append(int(ids.unique().numel()))
            return ids, w
        m.route = counted
    try:
        forward()
    finally:
        for m in moes:
            del m.route  # back to the class method
    return hits


def mtp_step(model: Qwen3_5MoeForCausalLM, cfg: ModelConfig, bsz: int, context: int, width: int, k: int,
             plain: float, bw: float, dev: torch.device, draft_vocab: int = 0) -> dict:
    """Graph replays of one MTP step: verify of B x (k + 1) tokens, then the k-step greedy draft loop (drafting
    from ids [0, draft_vocab), 0: all), each next to its roofline, and the two as the engine runs them (the fused
    graph: one launch)."""
    graphs = CudaGraphs(model, (bsz,), k, width, BLOCK, dev, draft_vocab=draft_vocab)
    inp = inputs(bsz, context, width, cfg.vocab_size, dev, q=k + 1)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    mtp_moes = [m for m in model.mtp.modules() if isinstance(m, SparseMoE)]
    with torch.inference_mode():
        verify_hit = count_experts(moes, lambda: model(inp.input_ids, inp.positions, inp.batch))
        graphs.run_target(inp, bsz)
        next_ids = torch.randint(0, cfg.vocab_size, (bsz * (k + 1),), device=dev)
        graphs.run_drafts(next_ids, torch.full((bsz,), k, device=dev), bsz)
        draft_hit = count_experts(mtp_moes, lambda: graphs._draft_fn(bsz, graphs.target[bsz][1],
                                                                      graphs.target[bsz][3]))
        verify = timed(graphs.target[bsz][0].replay, 20)
        drafts = timed(graphs.draft[bsz][0].replay, 20)
        both = timed(graphs.fused[bsz][0].replay, 20)  # the engine's plain-greedy MTP step: both in one launch
        kernels = (kernel_table_without_pdl(model, inp, bsz, width, dev, k, next_ids) if bsz == 1 and not draft_vocab
                   else None)
    vb = step_bytes(model, cfg, bsz, context, verify_hit, q=k + 1)
    db = draft_bytes(model, cfg, bsz, context, k, draft_hit, draft_vocab or cfg.vocab_size)
    return {"k": k, "draft_vocab": draft_vocab or cfg.vocab_size,
            "verify_ms": round(verify * 1e3, 3), "verify_roofline_ms": round(vb["total"] / bw * 1e3, 3),
            "verify_over_roofline": round(verify / (vb["total"] / bw), 2),
            "verify_experts_hit_per_layer": round(sum(verify_hit) / len(verify_hit), 1),
            "draft_loop_ms": round(drafts * 1e3, 3), "draft_roofline_ms": round(db["total"] / bw * 1e3, 3),
            "draft_over_roofline": round(drafts / (db["total"] / bw), 2),
            "mtp_step_ms": round(both * 1e3, 3), "plain_step_ms": round(plain * 1e3, 3),
            "speedup_over_acceptance_bound": round(plain / both, 3),
            "verify_bytes": vb, "draft_bytes": db,
            **({"verify_kernels": kernels[0], "draft_kernels": kernels[1]} if kernels else {})}


@contextlib.contextmanager
def switched_off(name: str) -> Iterator[None]:
    """Steps captured inside run as before a switch: "pdl" (every kernel launched without programmatic dependent
    launch), "pairs" (per-pair expert GEMVs up to one pair a local expert, as before PAIRS_PER_EXPERT), "tiles"
    (the skinny GEMMs' tiles before split-K)."""
    if name == "pdl":
        from mtp_ray.layers.triton import pdl  # (Triton: GPU machines only)

        prev = pdl.set_enabled(False)
        try:
            yield
        finally:
            pdl.set_enabled(prev)
        return
    if name == "tiles":
        from kernels import tiles_before_split  # (bench/kernels.py; Triton: GPU machines only)

        from mtp_ray.layers.triton import linear

        now = linear.tiles
        linear.tiles = tiles_before_split
        try:
            yield
        finally:
            linear.tiles = now
        return
    prev_share = moe.PAIRS_PER_EXPERT, moe.PAIRS_PER_EXPERT_FP8
    moe.PAIRS_PER_EXPERT = moe.PAIRS_PER_EXPERT_FP8 = 1.0
    try:
        yield
    finally:
        moe.PAIRS_PER_EXPERT, moe.PAIRS_PER_EXPERT_FP8 = prev_share


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--mtp-k", type=int, default=3)
    ap.add_argument("--mtp-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--oracle-accept", type=float, nargs="*", default=[1.0, 0.8, 0.6, 0.4, 0.0],
                    help="per-draft acceptance rates of the oracle-draft runs (bench/oracle.py); none: skip them")
    ap.add_argument("--oracle-steps", type=int, default=48)
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[0, 32768],
                    help="MTP draft vocabularies (spec.draft_vocab_size) to time side by side; 0: the whole one")
    ap.add_argument("--fp8", action="store_true", help="also time the plain steps with FP8-resident weights")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="also time each plain step with programmatic dependent launch off (layers/triton/pdl.py)")
    ap.add_argument("--pairs-ab", action="store_true",
                    help="also time each step with per-pair expert GEMVs up to one pair a local expert (the rule "
                         "before layers/moe.py PAIRS_PER_EXPERT)")
    ap.add_argument("--tiles-ab", action="store_true",
                    help="also time each step with the GEMV tiles before split-K (layers/triton/linear.py tiles)")
    ap.add_argument("--kernel-batches", type=int, nargs="*", default=[1], help="list these plain steps' kernels")
    ap.add_argument("--config", default=None, help="an HF config.json to take the shapes from (random weights)")
    ap.add_argument("--out", default="bench/results/decode.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode.py times CUDA graph replays: it needs a CUDA GPU")
    dev, cpu = torch.device("cuda"), torch.device("cpu")
    bw = bandwidth(dev)
    k = args.mtp_k
    if args.config:
        cfg = ModelConfig.from_hf_dict(json.loads(Path(args.config).read_text()))
        assert not k or cfg.mtp_num_hidden_layers > 0, f"--mtp-k {k}: {args.config} has no MTP layer"
    else:
        cfg = config(args.layers, mtp=k > 0)
    model = random_model(cfg, dev)
    width = (args.context + positions_needed(args.oracle_steps, k) + BLOCK) // BLOCK + 1  # room for the oracle runs
    max_b = max(args.batches + args.mtp_batches)
    slots = 1 + max(args.batches) + max(args.mtp_batches) * (k + 1)  # main slots + MTP verify snapshots
    prepare(model, max_b, width, slots, torch.bfloat16, dev)

    def steps(b: int) -> dict:  # a batch's plain step, and its verify and draft loop where MTP is timed (A/B)
        row = plain_step(model, cfg, b, args.context, width, dev, bw, kernels=b in args.kernel_batches)
        if k and b in args.mtp_batches:  # a switch may pay differently in the verify and the draft loop
            row["mtp"] = [mtp_step(model, cfg, b, args.context, width, k, row["graph_step_ms"] / 1e3, bw, dev, dv)
                          for dv in args.draft_vocab]
        return row

    rows = []
    for bsz in args.batches:
        rows.append(steps(bsz))
        for m, dv in zip(rows[-1].get("mtp", []) if args.oracle_accept else [], args.draft_vocab, strict=False):
            make = lambda ctx, q, b=bsz: inputs(b, ctx, width, cfg.vocab_size, cpu, q)  # noqa: E731
            with torch.inference_mode():
                m["oracle"] = oracle_rows(model, bsz, args.context, width, k, args.oracle_accept, args.oracle_steps,
                                          make, dev, BLOCK, dv)
        for name in [n for n, on in (("pdl", args.pdl_ab), ("pairs", args.pairs_ab), ("tiles", args.tiles_ab)) if on]:
            # the same steps captured as they ran before that switch, then as they run now once more: a later
            # capture of the very same step has timed up to 9 % slower in one run, so "on" is the mean of the
            # captures before and after "off"
            with switched_off(name):
                off = steps(bsz)
            again = steps(bsz)
            on = (rows[-1]["graph_step_ms"] + again["graph_step_ms"]) / 2
            rows[-1][f"{name}_off"] = {**off, "on_again": again, "on_over_off": round(on / off["graph_step_ms"], 3)}
        torch.cuda.empty_cache()
    if args.fp8:  # the same plain steps with FP8-resident weights, after the bf16 model is gone (memory)
        del model
        torch.cuda.empty_cache()
        model = random_model(cfg, dev, fp8=True)
        prepare(model, max_b, width, slots, torch.bfloat16, dev)
        for row in rows:
            f = plain_step(model, cfg, row["batch"], args.context, width, dev, bw,
                           kernels=row["batch"] in args.kernel_batches)
            row["fp8"] = {**f, "over_bf16": round(f["graph_step_ms"] / row["graph_step_ms"], 3)}
            torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "measured_bandwidth_GBps": round(bw / 1e9, 1),
              "model": (f"random bf16, the shapes of {args.config}" if args.config else
                        f"random bf16, Qwen3.5-35B-A3B shapes, {args.layers} layers (of 40)")
                       + (f", MTP layer (k = {k})" if k else ", no MTP"),
              "context": args.context, "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    report(result)


def report(result: dict) -> None:
    rows = result["runs"]
    print(f"bandwidth {result['measured_bandwidth_GBps']} GB/s; {result['model']}; context {result['context']}")
    print("| batch | graph step ms | eager step ms | roofline ms | graph / roofline | GB/s | tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['batch']} | {r['graph_step_ms']} | {r['eager_step_ms']} | {r['roofline_ms']} | "
              f"{r['graph_over_roofline']} | {r['achieved_GBps']} | {r['tokens_per_s']} |")
    for row, m in ((r, m) for r in rows for m in r.get("mtp", [])):
        print(f"MTP k={m['k']} batch {row['batch']}, draft vocab {m['draft_vocab']}: plain {m['plain_step_ms']} ms "
              f"(x{row['graph_over_roofline']} roofline); verify {m['verify_ms']} ms (x{m['verify_over_roofline']} "
              f"of {m['verify_roofline_ms']}); "
              f"draft loop {m['draft_loop_ms']} ms (x{m['draft_over_roofline']} of {m['draft_roofline_ms']}); "
              f"speedup / acceptance length <= {m['speedup_over_acceptance_bound']}")
        if "oracle" in m:
            o = m["oracle"]
            print(f"  oracle drafts, batch {row['batch']}: plain loop {o['plain']['tokens_per_s']} tok/s")
            for x in o["runs"]:
                print(f"    accept {x['accept']}: {x['tokens_per_s']} tok/s = x{x['over_plain']} plain; acceptance "
                      f"length {x['mean_acceptance_length']} (expected {x['expected_acceptance_length']}), "
                      f"agreement with the continuation {x['agreement']}")
    for r, name in ((r, n) for r in rows for n in ("pdl", "pairs", "tiles") if f"{n}_off" in r):
        o = r[f"{name}_off"]
        print(f"batch {r['batch']}: graph step with {name} {r['graph_step_ms']} / {o['on_again']['graph_step_ms']} ms "
              f"(before / after), without {o['graph_step_ms']} ms (x{o['on_over_off']}); without "
              f"x{o['graph_over_roofline']} the roofline")
        for on, on2, off in zip(r.get("mtp", []), o["on_again"].get("mtp", []), o.get("mtp", []), strict=False):
            print(f"  MTP verify, draft vocab {on['draft_vocab']}: with {name} {on['verify_ms']} / {on2['verify_ms']}"
                  f" ms (x{on['verify_over_roofline']} / x{on2['verify_over_roofline']} roofline), without "
                  f"{off['verify_ms']} ms (x{round((on['verify_ms'] + on2['verify_ms']) / 2 / off['verify_ms'], 3)});"
                  f" draft loop {on['draft_loop_ms']} / {on2['draft_loop_ms']} / {off['draft_loop_ms']} ms")
    for r in rows:
        if "fp8" in r:
            f = r["fp8"]
            print(f"FP8 batch {r['batch']}: graph step {f['graph_step_ms']} ms = x{f['over_bf16']} the bf16 step "
                  f"({r['graph_step_ms']} ms); x{f['graph_over_roofline']} its roofline ({f['roofline_ms']} ms)")
    parts = (("", None), ("no-PDL ", "pdl_off"), ("old-pairs ", "pairs_off"), ("old-tiles ", "tiles_off"),
             ("FP8 ", "fp8"))
    for name, step in ((f"{p}batch-{r['batch']}", r if key is None else r.get(key, {})) for r in rows
                       for p, key in parts):
        top = [(x["kernel"][:40], x["count"], x["us"]) for x in step.get("kernels", [])[:14]]
        if top:
            print(f"{name} kernels (name, count, us):", *top, sep="\n  ")


if __name__ == "__main__":
    main()
