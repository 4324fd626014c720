"""Where a k = 3 graph step's host time goes against a k = 0 step's (GPU, bundled model, batch 1): the two engines
as bench/offline.py makes them, requests interleaved (the order rotating), and per engine the decode tok/s after the
first token, the mean acceptance length, the host time per graph step by phase (the engine's PhaseClock: schedule,
gather, inputs, launch, resolve, commit) and the decode time outside graph steps per request. Issue 27's metric,
decode speedup / acceptance length, follows from them: on this host-bound model a k = 3 step's extra host time
counts about 2.8 times against it (once per step instead of once per token).

    python bench/mtp_phases.py --out bench/results/mtp_phases_h100.json [--prompts 16] [--repeats 3] [--max-seqs 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mtp_ray import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402
from offline import make_llm, prompts, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/mtp_phases.json")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seqs", type=int, default=32, help="max_num_seqs of the engines (bench/offline.py: 32)")
    args = ap.parse_args()
    ks = (0, 3)
    llms = [make_llm(k, args.max_seqs, "cuda", "bfloat16") for k in ks]
    ps = prompts(llms[0].tokenizer, args.prompts)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    clock0 = [dict(llm.engine.clock.snapshot().get("graph", {})) for llm in llms]
    stats0 = [llm.engine.stats.snapshot() for llm in llms]
    dec = [0.0] * len(ks)
    for r in range(args.repeats):
        for i, p in enumerate(ps):
            for j in range(len(ks)):
                e = (i + j + r) % len(ks)
                _, t_first, t_all = timed(llms[e], f"{r}-{i}", p, sp)
                dec[e] += t_all - t_first  # the time after the first token
    n_req, tokens = args.repeats * len(ps), args.repeats * len(ps) * (args.max_tokens - 1)
    rows = []
    for e, llm in enumerate(llms):
        graph, st, st0, c0 = llm.engine.clock.snapshot()["graph"], llm.engine.stats.snapshot(), stats0[e], clock0[e]
        steps = graph["steps"] - c0.get("steps", 0.0)
        phases = {ph: round(1e6 * (v - c0.get(ph, 0.0)) / steps, 1) for ph, v in graph.items()
                  if ph not in ("steps", "drafts")}
        verify = st["verify_steps"] - st0["verify_steps"]
        rows.append({
            "k": ks[e], "decode_tokens_per_s": round(tokens / dec[e], 1),
            "mean_acceptance_length": round(1 + (st["accepted"] - st0["accepted"]) / verify, 3) if verify else 1.0,
            "graph_steps_per_request": round(steps / n_req, 2), "host_us_per_graph_step": phases,
            # decode time spent outside graph steps (the last steps' waits, idle resolves), per request
            "other_decode_ms_per_request": round(1e3 * (dec[e] - 1e-6 * phases["wall"] * steps) / n_req, 3)})
    k0, k3 = rows
    res = {"device": torch.cuda.get_device_name(), "prompts": args.prompts, "repeats": args.repeats,
           "max_tokens": args.max_tokens, "engines": rows,
           "k3_minus_k0_us_per_graph_step": {ph: round(v - k0["host_us_per_graph_step"][ph], 1)
                                             for ph, v in k3["host_us_per_graph_step"].items()},
           "decode_speedup_over_acceptance_length": round(
               k3["decode_tokens_per_s"] / k0["decode_tokens_per_s"] / k3["mean_acceptance_length"], 3)}
    write_json(res, args.out)


if __name__ == "__main__":
    main()
