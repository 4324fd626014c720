"""DP benchmark, side by side in one run: the same workload on a dp = 1 and a dp = 2 group (through the actor
handle), plus the per-step cost of the DPMeta gather and of a dummy forward measured inside the ranks.

    python bench/dp.py [--out bench/results/dp.json] [--requests 64] [--k 0] [--device cpu|cuda]
                       [--max-num-seqs 64] [--repeats 1] [--model bundled|35b] [--layers 8] [--profile-steps N]
                       [--submit each|batch]

--submit each (default): one `generate` call per request, as independent clients send them; the requests reach the
ranks over the time the handle takes to accept that many calls (each prefill turn in that window admits what has
arrived). --submit batch: the whole workload in one `generate` call (a rollout worker's batch), so it arrives at once.

--model 35b: random weights (load_format dummy) at the Qwen3.5-35B-A3B shapes cut to --layers layers, so the
steps are device-bound as on a real model (the bundled tiny model's steps are host-bound).

On GPUs each rank gets its own GPU (STRICT_PACK), bf16, CUDA graphs on. --repeats N times the workload N times on
the same group (after one warm-up) and reports every run and the median: one run of a few seconds is noisy.

Per dp, besides throughput: `phases_ms` (per kind of step, the ranks' host time per phase: PhaseClock) and, per
repeat, `run_split`: wall time, when the last request reached its rank, each rank's time inside steps and process
CPU, the engine actor's CPU (the request intake), GC pauses and Triton compiles inside the ranks.

Note: on a 2-core machine dp = 2 puts one rank on each core; the driver and Ray share them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

from mtp_ray.rl.engine import launch_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import start_ray  # noqa: E402
from decode import hf_config  # noqa: E402


def run(dp: int, k: int, prompts: list[list[int]], max_tokens: int, device: str, max_num_seqs: int,
        repeats: int, model: dict, profile_steps: int = 0, submit: str = "each") -> dict:
    cfg = {"spec": {"num_speculative_tokens": k}, "parallel": {"dp": dp}, "device": device,
           "scheduler": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 4096}, **model}
    if "load_format" in model:  # real shapes: a short context keeps the graph block tables small
        cfg["scheduler"]["max_model_len"] = 512
    if device == "cuda":
        cfg["parallel"]["placement_strategy"] = "STRICT_PACK"
    h = launch_engine(cfg)
    try:
        params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
        # warm-up at the measured batch shape (on GPUs this captures the CUDA graphs the run replays)
        ray.get([h.generate.remote(p, {**params, "max_tokens": 4}) for p in prompts])
        first = ray.get(h.get_stats.remote())
        before, seconds, split = first["ranks"], [], []
        for _ in range(repeats):
            s0 = ray.get(h.get_stats.remote())
            t0, m0 = time.perf_counter(), time.monotonic()
            if submit == "batch":
                outs = ray.get(h.generate.remote(prompts, params))
            else:
                outs = ray.get([h.generate.remote(p, params) for p in prompts])
            seconds.append(time.perf_counter() - t0)
            split.append(run_split(s0, ray.get(h.get_stats.remote()), seconds[-1], m0))
        after = ray.get(h.get_stats.remote())["ranks"]
        # one lone request: every other rank runs dummy forwards alongside it
        ray.get(h.generate.remote(prompts[1], params))
        lone = ray.get(h.get_stats.remote())["ranks"]
        profiles = None
        if profile_steps:  # the workload once more, its first steps profiled on every rank (after the timing)
            workers = ray.get(h.worker_handles.remote())
            refs = [w.profile_steps.remote(profile_steps, 120.0, device == "cuda") for w in workers]
            time.sleep(0.5)  # the profilers are armed before the work arrives
            gens = [h.generate.remote(p, params) for p in prompts]
            profiles = ray.get(refs)
            ray.get(gens)
    finally:
        ray.get(h.shutdown.remote())
    toks = sum(len(o["token_ids"]) for o in outs)

    def delta(key: str) -> float:
        return sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before))

    gathers, forwards = delta("gathers"), delta("forwards") - delta("dummy_forwards")
    steps = delta("steps")  # per rank, steps that ran a forward (real or dummy), summed over ranks
    dummies = sum(a["dummy_forwards"] - b["dummy_forwards"] for a, b in zip(lone, after))
    dummy_s = sum(a["dummy_forward_s"] - b["dummy_forward_s"] for a, b in zip(lone, after))
    per_run = [round(toks / t, 1) for t in seconds]
    return {
        "dp": dp, "k": k, "requests": len(prompts), "generated_tokens": toks, "seconds": [round(t, 3) for t in seconds],
        "tokens_per_s": statistics.median(per_run), "tokens_per_s_runs": per_run,
        "gathers_per_rank": gathers / dp / repeats,
        # wall time inside DPMeta.gather, including waiting for the slowest rank to arrive
        "gather_us": round(1e6 * delta("gather_s") / gathers, 1) if gathers else None,
        "real_forward_ms": round(1e3 * delta("forward_s") / forwards, 3) if forwards else None,
        # one step on one rank, split: wall = host work + DPMeta gathers (waits included) + forwards (launch, or
        # the whole forward where the host waits for the device)
        "step_ms": round(1e3 * delta("step_s") / steps, 3) if steps else None,
        "step_gather_ms": round(1e3 * delta("gather_s") / steps, 3) if steps else None,
        "step_forward_ms": round(1e3 * (delta("forward_s") + delta("dummy_forward_s")) / steps, 3) if steps else None,
        "step_host_ms": round(1e3 * (delta("step_s") - delta("gather_s") - delta("forward_s")
                                     - delta("dummy_forward_s")) / steps, 3) if steps else None,
        # graph-replay steps (uniform decode / verify) vs eager steps (prefill pieces, mixed batches), per rank
        "graph_steps_per_rank": round(delta("graph_steps") / dp / repeats, 1),
        "graph_step_ms": round(1e3 * delta("graph_step_s") / delta("graph_steps"), 3) if delta("graph_steps") else None,
        # the part of a graph step the host waited for the device (device-greedy steps; the rest is host work)
        "graph_wait_ms": round(1e3 * delta("graph_wait_s") / delta("graph_steps"), 3) if delta("graph_steps") else None,
        "eager_steps_per_rank": round((steps - delta("graph_steps")) / dp / repeats, 1),
        "eager_tokens_per_step": round(delta("eager_tokens") / (steps - delta("graph_steps")), 1)
        if steps > delta("graph_steps") else None,
        "eager_step_ms": round(1e3 * (delta("step_s") - delta("graph_step_s")) / (steps - delta("graph_steps")), 3)
        if steps > delta("graph_steps") else None,
        # per kind of step ("graph", "eager"), per rank and step: ms of each host phase (PhaseClock; wall - cpu:
        # the engine thread blocked) over all repeats
        "phases_ms": phase_ms(before, after),
        # per repeat: wall, each rank's time inside steps and its process CPU, the group actor's CPU
        "run_split": split,
        "lone_request_dummy_forwards": dummies,
        "dummy_forward_ms": round(1e3 * dummy_s / dummies, 3) if dummies else None,
        **({"profile": profiles} if profiles else {}),
    }


def phase_ms(before: list[dict], after: list[dict]) -> dict:
    out: dict = {}
    for kind in ("graph", "eager"):
        tot: dict[str, float] = {}
        for a, b in zip(after, before):
            pa, pb = a.get("phases", {}).get(kind, {}), b.get("phases", {}).get(kind, {})
            for name, v in pa.items():
                tot[name] = tot.get(name, 0.0) + v - pb.get(name, 0.0)
        steps = tot.pop("steps", 0)
        if steps:
            out[kind] = {"steps_per_rank": round(steps / len(after), 1),
                         **{name: round(1e3 * v / steps, 3) for name, v in sorted(tot.items())}}
    return out


def run_split(s0: dict, s1: dict, wall: float, m0: float) -> dict:
    def busy(a: dict, b: dict) -> float:
        return sum(a["phases"].get(k, {}).get("wall", 0.0) - b["phases"].get(k, {}).get("wall", 0.0)
                   for k in ("graph", "eager"))

    return {"wall_s": round(wall, 3),
            # when the run's last request reached its rank, from the start (monotonic clocks of one machine): how
            # long the requests took to arrive through the engine actor
            "last_arrival_s": round(max(r["last_add_monotonic"] for r in s1["ranks"]) - m0, 3),
            "rank_step_s": [round(busy(a, b), 3) for a, b in zip(s1["ranks"], s0["ranks"])],
            "rank_cpu_s": [round(a["process_cpu_s"] - b["process_cpu_s"], 3) for a, b in zip(s1["ranks"], s0["ranks"])],
            "group_cpu_s": round(s1["group_cpu_s"] - s0["group_cpu_s"], 3),
            # stalls inside the ranks during the run: Python GC pauses, Triton compiles (StallMonitor)
            "rank_gc_s": [round(a - b, 4) for a, b in zip(stall(s1, "gc_s"), stall(s0, "gc_s"))],
            "rank_triton_compiles": [a - b for a, b in zip(stall(s1, "triton_compiles"), stall(s0, "triton_compiles"))],
            "rank_recent_compiles": stall(s1, "recent_compiles") if stall(s1, "triton_compiles") != stall(
                s0, "triton_compiles") else []}


def stall(s: dict, key: str) -> list:
    return [r["stalls"][key] for r in s["ranks"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/dp.json")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", choices=["bundled", "35b"], default="bundled")
    ap.add_argument("--layers", type=int, default=8, help="--model 35b: layers kept of the 40")
    ap.add_argument("--submit", choices=["each", "batch"], default="each",
                    help="one generate call per request (default) or the whole workload in one call")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the timing: cProfile each rank's engine thread over N steps of one more run")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        start_ray(8, num_gpus=torch.cuda.device_count())
    else:
        start_ray(8)
    prompts = [[(7 * i + j) % 2000 + 3 for j in range(32)] for i in range(args.requests)]
    model, name = {}, "bundled tiny-qwen35-mtp"
    if args.model == "35b":  # random weights at the Qwen3.5-35B-A3B shapes, cut to --layers (config.json only)
        tmp = Path(tempfile.mkdtemp(prefix="dp35b-"))
        (tmp / "config.json").write_text(json.dumps(hf_config(args.layers, mtp=args.k > 0)))
        model = {"model": str(tmp), "load_format": "dummy"}
        name = f"random Qwen3.5-35B-A3B shapes, {args.layers} layers"
    try:
        rows = [run(dp, args.k, prompts, args.max_tokens, args.device, args.max_num_seqs, args.repeats, model,
                    args.profile_steps, args.submit) for dp in (1, 2)]
    finally:
        if "model" in model:
            shutil.rmtree(model["model"], ignore_errors=True)
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores, device {args.device}", "model": name,
              "workload": {
        "requests": args.requests, "prompt_tokens": 32, "max_tokens": args.max_tokens, "k": args.k,
        "max_num_seqs_per_rank": args.max_num_seqs, "repeats": args.repeats, "submit": args.submit},
        # medians of the repeats; and the ratio of each repeat pair, to show the spread
        "runs": rows, "dp2_over_dp1_throughput": round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 3),
        "dp2_over_dp1_runs": [round(b / a, 3) for a, b in zip(rows[0]["tokens_per_s_runs"],
                                                                rows[1]["tokens_per_s_runs"])]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
