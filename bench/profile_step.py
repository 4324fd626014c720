"""Where one engine step's time goes (dp = 1, no Ray): wall time per step, host (Python) hot spots and device
kernels, for MTP k = 0 and k = 3 side by side; decode steps (CUDA-graph replays on a GPU) or prefill steps (eager).

    python bench/profile_step.py --device cuda --out bench/results/profile_step.json [--steps 40] [--batch 1]
        [--model bundled|35b --layers 8] [--phase decode|prefill] [--k 0 3] [--async-verify]

--model 35b: random weights (load_format dummy) at the Qwen3.5-35B-A3B shapes cut to --layers layers, prompts of 32
synthetic ids, a 4096-token step budget (bench/dp.py's serving set-up, without the group around it).
--phase prefill: a round adds --batch requests with max_tokens = 1 and steps until they finish, so every step is a
prefill step; the figures are per prefill step (one warm-up round first: fla autotunes on its first call).

Writes JSON: per k the mean step wall time, the device time of the same steps when the host waits for them, tokens
per step, the 25 heaviest Python functions (cProfile, own time) and the 25 heaviest device kernels / host ops
(torch.profiler, self time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.serve.step_profile import summary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import hf_config  # noqa: E402
from offline import prompts  # noqa: E402


class Workload:
    """Runs `steps` engine steps of one phase; decode keeps `batch` sequences decoding, prefill adds rounds."""

    def __init__(self, llm: LLM, phase: str, batch: int, ids: list[list[int]]):
        self.llm, self.eng, self.phase, self.batch, self.ids = llm, llm.engine, phase, batch, ids
        self.rounds = 0
        if phase == "decode":
            sp = SamplingParams(temperature=0, max_tokens=100_000 // 40, ignore_eos=True)
            for i, p in enumerate(ids):
                self.eng.add_request(f"d{i}", p, sp)
            while any(r.is_prefill or not r.output_ids for r in self.eng.requests.values()):
                self.eng.step()
            for _ in range(3):
                self.eng.step()
        else:
            self.run(1)  # warm-up round (autotuning, first-call compiles)

    def run(self, steps: int) -> int:
        """Steps at least `steps` steps of the phase (prefill: whole rounds); returns how many ran."""
        if self.phase == "decode":
            for _ in range(steps):
                self.eng.step()
            return steps
        n = 0
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        while n < steps:
            self.rounds += 1
            for i, p in enumerate(self.ids):
                self.eng.add_request(f"p{self.rounds}-{i}", p, sp)
            while self.eng.has_unfinished():
                self.eng.step()
                n += 1
            self.eng.requests.clear()
        return n


def profile(k: int, args: argparse.Namespace, model_kw: dict) -> dict:
    llm = LLM(num_speculative_tokens=k, max_num_seqs=max(args.batch, 1), device=args.device, dtype=args.dtype,
              async_verify=args.async_verify, **model_kw)
    if llm.tokenizer is not None:
        ids = prompts(llm.tokenizer, args.batch)
    else:
        ids = [[(7 * i + j) % 2000 + 3 for j in range(32)] for i in range(args.batch)]
    work = Workload(llm, args.phase, args.batch, ids)
    eng = llm.engine
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # wall time per step, nothing attached
    sync()
    n0, t0 = sum(len(r.output_ids) for r in eng.requests.values()), time.perf_counter()
    steps = work.run(args.steps)
    sync()
    wall = (time.perf_counter() - t0) / steps
    toks = (sum(len(r.output_ids) for r in eng.requests.values()) - n0) / steps if args.phase == "decode" else 0.0
    # host hot spots
    prof = cProfile.Profile()
    prof.enable()
    steps = work.run(args.steps)
    sync()
    prof.disable()
    host = summary(pstats.Stats(prof), steps, top=25)["functions"]
    # device kernels and torch ops
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as p:
        steps = work.run(args.steps)
        sync()
    ev = p.key_averages()
    dev = sorted((e for e in ev if getattr(e, "self_device_time_total", 0) > 0),
                 key=lambda e: -e.self_device_time_total)[:25]
    cpu = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:25]
    kernels = sum(e.count for e in ev if getattr(e, "self_device_time_total", 0) > 0) / steps
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in ev) / steps
    return {
        "k": k, "async_verify": args.async_verify, "phase": args.phase, "batch": args.batch,
        "step_wall_ms": round(1e3 * wall, 3),
        "tokens_per_step": round(toks, 3), "ms_per_token": round(1e3 * wall / toks, 3) if toks else None,
        "device_kernels_per_step": round(kernels, 1), "device_busy_ms_per_step": round(device_us / 1e3, 3),
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
    ap.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--k", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--async-verify", action="store_true", help="k > 0: async verify steps (scheduler.async_verify)")
    ap.add_argument("--model", choices=["bundled", "35b"], default="bundled")
    ap.add_argument("--layers", type=int, default=8, help="--model 35b: layers kept of the 40")
    ap.add_argument("--out", default="bench/results/profile_step.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model_kw, tmp, name = {}, None, "bundled tiny-qwen35-mtp"
    if args.model == "35b":
        tmp = Path(tempfile.mkdtemp(prefix="prof35b-"))
        (tmp / "config.json").write_text(json.dumps(hf_config(args.layers, mtp=max(args.k) > 0)))
        model_kw = {"model": str(tmp), "load_format": "dummy", "max_model_len": 512, "max_num_batched_tokens": 4096}
        name = f"random Qwen3.5-35B-A3B shapes, {args.layers} layers"
    try:
        res = [profile(k, args, model_kw) for k in args.k]
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": args.device, "dtype": args.dtype, "model": name, "runs": res},
                                         indent=1))
    for r in res:
        print(f"k={r['k']} {r['phase']} batch={r['batch']}: step {r['step_wall_ms']} ms, {r['tokens_per_step']} "
              f"tok/step, {r['device_kernels_per_step']} kernels, device busy {r['device_busy_ms_per_step']} ms/step")
        for h in r["host_python"][:15]:
            print("   ", h)
        for d in r["device_ops"][:12]:
            print("   dev", d)


if __name__ == "__main__":
    main()
