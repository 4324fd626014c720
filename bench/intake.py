"""Request intake of the engine actor, side by side in one run: the actor CPU one `generate` call costs on the
rollout handle (a dp = 1 group of the bundled model on the CPU, max_tokens 1, so decoding is negligible) vs a bare
async Ray actor method taking the same arguments. The difference is what mtp-ray adds per request on top of Ray's
own task cost; together they bound how many requests per second one engine actor accepts (bench/dp.py
`last_arrival_s`, `group_cpu_s`).

    python bench/intake.py [--requests 512] [--repeats 3] [--out bench/results/intake.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import ray

from mtp_ray.rl.engine import launch_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, start_ray, write_json  # noqa: E402


class Bare:
    async def generate(self, prompt_token_ids: list[int], sampling_params: dict | None = None) -> dict:
        return {"token_ids": [1], "log_probs": [0.0], "stop_reason": "length", "finish_reason": "length", "spec": {}}

    async def get_stats(self) -> dict:
        return {"group_cpu_s": time.process_time()}


def measure(h, prompts: list[list[int]], repeats: int) -> dict:
    params = {"temperature": 0, "max_tokens": 1, "ignore_eos": True}
    ray.get([h.generate.remote(p, params) for p in prompts[:32]])  # warm
    per_call, walls = [], []
    for _ in range(repeats):
        c0 = ray.get(h.get_stats.remote())["group_cpu_s"]
        t0 = time.perf_counter()
        ray.get([h.generate.remote(p, params) for p in prompts])
        walls.append(time.perf_counter() - t0)
        per_call.append(1e6 * (ray.get(h.get_stats.remote())["group_cpu_s"] - c0) / len(prompts))
    return {"actor_cpu_us_per_call": round(statistics.median(per_call), 1),
            "runs_us_per_call": [round(x, 1) for x in per_call], "wall_s": [round(w, 3) for w in walls]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/intake.json")
    args = ap.parse_args()
    start_ray(4)
    prompts = [[(7 * i + j) % 2000 + 3 for j in range(32)] for i in range(args.requests)]
    bare = ray.remote(Bare).options(num_cpus=0, max_concurrency=1000).remote()
    rows = {"bare_ray_actor": measure(bare, prompts, args.repeats)}
    h = launch_engine({"device": "cpu", "parallel": {"dp": 1}, "scheduler": {"max_num_seqs": 256}})
    try:
        rows["rollout_handle"] = measure(h, prompts, args.repeats)
    finally:
        ray.get(h.shutdown.remote())
    write_json({"machine": machine(), "requests": args.requests, "runs": rows}, args.out)


if __name__ == "__main__":
    main()
