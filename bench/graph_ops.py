"""The CUDA graphs' glue ops (engine/graph_ops) as Triton kernels vs as torch ops, side by side in one run (GPU):
per k, the device time of one target / draft-loop / fused graph replay at batch 1 (launch + run, synchronised) and
the host time of its launch alone, and batch-1 requests interleaved request by request (decode tok/s after the first
token, host wall per graph step, the host's wait for the device); the same tokens either way.

    python bench/graph_ops.py --out bench/results/graph_ops_h200.json [--prompts 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import mtp_ray.engine.graph_ops as ops
import mtp_ray.layers.triton.graph_ops as fused_ops
from mtp_ray import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402
from offline import make_llm, prompts, timed  # noqa: E402


def engines(n: int) -> dict[str, LLM]:
    """k = 0 / 3 engines with the glue ops fused or as torch ops (what a graph runs is fixed at its capture)."""
    fused = (fused_ops.feed_in_flight, fused_ops.greedy_block)
    out = {}
    try:
        for name, k, f in (("k0_torch", 0, False), ("k0_fused", 0, True), ("k3_torch", 3, False),
                           ("k3_fused", 3, True)):
            fused_ops.feed_in_flight, fused_ops.greedy_block = (
                fused if f else (ops.feed_in_flight_torch, ops.greedy_block_torch))
            out[name] = make_llm(k, n, "cuda", "bfloat16")
    finally:
        fused_ops.feed_in_flight, fused_ops.greedy_block = fused
    return out


def replay_us(graph: torch.cuda.CUDAGraph, launch_only: bool = False) -> float:
    """Median time of one replay: launch + run, synchronised (20 runs), or the host's replay call alone, the device
    then running on (launch_only, 200 runs)."""
    ts = []
    for _ in range(200 if launch_only else 20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        if not launch_only:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return round(1e6 * statistics.median(ts), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/graph_ops.json")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llms = engines(args.prompts)
    ps = prompts(next(iter(llms.values())).tokenizer, args.prompts)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    names = list(llms)
    dec = {n: [0, 0.0] for n in names}
    outs: dict[str, list[list[int]]] = {n: [] for n in names}
    st0 = {n: llms[n].engine.stats.snapshot() for n in names}
    for r in range(args.repeats):
        for i, p in enumerate(ps):
            for j in range(len(names)):  # every engine in turn, the order rotating
                n = names[(i + j + r) % len(names)]
                toks, t_first, t_all = timed(llms[n], f"{r}-{i}", p, sp)
                dec[n][0] += len(toks) - 1
                dec[n][1] += t_all - t_first
                if r == 0:
                    outs[n].append(toks)
    res: dict = {"device": torch.cuda.get_device_name(), "prompts": args.prompts, "max_tokens": args.max_tokens,
                 "repeats": args.repeats, "engines": {}}
    for n in names:
        st = {key: llms[n].engine.stats.snapshot()[key] - st0[n][key]
              for key in ("accepted", "verify_steps", "graph_steps", "graph_step_s", "graph_wait_s")}
        g = llms[n].engine.runner.graphs
        e = {"decode_tokens_per_s": round(dec[n][0] / dec[n][1], 1),
             "mean_acceptance_length": round(1 + st["accepted"] / max(st["verify_steps"], 1), 3),
             "graph_step_host_us": round(1e6 * st["graph_step_s"] / st["graph_steps"], 1),
             "graph_wait_us": round(1e6 * st["graph_wait_s"] / st["graph_steps"], 1),
             "target_graph_b1_us": replay_us(g.target[1][0]),
             "target_launch_b1_host_us": replay_us(g.target[1][0], launch_only=True)}
        if 1 in g.draft:  # the host path's second launch, and the fused graph a plain-greedy step replays instead
            e["draft_graph_b1_us"] = replay_us(g.draft[1][0])
            e["draft_launch_b1_host_us"] = replay_us(g.draft[1][0], launch_only=True)
            e["fused_graph_b1_us"] = replay_us(g.fused[1][0])
            e["fused_launch_b1_host_us"] = replay_us(g.fused[1][0], launch_only=True)
        res["engines"][n] = e
    for tag in ("torch", "fused"):
        a, b = res["engines"][f"k0_{tag}"], res["engines"][f"k3_{tag}"]
        res[f"k3_decode_speedup_over_acceptance_length_{tag}"] = round(
            b["decode_tokens_per_s"] / a["decode_tokens_per_s"] / b["mean_acceptance_length"], 3)
    res["same_tokens"] = {"k0": outs["k0_torch"] == outs["k0_fused"], "k3": outs["k3_torch"] == outs["k3_fused"],
                          "k3_vs_k0": outs["k3_fused"] == outs["k0_fused"]}
    write_json(res, args.out)


if __name__ == "__main__":
    main()
