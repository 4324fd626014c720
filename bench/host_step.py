"""Host cost of a CUDA-graph decode step, measured on the CPU: the engine's graph path (schedule, pack inputs,
DPMeta, device-greedy result handling, outputs) with the graph replay replaced by a no-op, so only the Python /
host work of a step is timed. On the GPU this work runs while the device idles (the tiny bundled model's steps are
host-bound: see docs/performance.md), so it bounds tokens/s there.

    python bench/host_step.py [--batches 1 32 128] [--k 0 3] [--steps 100] [--out bench/results/host_step.json]

Writes JSON: per (k, batch) the host milliseconds per step and per sequence.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.engine.graphs import CudaGraphs


class _NoReplay:
    def replay(self) -> None:  # the static outputs keep what the capture-time run wrote
        pass


def _capture(self: CudaGraphs, fn):  # stands in for CudaGraphs._capture: run once, never replay
    self.barrier()
    return _NoReplay(), fn()


def measure(k: int, batch: int, steps: int) -> dict:
    llm = LLM(num_speculative_tokens=k, max_num_seqs=batch, device="cpu", dtype="float32")
    eng, r = llm.engine, llm.engine.runner
    r.graphs = CudaGraphs(r.model, (batch,), r.k, r.blocks_per_seq, llm.config.cache.block_size, r.device,
                          async_verify=llm.config.scheduler.async_verify, draft_vocab=r.draft_vocab)
    eng.scheduler.split = True  # as with graphs on a GPU
    eng.warmup()
    gc.collect()
    gc.freeze()  # as a rank does after warmup (runtime/worker.py): collections skip the model and caches
    sp = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", [(7 * i + j) % 2000 + 3 for j in range(32)], sp)
    while any(q.is_prefill or not q.output_ids for q in eng.requests.values()):
        eng.step()
    for _ in range(5):
        eng.step()
    g0 = eng.stats.device_greedy_steps
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    assert eng.stats.device_greedy_steps - g0 == steps, "a step left the graph path"
    return {"k": k, "batch": batch, "host_ms_per_step": round(ms, 3), "host_us_per_seq": round(1e3 * ms / batch, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="bench/results/host_step.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    CudaGraphs._capture = _capture
    rows = [measure(k, b, args.steps) for k in args.k for b in args.batches]
    res = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "torch": torch.__version__,
           "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
