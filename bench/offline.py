"""Offline benchmark on the bundled model, side by side in one run:
transformers `generate` (batch 1 and all prompts in one batch) vs mtp-ray, and mtp-ray with MTP k = 0..3
(acceptance length, speed ratio), with CUDA graphs on and off on a GPU, and on a GPU also k = 1..3 with async
verify steps (scheduler.async_verify).

    python bench/offline.py [--out bench/results/offline.json] [--max-tokens 64] [--prompts 8] [--threads 2]
                            [--device cpu|cuda] [--dtype float32|bfloat16] [--repeats 1]

Greedy decoding, fp32 on the CPU by default. Tokens/s counts generated tokens over wall time (prefill included);
with --repeats N every timed row runs N times and reports the median (and every run's figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.config.engine import BUNDLED_MODEL

HELDOUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "heldout.py.txt"


def prompts(tok, n: int, length: int = 48) -> list[list[int]]:
    ids = tok.encode(HELDOUT.read_text(), add_special_tokens=False)
    starts = [(i * 200) % (len(ids) - length) for i in range(n)]  # wraps past ~75 prompts
    return [ids[s : s + length] for s in starts]


def run_hf(ps: list[list[int]], max_tokens: int, device: str, dtype: torch.dtype, batch: bool, repeats: int = 1
           ) -> dict:
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=dtype).eval().to(device)
    kw = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(torch.tensor([ps[0]], device=device), **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            if batch:  # equal-length prompts: one batch, no padding
                o = model.generate(torch.tensor(ps, device=device), **kw)
                outs = [r[len(ps[0]):].tolist() for r in o]
            else:  # batch 1, as a user of generate() would for unequal prompts
                outs = [model.generate(torch.tensor([p], device=device), **kw)[0, len(p):].tolist() for p in ps]
            _sync(device)
            times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    n = sum(len(o) for o in outs)
    return {"batch": len(ps) if batch else 1, "tokens": n, "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 1),
            "tokens_per_s_runs": [round(n / t, 1) for t in times], "outputs": outs}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_ours(ps: list[list[int]], max_tokens: int, k: int, batch: bool, device: str, dtype: str,
             graphs: bool = True, repeats: int = 1, async_verify: bool = False) -> dict:
    llm = LLM(num_speculative_tokens=k, max_num_seqs=len(ps), device=device, dtype=dtype, cuda_graphs=graphs,
              async_verify=async_verify)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    if batch:
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=4))  # warm-up (graph capture of this size)
    st0 = dict(llm.engine.stats)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(ps, sp) if batch else [llm.generate([p], sp)[0] for p in ps]
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    st = {key: llm.engine.stats[key] - st0[key] for key in ("accepted", "verify_steps", "steps", "graph_steps",
                                                            "graph_step_s", "async_steps")}
    on_gpu = device.startswith("cuda")
    decode = None if batch else statistics.median(decode_rate(llm, ps, sp) for _ in range(repeats))
    return {"k": k, "batch": len(ps) if batch else 1, "cuda_graphs": graphs and on_gpu,
            "async_verify": async_verify and k > 0 and graphs and on_gpu, "tokens": n,
            "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 1),
            "tokens_per_s_runs": [round(n / t, 1) for t in times], "decode_tokens_per_s": decode,
            "mean_acceptance_length": round(1 + st["accepted"] / st["verify_steps"], 3) if st["verify_steps"] else 1.0,
            # the timed runs: host wall time per CUDA-graph step (launch to commit) and the share of async steps
            "graph_step_ms": round(1e3 * st["graph_step_s"] / st["graph_steps"], 3) if st["graph_steps"] else None,
            "async_step_share": round(st["async_steps"] / st["steps"], 3) if st["steps"] else 0.0,
            "outputs": [o.outputs[0].token_ids for o in outs]}


def decode_rate(llm: LLM, ps: list[list[int]], sp: SamplingParams) -> float:
    """Decode-only tokens/s at batch 1: each prompt generated to max_tokens and to one token, one request at a
    time; the decode time is the difference. The prefill, the first token and the per-request costs cancel, and
    so does where a step's tokens surface (async steps hand a step's tokens out one step later)."""
    one = dataclasses.replace(sp, max_tokens=1)
    tokens, t_full, t_one = 0, 0.0, 0.0
    for p in ps:
        t0 = time.perf_counter()
        llm.generate([p], one)
        t1 = time.perf_counter()
        out = llm.generate([p], sp)[0]
        t_full, t_one = t_full + time.perf_counter() - t1, t_one + t1 - t0
        tokens += len(out.outputs[0].token_ids) - 1
    return round(tokens / (t_full - t_one), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/offline.json")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per row; the median is reported")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = LLM(max_num_seqs=1, device="cpu").tokenizer
    ps = prompts(tok, args.prompts)
    tdtype = getattr(torch, args.dtype)
    rp = args.repeats
    hf1 = run_hf(ps, args.max_tokens, args.device, tdtype, batch=False, repeats=rp)
    hfb = run_hf(ps, args.max_tokens, args.device, tdtype, batch=True, repeats=rp)
    rows = [run_ours(ps, args.max_tokens, k, False, args.device, args.dtype, repeats=rp) for k in range(4)]
    rows += [run_ours(ps, args.max_tokens, k, True, args.device, args.dtype, repeats=rp) for k in (0, 3)]
    if args.device.startswith("cuda"):
        rows += [run_ours(ps, args.max_tokens, k, b, args.device, args.dtype, graphs=False)
                 for k in (0, 3) for b in (False, True)]
        # MTP with async verify steps (scheduler.async_verify), next to the synchronous rows above
        rows += [run_ours(ps, args.max_tokens, k, False, args.device, args.dtype, repeats=rp, async_verify=True)
                 for k in (1, 2, 3)]
    base1, dec1 = rows[0]["tokens_per_s"], rows[0]["decode_tokens_per_s"]
    for r in rows:
        ref = hf1 if r["batch"] == 1 else hfb
        r["same_tokens_as_transformers"] = r.pop("outputs") == ref["outputs"]
        r["speed_vs_k0_batch1"] = round(r["tokens_per_s"] / base1, 3) if r["batch"] == 1 else None
        r["speed_vs_transformers_same_batch"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3)
        if r["batch"] == 1 and r["k"]:
            # the MTP target: decode speedup over k = 0 at least 0.8 x the mean acceptance length
            r["speedup_over_acceptance_length"] = round(r["speed_vs_k0_batch1"] / r["mean_acceptance_length"], 3)
            if r["cuda_graphs"] == rows[0]["cuda_graphs"]:
                r["decode_speedup_vs_k0"] = round(r["decode_tokens_per_s"] / dec1, 3)
                r["decode_speedup_over_acceptance_length"] = round(r["decode_speedup_vs_k0"]
                                                                   / r["mean_acceptance_length"], 3)
    for h in (hf1, hfb):
        h.pop("outputs")
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"
                   + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "model": f"bundled tiny-qwen35-mtp ({args.dtype}, {args.device})", "prompts": args.prompts,
        "prompt_tokens": 48, "max_tokens": args.max_tokens, "repeats": rp,
        "transformers_generate": [hf1, hfb], "mtp_ray": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"transformers generate: batch 1 {hf1['tokens_per_s']} tok/s, batch {hfb['batch']} {hfb['tokens_per_s']}")
    print("| engine | k | batch | graphs | tok/s | vs transformers | mean acc. len | speed vs k=0 | speed/acc. len | "
          "decode tok/s | decode speedup / acc. len | same tokens as HF |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| mtp-ray | {r['k']} | {r['batch']} | {r['cuda_graphs']} | {r['tokens_per_s']} | "
              f"{r['speed_vs_transformers_same_batch']} | {r['mean_acceptance_length']} | {r['speed_vs_k0_batch1']} | "
              f"{r.get('speedup_over_acceptance_length')} | {r['decode_tokens_per_s']} | "
              f"{r.get('decode_speedup_over_acceptance_length')} | {r['same_tokens_as_transformers']} |")


if __name__ == "__main__":
    main()
