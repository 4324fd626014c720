"""Offline benchmark on the bundled model, side by side in one run:
transformers `generate` vs mtp-ray (k = 0), and mtp-ray with MTP k = 0..3 (acceptance length, speed ratio).

    python bench/offline.py [--out bench/results/offline.json] [--max-tokens 64] [--prompts 8] [--threads 2]
                            [--device cpu|cuda]

Greedy decoding, fp32, on the CPU by default. Tokens/s counts generated tokens over wall time (prefill included).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.config.engine import BUNDLED_MODEL

HELDOUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "heldout.py.txt"


def prompts(tok, n: int, length: int = 48) -> list[list[int]]:
    ids = tok.encode(HELDOUT.read_text(), add_special_tokens=False)
    return [ids[i * 200 : i * 200 + length] for i in range(n)]


def run_hf(ps: list[list[int]], max_tokens: int, device: str) -> dict:
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval().to(device)
    t0, n = time.perf_counter(), 0
    outs = []
    with torch.no_grad():
        for p in ps:  # batch 1, as a user of generate() would for unequal prompts
            o = model.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                               do_sample=False, pad_token_id=0)
            outs.append(o[0, len(p):].tolist())
            n += len(outs[-1])
    dt = time.perf_counter() - t0
    return {"tokens": n, "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 1), "outputs": outs}


def run_ours(ps: list[list[int]], max_tokens: int, k: int, batch: bool, device: str) -> dict:
    llm = LLM(num_speculative_tokens=k, max_num_seqs=len(ps), device=device, dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp) if batch else [llm.generate([p], sp)[0] for p in ps]
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    st = llm.engine.stats
    return {"k": k, "batch": len(ps) if batch else 1, "tokens": n, "seconds": round(dt, 3),
            "tokens_per_s": round(n / dt, 1),
            "mean_acceptance_length": round(1 + st["accepted"] / st["verify_steps"], 3) if st["verify_steps"] else 1.0,
            "outputs": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/offline.json")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = LLM(max_num_seqs=1).tokenizer
    ps = prompts(tok, args.prompts)
    hf = run_hf(ps, args.max_tokens, args.device)
    rows = [run_ours(ps, args.max_tokens, k, False, args.device) for k in range(4)]
    rows += [run_ours(ps, args.max_tokens, k, True, args.device) for k in (0, 3)]
    base1 = rows[0]["tokens_per_s"]
    for r in rows:
        r["same_tokens_as_transformers"] = r.pop("outputs") == hf["outputs"]
        r["speed_vs_k0_batch1"] = round(r["tokens_per_s"] / base1, 3) if r["batch"] == 1 else None
    hf.pop("outputs")
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "model": f"bundled tiny-qwen35-mtp (fp32, {args.device})", "prompts": args.prompts, "prompt_tokens": 48,
        "max_tokens": args.max_tokens, "transformers_generate_batch1": hf, "mtp_ray": rows,
        "mtp_ray_k0_vs_transformers_batch1": round(base1 / hf["tokens_per_s"], 3),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"transformers generate, batch 1: {hf['tokens_per_s']} tok/s")
    print("| engine | k | batch | tok/s | mean acceptance length | speed vs k=0 (batch 1) | same tokens as HF |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| mtp-ray | {r['k']} | {r['batch']} | {r['tokens_per_s']} | {r['mean_acceptance_length']} | "
              f"{r['speed_vs_k0_batch1']} | {r['same_tokens_as_transformers']} |")


if __name__ == "__main__":
    main()
