"""Host cost of a CUDA-graph decode step, measured on the CPU: the engine's graph path (schedule, pack inputs,
DPMeta, device-greedy result handling, outputs) with each graph replay replaced by a stand-in that only writes the
greedy block a replay leaves (argmax ids, log-probs and, k > 0, `--accept` accepted drafts and the next drafts), so
only the Python / host work of a step is timed, with the acceptance a real model shows. On the GPU this work runs
while the device idles (the tiny bundled model's steps are host-bound: docs/performance.md), so it bounds tokens/s
there, and a k = 3 step's extra host time bounds issue 27's bundled-model metric.

    python bench/host_step.py [--batches 1 32] [--k 0 3] [--accept 2] [--rounds 10] [--block 100] [--context 512]
        [--requests 60] [--out ...json]

The engines of each k run side by side, in alternating blocks of steps. Writes JSON: per (k, batch) the host
microseconds per step, per sequence and per phase (the engine's PhaseClock; medians over the rounds), per k > 0
its excess over the k = 0 step, and whole batch-1 requests of 64 tokens: decode ms a request and, on host time alone,
issue 27's metric (decode speedup over k = 0 / tokens a verify).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.engine.core import EngineCore
from mtp_ray.engine.graphs import CudaGraphs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_json  # noqa: E402

ACCEPT = 2  # accepted drafts per verify in the stand-in replays (the bundled model accepts ~1.8 of 3)


def per_step(k: int) -> int:
    """Tokens a stand-in step commits per sequence."""
    return 1 + min(ACCEPT, k)


class _BlockReplay:
    """Stands in for a captured graph: replay() writes the greedy block (the last output) as a step would leave
    it, in one copy whatever k (so the stand-in costs a k = 3 step no more than a k = 0 step): ids 3, 4, ... per
    row, log-probs -0.5, with k the accepted count and the next drafts."""

    def __init__(self, block: torch.Tensor, q: int, k: int):
        self.block = block
        self.template = torch.empty_like(block)
        self.template[:, :q] = torch.arange(3, 3 + q, dtype=block.dtype)
        self.template[:, q : 2 * q] = -0.5
        if k:
            self.template[:, 2 * q] = per_step(k) - 1
            self.template[:, 2 * q + 1 :] = 5.0

    def replay(self) -> None:
        self.block.copy_(self.template)


def _capture(self: CudaGraphs, fn):  # stands in for CudaGraphs._capture: run once, replays write the block only
    self.barrier()
    out = fn()
    return _BlockReplay(out[-1], self.q, self.k), out


def start(k: int, batch: int) -> EngineCore:
    """An engine of k drafts with graphs of size `batch` (replays stood in for)."""
    llm = LLM(num_speculative_tokens=k, max_num_seqs=batch, device="cpu", dtype="float32")
    eng, r = llm.engine, llm.engine.runner
    r.graphs = CudaGraphs(r.model, (batch,), r.k, r.blocks_per_seq, llm.config.cache.block_size, r.device,
                          async_verify=llm.config.scheduler.async_verify, draft_vocab=r.draft_vocab)
    eng.scheduler.split = True  # as with graphs on a GPU
    eng.warmup()
    gc.collect()
    gc.freeze()  # as a rank does after warmup (runtime/worker.py): collections skip the model and caches
    return eng


def refill(eng: EngineCore, batch: int, prompt_len: int, seed: int) -> None:
    """`batch` new requests of prompt_len tokens (the old ones aborted), prefilled and decoding (untimed)."""
    eng.abort_all()
    sp = SamplingParams(temperature=0, max_tokens=eng.max_model_len - prompt_len, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"{seed}-{i}", [(7 * i + 13 * seed + j) % 2000 + 3 for j in range(prompt_len)], sp)
    while any(q.is_prefill or not q.output_ids for q in eng.requests.values()):
        eng.step()
    for _ in range(5):
        eng.step()


def timed_block(eng: EngineCore, steps: int) -> dict[str, float]:
    """`steps` graph steps -> host us a step: "step" (measured around them) and each PhaseClock phase."""
    g0, c0 = eng.stats.device_greedy_steps, eng.clock.snapshot().get("graph", {})
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    us = 1e6 * (time.perf_counter() - t0) / steps
    assert eng.stats.device_greedy_steps - g0 == steps, "a step left the graph path"
    c1 = eng.clock.snapshot()["graph"]
    return {"step": us, **{ph: 1e6 * (v - c0.get(ph, 0.0)) / steps for ph, v in c1.items()
                           if ph not in ("steps", "drafts")}}


def measure(k: int, batch: int, steps: int) -> dict:
    """One engine alone (bench/actor_step.py): host us per graph step."""
    eng = start(k, batch)
    refill(eng, batch, 32, 0)
    us = timed_block(eng, steps)["step"]
    return {"k": k, "batch": batch, "host_ms_per_step": round(us / 1e3, 3), "host_us_per_seq": round(us / batch, 2)}


def compare(ks: list[int], batch: int, rounds: int, block: int, context: int) -> list[dict]:
    """Engines of each k side by side, timed in alternating blocks of steps (the order rotating each round), so
    that the machine's drift (this 2-core host moves by +-10 % between minutes) falls on all of them alike; per
    engine the median over rounds of each figure. Each block starts from new requests whose prompts put the
    block's mean context at `context` tokens for every k (a k = 3 step adds 1 + ACCEPT tokens where a k = 0 step
    adds 1: from equal prompts its block tables would grow three times as fast, a cost of length, not of k)."""
    engines = [start(k, batch) for k in ks]
    blocks: list[list[dict[str, float]]] = [[] for _ in ks]
    for r in range(rounds):
        for j in range(len(ks)):
            e = (j + r) % len(ks)
            plen = context - block * per_step(ks[e]) // 2
            assert plen > 0 and context + block * per_step(ks[e]) < engines[e].max_model_len, "--context, --block"
            refill(engines[e], batch, plen, r)
            blocks[e].append(timed_block(engines[e], block))
    rows = []
    for k, bs in zip(ks, blocks, strict=True):
        med = {ph: round(statistics.median(b[ph] for b in bs), 1) for ph in bs[0]}
        rows.append({"k": k, "batch": batch, "host_us_per_step": med.pop("step"),
                     "host_us_per_seq": round(statistics.median(b["step"] for b in bs) / batch, 2),
                     "phases_us": med})
    return rows


def whole_requests(ks: list[int], n: int, max_tokens: int) -> dict[str, dict[str, float]]:
    """Batch-1 requests start to end (48-token prompts, the engines taking turns request by request) -> per k the
    decode ms a request (after its first token: what issue 27's metric times) and the graph steps a request."""
    engines = [start(k, 1) for k in ks]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    dec, steps0 = [0.0] * len(ks), [e.stats.graph_steps for e in engines]
    for i in range(n):
        for e, eng in enumerate(engines):
            eng.add_request(f"w{i}", [(7 * i + j) % 2000 + 3 for j in range(48)], sp)
            first = None
            while eng.has_unfinished():
                if eng.step() and first is None:
                    first = time.perf_counter()
            dec[e] += time.perf_counter() - first
    return {f"k{k}": {"decode_ms_per_request": round(1e3 * d / n, 3),
                      "graph_steps_per_request": (eng.stats.graph_steps - s0) / n}
            for k, d, eng, s0 in zip(ks, dec, engines, steps0, strict=True)}


def main() -> None:
    global ACCEPT
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--accept", type=int, default=ACCEPT, help="accepted drafts per verify (k > 0)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=100, help="graph steps per timed block")
    ap.add_argument("--context", type=int, default=512, help="mean context length of a timed block's sequences")
    ap.add_argument("--requests", type=int, default=60, help="batch-1 requests of 64 tokens per engine, start to end")
    ap.add_argument("--out", default="bench/results/host_step.json")
    args = ap.parse_args()
    ACCEPT = args.accept
    torch.set_num_threads(1)
    CudaGraphs._capture = _capture
    rows = [row for b in args.batches for row in compare(args.k, b, args.rounds, args.block, args.context)]
    base = {r["batch"]: r for r in rows if r["k"] == 0}
    excess = {f"k{r['k']}_b{r['batch']}": {ph: round(v - base[r["batch"]]["phases_us"][ph], 1)
                                           for ph, v in r["phases_us"].items()}
              for r in rows if r["k"] and r["batch"] in base}
    whole = whole_requests(args.k, args.requests, 64)
    if 0 in args.k:  # issue 27's metric on host time alone: decode speedup over k = 0 / tokens a verify
        for k in (k for k in args.k if k):
            whole[f"k{k}"]["speedup_over_acceptance_length"] = round(
                whole["k0"]["decode_ms_per_request"] / whole[f"k{k}"]["decode_ms_per_request"] / per_step(k), 3)
    write_json({"machine": machine(), "torch": torch.__version__, "accept": ACCEPT, "rounds": args.rounds,
                "block": args.block, "context": args.context, "runs": rows, "excess_over_k0_us": excess,
                "requests_64_tokens": whole}, args.out)


if __name__ == "__main__":
    main()
