"""Scheduling modes of a DP group side by side: how many group steps are uniform decode steps on every rank (the
steps a CUDA graph can take), with mixed prefill + decode steps, split steps with per-rank turns, and split steps
with group turns (from the gathered DPMeta). Counted on CPU (the uniformity does not depend on the device).

    python bench/dp_turns.py [--out bench/results/dp_turns.json] [--requests 120] [--dp 2] [--k 2]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import ray

from mtp_ray.rl.engine import launch_engine

# mode -> (scheduler, parallel) overrides; per-rank turns: the group's turn is withheld, each rank alternates alone
MODES = {"mixed": ({"split_prefill": False}, {}),
         "split_rank_turns": ({"split_prefill": True}, {"group_turns": False}),
         "split_group_turns": ({"split_prefill": True}, {"group_turns": True})}


def run(mode: str, dp: int, k: int, requests: int) -> dict:
    sched, par = MODES[mode]
    cfg = {"spec": {"num_speculative_tokens": k}, "parallel": {"dp": dp, **par},
           "scheduler": {"prefill_chunk": 16, "max_num_batched_tokens": 64, "max_num_seqs": 16, **sched},
           "cache": {"block_size": 8}, "timeouts": {"collective_s": 30, "progress_s": 60}}
    h = launch_engine(cfg)
    rng = random.Random(1)
    refs = []
    t0 = time.perf_counter()
    for _ in range(requests):
        p = [rng.randrange(3, 2000) for _ in range(rng.randint(5, 40))]
        refs.append(h.generate.remote(p, {"temperature": 0, "ignore_eos": True, "max_tokens": rng.randint(8, 30)}))
        time.sleep(0.01)
    ray.get(refs, timeout=900)
    dt = time.perf_counter() - t0
    r = ray.get(h.get_stats.remote())["ranks"][0]
    ray.get(h.shutdown.remote())
    return {"mode": mode, "group_steps": r["steps"], "uniform_group_steps": r["uniform_group_steps"],
            "fraction": round(r["uniform_group_steps"] / max(r["steps"], 1), 3),
            "mixed_batch_steps_rank0": r["mixed_batch_steps"], "seconds": round(dt, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/dp_turns.json")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--k", type=int, default=2)
    args = ap.parse_args()
    ray.init(num_cpus=args.dp + 2, include_dashboard=False, log_to_driver=False)
    rows = [run(m, args.dp, args.k, args.requests) for m in MODES]
    result = {"workload": {"requests": args.requests, "dp": args.dp, "k": args.k, "prompt_tokens": "5..40",
                           "max_tokens": "8..30", "arrivals": "every 10 ms"}, "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
