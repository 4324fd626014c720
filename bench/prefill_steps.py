"""Eager prefill steps of short prompts (GPU): wall time of one step that prefills N new prompts of L tokens, with
the GDN layers' short-piece recurrent kernel and with fla's chunked kernels (`layers/context.py: SHORT_PIECE` set
to 0), interleaved in one process.

    python bench/prefill_steps.py [--layers 4] [--shapes 1x32 8x32 1x128] [--steps 15] [--repeats 2]
        [--out bench/results/prefill_steps.json]

Random weights at the Qwen3.5-35B-A3B shapes cut to --layers layers, k = 0, the serving limits of
deployments/qwen35_gpu.yaml (max_model_len 32768, 8192 tokens a step, 128 sequences), prefix caching on as served:
every prompt is new (a miss; its last full block before the final token is snapshotted inside the piece). Each
step is timed alone (the device idle before and after it): what a short request's TTFT pays for its prefill.
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

import mtp_ray.layers.context as context
from mtp_ray import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import hf_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shapes", nargs="+", default=["1x32", "8x32", "1x128"], help="N prompts x L tokens a step")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/results/prefill_steps.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prefill35b-"))
    (tmp / "config.json").write_text(json.dumps(hf_config(args.layers)))
    llm = LLM(str(tmp), load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=32768,
              max_num_batched_tokens=8192, max_num_seqs=128)
    eng, ids = llm.engine, itertools.count()
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def median_step_ms(steps: int, n: int, length: int) -> float:
        walls = []
        for _ in range(steps):
            for _ in range(n):
                i = next(ids)
                eng.add_request(f"r{i}", [(7 * i + j) % 2000 + 3 for j in range(length)], sp)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            assert not eng.has_unfinished(), "one step prefills the whole batch"
        return round(statistics.median(walls) * 1e3, 3)

    short, rows = context.SHORT_PIECE, {s: {"recurrent_ms": [], "fla_ms": []} for s in args.shapes}
    for _ in range(args.repeats):
        for kernel, piece in (("recurrent", short), ("fla", 0)):
            context.SHORT_PIECE = piece
            for shape in args.shapes:
                n, length = map(int, shape.split("x"))
                median_step_ms(3, n, length)  # settles the allocator for this shape
                rows[shape][f"{kernel}_ms"].append(median_step_ms(args.steps, n, length))
    context.SHORT_PIECE = short
    for r in rows.values():
        r["recurrent_over_fla"] = round(statistics.mean(r["recurrent_ms"]) / statistics.mean(r["fla_ms"]), 3)
    res = {"device": torch.cuda.get_device_name(), "layers": args.layers, "steps": args.steps, "rows": rows}
    print(json.dumps(res, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
