"""RL loop sketch: a trainer actor changes the weights every iteration and pushes them to an engine group
(dp = 2, EP, MTP k = 2); rollout worker actors generate through the group's handle concurrently.

    python examples/rl_rollout.py [--iterations 3] [--workers 4] [--prompts 16]

Prints, per iteration: rollout throughput and the MTP acceptance (mean accepted drafts per verify + 1).
"""

from __future__ import annotations

import argparse
import os
import time

import ray
import torch

from mtp_ray.config.engine import BUNDLED_MODEL
from mtp_ray.model.loader import checkpoint_tensors
from mtp_ray.rl.engine import launch_engine


@ray.remote(num_cpus=0)
class Trainer:
    """Stands in for a trainer: each 'step' nudges every weight (MTP head included) by a little noise."""

    def __init__(self):
        self.weights = [(n, read(None).float()) for n, _, read in checkpoint_tensors(BUNDLED_MODEL)]
        self.step = 0

    def train_step(self) -> list:
        self.step += 1
        g = torch.Generator().manual_seed(self.step)
        self.weights = [(n, t + 0.002 * torch.randn(t.shape, generator=g)) for n, t in self.weights]
        return [(n, ray.put(t)) for n, t in self.weights]  # one object ref per tensor


@ray.remote(num_cpus=0)
class RolloutWorker:
    def __init__(self, engine):
        self.engine = engine

    def rollout(self, prompts: list[list[int]], max_tokens: int) -> list[dict]:
        params = {"temperature": 1.0, "top_p": 0.95, "max_tokens": max_tokens}
        return ray.get([self.engine.generate.remote(p, params) for p in prompts])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per worker per iteration")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    engine = launch_engine({"spec": {"num_speculative_tokens": 2}, "parallel": {"dp": 2}})
    trainer = Trainer.remote()
    workers = [RolloutWorker.remote(engine) for _ in range(args.workers)]
    for it in range(args.iterations):
        t0 = time.perf_counter()
        ray.get(engine.sleep.remote(1))  # free the KV cache while the trainer trains
        weights = ray.get(trainer.train_step.remote())
        ray.get(engine.wake_up.remote())
        ray.get(engine.update_weights.remote(weights))
        t_sync = time.perf_counter() - t0
        t0 = time.perf_counter()
        jobs = [w.rollout.remote([[(7 * i + j + it) % 2000 + 3 for j in range(24)] for i in range(args.prompts)],
                                 args.max_tokens) for w in workers]
        results = [r for batch in ray.get(jobs) for r in batch]
        dt = time.perf_counter() - t0
        toks = sum(len(r["token_ids"]) for r in results)
        drafts = sum(r["spec"]["num_drafts"] for r in results)
        accepted = sum(r["spec"]["num_accepted_tokens"] for r in results)
        print(f"iteration {it}: {len(results)} rollouts, {toks} tokens in {dt:.2f}s ({toks / dt:.0f} tok/s); "
              f"acceptance length {1 + accepted / max(drafts, 1):.2f}; sleep+update+wake {t_sync:.2f}s")
    ray.get(engine.shutdown.remote())


if __name__ == "__main__":
    main()
