"""Decode step time on a random-weight model with the Qwen3.5-35B-A3B layer shapes, next to the memory roofline.

    python bench/decode.py [--layers 40] [--batches 1 8 64 256] [--context 1024] [--out bench/results/decode.json]

Shapes (the public Qwen3.5-35B-A3B config): hidden 2048, 40 layers (3 Gated DeltaNet : 1 gated attention), 16 query /
2 KV heads of 256, GDN 16 key / 32 value heads of 128, 256 experts (top 8) of 512, a 512 shared expert, vocab 248320.
bf16 weights, one GPU, no MTP. Each sequence has `context` tokens in its KV cache. A step is the target forward
of B sequences x 1 token plus the lm_head, timed as a CUDA graph replay (median of 20) and eagerly (median of 5).
With --mtp-k k (default 3) the model also has its MTP layer, and the MTP step (the target verify of B x (k + 1)
tokens + the k-step greedy draft loop, both graphs) is timed next to the plain step: plain / MTP step is the bound
on (MTP speedup / mean acceptance length) from device time alone. The kernels of the batch-1 step are listed.

Roofline: the bytes a step must move at least (every dense weight once, the routed experts actually selected,
the embedding rows, KV read for every context token, GDN state read and written, fp32 logits written) over the
device bandwidth measured in the same run (device-to-device copy, bytes read + written).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mtp_ray.config.model import ModelConfig
from mtp_ray.engine.cache import CacheShape, bind_caches
from mtp_ray.engine.graphs import CudaGraphs
from mtp_ray.engine.inputs import StepInputs, uniform_layout
from mtp_ray.layers.context import ForwardBatch, UniformDecode
from mtp_ray.layers.linear import fuse_projections
from mtp_ray.layers.moe import SparseMoE
from mtp_ray.layers.rope import bind_rope_tables
from mtp_ray.model.loader import init_dummy_weights
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


def random_model(cfg: ModelConfig, device: torch.device) -> Qwen3_5MoeForCausalLM:
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0)
    model = model.to(torch.bfloat16).to_empty(device=device).eval()  # bf16 on meta first: no fp32 copy on the GPU
    init_dummy_weights(model, seed=0)
    return model


def bandwidth(device: torch.device) -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write), median of 10."""
    a = torch.empty(1 << 30, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() * 4 / sorted(times[2:])[len(times[2:]) // 2]


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


def step_bytes(model: Qwen3_5MoeForCausalLM, cfg: ModelConfig, bsz: int, context: int, experts_hit: list[int]
               ) -> dict:
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    dense = sum(p.numel() * 2 for n, p in model.named_parameters()  # the target step reads no MTP weight
                if "experts." not in n and "embed_tokens" not in n and not n.startswith("mtp."))
    n_attn, n_gdn = len(cfg.full_attention_layers), cfg.num_hidden_layers - len(cfg.full_attention_layers)
    kv = n_attn * bsz * (context + 1) * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    state = n_gdn * bsz * 2 * (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
                               + cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * 2)
    parts = {"dense_weights": dense, "routed_experts": sum(experts_hit) * expert_bytes,
             "embedding_rows": bsz * cfg.hidden_size * 2, "kv_read": kv, "gdn_state_rw": state,
             "logits_written": bsz * cfg.vocab_size * 4}
    parts["total"] = sum(parts.values())
    return parts


def count_experts(model: Qwen3_5MoeForCausalLM, moes: list[SparseMoE], inp: StepInputs) -> list[int]:
    """Distinct experts each MoE layer routes this step's tokens to (one eager forward, routers wrapped)."""
    hits: list[int] = []
    for m in moes:
        def counted(x, route=m.route):
            ids, w = route(x)
            hits.append(int(ids.unique().numel()))
            return ids, w
        m.route = counted
    try:
        model(inp.input_ids, inp.positions, inp.batch)
    finally:
        for m in moes:
            del m.route  # back to the class method
    return hits


def mtp_step(model: Qwen3_5MoeForCausalLM, bsz: int, context: int, width: int, k: int, vocab: int, plain: float,
             dev: torch.device) -> dict:
    """Graph replays of one MTP step: verify of B x (k + 1) tokens, then the k-step greedy draft loop."""
    graphs = CudaGraphs(model, (bsz,), k, width, BLOCK, dev)
    inp = inputs(bsz, context, width, vocab, dev, q=k + 1)
    with torch.inference_mode():
        graphs.run_target(inp, bsz)
        next_ids = torch.randint(0, vocab, (bsz * (k + 1),), device=dev)
        graphs.run_drafts(next_ids, torch.full((bsz,), k, device=dev), bsz)
        verify = timed(graphs.target[bsz][0].replay, 20)
        drafts = timed(graphs.draft[bsz][0].replay, 20)
        both = timed(lambda: (graphs.target[bsz][0].replay(), graphs.draft[bsz][0].replay()), 20)
    return {"k": k, "verify_ms": round(verify * 1e3, 3), "draft_loop_ms": round(drafts * 1e3, 3),
            "mtp_step_ms": round(both * 1e3, 3), "plain_step_ms": round(plain * 1e3, 3),
            "speedup_over_acceptance_bound": round(plain / both, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--mtp-k", type=int, default=3)
    ap.add_argument("--mtp-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default="bench/results/decode.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = bandwidth(dev)
    k = args.mtp_k
    cfg = config(args.layers, mtp=k > 0)
    model = random_model(cfg, dev)
    width = (args.context + 2 * k + BLOCK) // BLOCK + 1
    max_b = max(args.batches + args.mtp_batches)
    slots = 1 + max(args.batches) + max(args.mtp_batches) * (k + 1)  # main slots + MTP verify snapshots
    bind_caches(model, CacheShape(1 + max_b * width, BLOCK, slots), torch.bfloat16, dev)
    bind_rope_tables(model, width * BLOCK, torch.bfloat16, dev)  # as the engine does
    fuse_projections(model)
    for gdn in model.gdn_layers():
        gdn.ssm_state.normal_(0, 0.1)
    for attn in model.attention_layers():
        attn.kv_cache.normal_()
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    rows = []
    for bsz in args.batches:
        inp = inputs(bsz, args.context, width, cfg.vocab_size, dev)
        graphs = CudaGraphs(model, (bsz,), 0, width, BLOCK, dev)
        with torch.inference_mode():
            experts_hit = count_experts(model, moes, inp)
            eager = timed(lambda inp=inp: model.compute_logits(model(inp.input_ids, inp.positions, inp.batch)), 5)
            graphs.run_target(inp, bsz)
            g = graphs.target[bsz][0]
            graph = timed(g.replay, 20)
            kernels = kernel_table(g.replay) if bsz == 1 else None
        by = step_bytes(model, cfg, bsz, args.context, experts_hit)
        floor = by["total"] / bw
        rows.append({"batch": bsz, "graph_step_ms": round(graph * 1e3, 3), "eager_step_ms": round(eager * 1e3, 3),
                     "roofline_ms": round(floor * 1e3, 3), "graph_over_roofline": round(graph / floor, 2),
                     "achieved_GBps": round(by["total"] / graph / 1e9, 1), "tokens_per_s": round(bsz / graph, 1),
                     "mean_experts_hit_per_layer": round(sum(experts_hit) / len(experts_hit), 1),
                     "bytes": dict(by)})
        if kernels is not None:
            rows[-1]["kernels"] = kernels
        if k and bsz in args.mtp_batches:
            rows[-1]["mtp"] = mtp_step(model, bsz, args.context, width, k, cfg.vocab_size, graph, dev)
        del graphs
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "measured_bandwidth_GBps": round(bw / 1e9, 1),
              "model": f"random bf16, Qwen3.5-35B-A3B shapes, {args.layers} layers (of 40)"
                       + (f", MTP layer (k = {k})" if k else ", no MTP"),
              "context": args.context, "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"bandwidth {bw / 1e9:.0f} GB/s; {result['model']}; context {args.context}")
    print("| batch | graph step ms | eager step ms | roofline ms | graph / roofline | GB/s | tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['batch']} | {r['graph_step_ms']} | {r['eager_step_ms']} | {r['roofline_ms']} | "
              f"{r['graph_over_roofline']} | {r['achieved_GBps']} | {r['tokens_per_s']} |")
    for r in rows:
        if "mtp" in r:
            m = r["mtp"]
            print(f"MTP k={m['k']} batch {r['batch']}: verify {m['verify_ms']} ms + draft loop {m['draft_loop_ms']} ms "
                  f"= {m['mtp_step_ms']} ms vs plain {m['plain_step_ms']} ms -> speedup / acceptance length <= "
                  f"{m['speedup_over_acceptance_bound']}")
    top = [(x["kernel"][:40], x["count"], x["us"]) for x in rows[0].get("kernels", [])[:14]]
    print("batch-1 kernels (name, count, us):", *top, sep="\n  ")


if __name__ == "__main__":
    main()
