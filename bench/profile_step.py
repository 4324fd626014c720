"""Where one decode step's time goes, at batch 1 on the bundled model: wall time per step, host (Python) hot spots
and device kernels, for MTP k = 0 and k = 3 side by side.

    python bench/profile_step.py --device cuda --out bench/results/profile_step.json [--steps 40]

Writes JSON: per k the mean step wall time, tokens per step, the 25 heaviest Python functions (cProfile, own
time) and the 25 heaviest device kernels / host ops (torch.profiler, self time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from mtp_ray import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline import prompts  # noqa: E402


def _until_decoding(llm: LLM) -> None:
    eng = llm.engine
    while any(r.is_prefill or not r.output_ids for r in eng.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()


def profile(k: int, device: str, dtype: str, steps: int, batch: int) -> dict:
    llm = LLM(num_speculative_tokens=k, max_num_seqs=max(batch, 1), device=device, dtype=dtype)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=100_000 // 40, ignore_eos=True)
    for i, ids in enumerate(prompts(llm.tokenizer, batch)):
        eng.add_request(f"r{i}", ids, sp)
    _until_decoding(llm)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # wall time per step, nothing attached
    sync()
    n0, t0 = sum(len(r.output_ids) for r in eng.requests.values()), time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    wall = (time.perf_counter() - t0) / steps
    toks = (sum(len(r.output_ids) for r in eng.requests.values()) - n0) / steps
    # host hot spots
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    sync()
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(((v[2], v[3], v[1], f"{Path(fn[0]).name}:{fn[1]}:{fn[2]}") for fn, v in st.stats.items()),
                  reverse=True)[:25]
    host = [{"fn": r[3], "own_ms_per_step": round(1e3 * r[0] / steps, 4),
             "cum_ms_per_step": round(1e3 * r[1] / steps, 4), "calls_per_step": round(r[2] / steps, 2)} for r in rows]
    # device kernels and torch ops
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as p:
        for _ in range(steps):
            eng.step()
        sync()
    ev = p.key_averages()
    dev = sorted((e for e in ev if getattr(e, "self_device_time_total", 0) > 0),
                 key=lambda e: -e.self_device_time_total)[:25]
    cpu = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:25]
    kernels = sum(e.count for e in ev if getattr(e, "self_device_time_total", 0) > 0) / steps
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in ev) / steps
    return {
        "k": k, "batch": batch, "step_wall_ms": round(1e3 * wall, 3), "tokens_per_step": round(toks, 3),
        "ms_per_token": round(1e3 * wall / max(toks, 1e-9), 3), "device_kernels_per_step": round(kernels, 1),
        "device_busy_ms_per_step": round(device_us / 1e3, 3),
        "host_python": host,
        "device_ops": [{"name": e.key[:80], "us_per_step": round(e.self_device_time_total / steps, 2),
                        "count_per_step": round(e.count / steps, 2)} for e in dev],
        "host_ops": [{"name": e.key[:80], "us_per_step": round(e.self_cpu_time_total / steps, 2),
                      "count_per_step": round(e.count / steps, 2)} for e in cpu],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default="bench/results/profile_step.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    res = [profile(k, args.device, args.dtype, args.steps, args.batch) for k in (0, 3)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": args.device, "dtype": args.dtype, "runs": res}, indent=1))
    for r in res:
        print(f"k={r['k']} batch={r['batch']}: step {r['step_wall_ms']} ms, {r['tokens_per_step']} tok/step, "
              f"{r['ms_per_token']} ms/token, {r['device_kernels_per_step']} kernels, "
              f"device busy {r['device_busy_ms_per_step']} ms/step")
        for h in r["host_python"][:12]:
            print("   ", h)
        for d in r["device_ops"][:8]:
            print("   dev", d)


if __name__ == "__main__":
    main()
