"""Host cost of a CUDA-graph decode step in-process vs inside a Ray actor, side by side in one run (CPU): the
graph path of bench/host_step.py (replay a no-op) with each step's outputs packed for publishing, run (a) in this
process, (b) in an engine thread of an actor
nobody calls, (c) the same with the caller long-polling it for each step's packed outputs, as EngineGroup polls a
RankWorker. The gap is what the actor's other threads (Ray task execution, the poll) cost the engine thread.

    python bench/actor_step.py [--batch 128] [--steps 100] [--device-ms 0] [--out bench/results/actor_step.json]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import ray

BENCH = str(Path(__file__).resolve().parent)
sys.path.insert(0, BENCH)
from common import machine, start_ray, write_json  # noqa: E402


def measure(batch: int, steps: int, notify=None, device_ms: float = 0.0) -> dict:
    """host_step.measure with each step's outputs handed to `notify` (packed, as a RankWorker publishes them);
    device_ms > 0: the wait for a graph step's results sleeps that long (GIL released, as in a CUDA sync)."""
    sys.path.insert(0, BENCH)
    import host_step
    import torch

    from mtp_ray.engine.core import EngineCore
    from mtp_ray.engine.graphs import CudaGraphs, Fetched
    from mtp_ray.runtime.messages import pack_step

    torch.set_num_threads(1)
    CudaGraphs._capture = host_step._capture
    if notify is not None:
        step = EngineCore.step

        def publishing_step(self, next_cmd: int = 0):
            out = step(self, next_cmd)
            notify(pack_step(0, out))
            return out

        EngineCore.step = publishing_step
    if device_ms:
        wait = Fetched.wait

        def waiting_results(self):
            time.sleep(device_ms / 1e3)
            return wait(self)

        Fetched.wait = waiting_results
    return host_step.measure(0, batch, steps)


class Rank:
    """The RankWorker's threading shape: an engine thread publishing per step, poll() on the actor's threads."""

    def __init__(self):
        self.cond, self.outbox, self.result = threading.Condition(), [], None

    def _publish(self, msg: bytes) -> None:
        with self.cond:
            self.outbox.append(msg)
            self.cond.notify_all()

    def start(self, batch: int, steps: int, device_ms: float) -> None:
        def run():
            try:
                self.result = measure(batch, steps, self._publish, device_ms)
            except Exception as e:  # reported through poll
                self.result = {"error": repr(e)}

        threading.Thread(target=run, daemon=True).start()

    def poll(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.outbox and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            msgs, self.outbox = self.outbox, []
        return {"msgs": len(msgs), "result": self.result}


def in_actor(batch: int, steps: int, polled: bool, device_ms: float) -> dict:
    rank = ray.remote(max_concurrency=16)(Rank).remote()
    try:
        ray.get(rank.start.remote(batch, steps, device_ms))
        while True:
            if polled:
                r = ray.get(rank.poll.remote(0.5))
            else:
                time.sleep(0.5)
                r = ray.get(rank.poll.remote(0.0))
            if r["result"] is not None:
                assert "error" not in r["result"], r["result"]
                return r["result"]
    finally:
        ray.kill(rank)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="a simulated device wait per graph step (sleep: the GIL is released, as in a CUDA sync)")
    ap.add_argument("--out", default="bench/results/actor_step.json")
    args = ap.parse_args()
    local = measure(args.batch, args.steps, lambda msg: None, args.device_ms)  # packs each step's outputs too
    start_ray(2)
    idle = in_actor(args.batch, args.steps, False, args.device_ms)
    polled = in_actor(args.batch, args.steps, True, args.device_ms)
    out = {"machine": machine(), "batch": args.batch, "steps": args.steps,
           "device_ms": args.device_ms,
           "host_ms_per_step": {"in_process": local["host_ms_per_step"], "actor_idle": idle["host_ms_per_step"],
                                "actor_polled": polled["host_ms_per_step"]}}
    write_json(out, args.out)
    ray.shutdown()


if __name__ == "__main__":
    main()
