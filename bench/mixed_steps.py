"""Steps that admit prompts beside running decodes (GPU): the wall time of one engine step that prefills N new
prompts of L tokens while B sequences decode, with the mixed-step graphs (engine/varlen_graphs.py) and eager, next
to the B-row decode step (a CUDA graph) of the same engine, interleaved in one process.

    python bench/mixed_steps.py [--layers 4] [--beside 64] [--shapes 1x16 1x128 8x16 8x128] [--steps 15] [--k 0]
        [--split] [--out bench/results/mixed_steps_<card>_<layers>l[_k<k>].json]

Random weights at the Qwen3.5-35B-A3B shapes cut to --layers layers (with --k, its MTP layer too: B verify rows
beside the prompts; random drafts are rejected), bf16, the serving limits of
deployments/qwen35_gpu.yaml (max_model_len 32768, 8192 tokens a step, 128 sequences), prefix caching on as served
(every prompt new: a miss). Each step is timed alone (synchronized before and after: host work and device time,
what a step costs the streams running beside it); B requests are decoding (context ~ 64 tokens) before each one,
and the N new requests are aborted after it. ratio = mixed step / decode step (issue 63: <= 2). --split: the prompts
get a step of their own (the decodes wait a step), as the engine schedules k > 0 by default.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtp_ray import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import hf_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--beside", type=int, default=64, help="sequences decoding while the prompts come in")
    ap.add_argument("--shapes", nargs="+", default=["1x16", "1x128", "8x16", "8x128"], help="N prompts x L tokens")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--k", type=int, default=0)
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    card = torch.cuda.get_device_name()
    tmp = Path(tempfile.mkdtemp(prefix="mixed35b-"))
    (tmp / "config.json").write_text(json.dumps(hf_config(args.layers, mtp=args.k > 0)))
    llm = LLM(str(tmp), load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=32768,
              max_num_batched_tokens=8192, max_num_seqs=128, num_speculative_tokens=args.k, split_prefill=args.split)
    eng, ids = llm.engine, itertools.count()
    runner = eng.runner
    long = SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for _ in range(args.beside):  # the running batch
        i = next(ids)
        eng.add_request(f"d{i}", [(11 * i + j) % 2000 + 3 for j in range(64)], long)
    while any(not r.is_decode for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(5):
        eng.step()

    phases: dict[str, dict[str, float]] = {}  # per variant: host ms per step in each phase (the engine's clock)

    def timed(fn, variant: str | None = None) -> float:
        torch.cuda.synchronize()
        before = eng.clock.snapshot()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if variant is not None:  # (the step's phases, whichever kind the clock filed it under)
            acc = phases.setdefault(variant, {"steps": 0})
            acc["steps"] += 1
            for kind, now in eng.clock.snapshot().items():
                was = before.get(kind, {})
                for k, v in now.items():
                    if k != "steps" and v - was.get(k, 0.0):
                        acc[k] = acc.get(k, 0.0) + (v - was.get(k, 0.0)) * 1e3
        return wall

    def decode_ms() -> float:
        return round(statistics.median(timed(eng.step, "decode") for _ in range(args.steps)) * 1e3, 3)

    def mixed_ms(n: int, length: int, graphs: bool) -> tuple[float, int]:
        walls, graphed = [], 0
        bucket = runner.mixed_bucket
        if not graphs:
            runner.mixed_bucket = lambda inp: 0  # this engine's eager path for the same steps
        try:
            for _ in range(args.steps):
                new = []
                for _ in range(n):
                    i = next(ids)
                    new.append(f"p{i}")
                    eng.add_request(new[-1], [(7 * i + j) % 2000 + 3 for j in range(length)], one)
                before = eng.stats.mixed_graph_steps
                walls.append(timed(eng.step, f"{n}x{length} {'graph' if graphs else 'eager'}"))
                graphed += eng.stats.mixed_graph_steps - before
                for rid in new:
                    eng.abort_request(rid)
                eng.step()  # back to B decoding rows
        finally:
            runner.mixed_bucket = bucket
        return round(statistics.median(walls) * 1e3, 3), graphed

    rows = {}
    decode = [decode_ms()]
    for shape in args.shapes:
        n, length = map(int, shape.split("x"))
        mixed_ms(n, length, True)  # settles the allocator for this shape
        g, graphed = mixed_ms(n, length, True)
        e, _ = mixed_ms(n, length, False)
        decode.append(decode_ms())
        rows[shape] = {"graph_ms": g, "eager_ms": e, "graph_steps": graphed, "steps": args.steps}
    d = statistics.median(decode)
    for r in rows.values():
        r["graph_over_decode"] = round(r["graph_ms"] / d, 3)
        r["eager_over_decode"] = round(r["eager_ms"] / d, 3)
    res = {"device": card, "layers": args.layers, "k": args.k, "split": args.split, "beside": args.beside,
           "decode_ms": d, "decode_ms_runs": decode,
           # host ms per step by phase (commit includes waiting for the device's results), mean over the timed steps
           "phases_ms": {v: {k: round(x / acc["steps"], 3) for k, x in acc.items() if k != "steps"}
                         for v, acc in phases.items()},
           "buckets": list(runner.mixed_buckets), "rows": rows}
    print(json.dumps(res, indent=1))
    tag = "".join(c for c in card.split()[1] if c.isalnum()).lower() if len(card.split()) > 1 else "gpu"
    suffix = (f"_k{args.k}" if args.k else "") + ("_split" if args.split else "")
    out = Path(args.out or f"bench/results/mixed_steps_{tag}_{args.layers}l{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
