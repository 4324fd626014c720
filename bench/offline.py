"""Offline benchmark on the bundled model, side by side in one run:
transformers `generate` (batch 1 and all prompts in one batch) vs mtp-ray, and mtp-ray with MTP k = 0..3
(acceptance length, speed ratio); on a GPU also k = 1..3 with synchronous verify steps (scheduler.async_verify
false) and k = 0 / 3 without CUDA graphs. The batch-1 rows run interleaved, request by request (run_batch1).

    python bench/offline.py [--out bench/results/offline.json] [--max-tokens 64] [--prompts 8] [--batch 32]
                            [--threads 2] [--device cpu|cuda] [--dtype float32|bfloat16] [--repeats 1]
                            [--no-transformers]

--prompts: the batch-1 rows' requests; --batch: the batched rows' batch size (its first prompts are the batch-1
ones). --no-transformers: mtp-ray rows only (a long --max-tokens reading of the MTP speedup).

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


def make_llm(k: int, n: int, device: str, dtype: str, graphs: bool = True, async_verify: bool = True) -> LLM:
    """An engine for up to n sequences, warmed up (first-call compiles; graph capture of batch 1 and n)."""
    llm = LLM(num_speculative_tokens=k, max_num_seqs=n, device=device, dtype=dtype, cuda_graphs=graphs,
              async_verify=async_verify)
    warm = SamplingParams(temperature=0, max_tokens=4)
    llm.generate([[5, 6, 7]], warm)
    llm.generate([[5, 6, 7]] * n, warm)
    return llm


def row(llm: LLM, batch: int, times: list[float], outs: list[list[int]], st0: dict, device: str) -> dict:
    c = llm.config
    now = llm.engine.stats.snapshot()
    st = {key: now[key] - st0[key] for key in ("accepted", "verify_steps", "steps", "graph_steps",
                                                            "graph_step_s", "async_steps")}
    dt, n = statistics.median(times), sum(len(o) for o in outs)
    graphs = c.graphs.enabled and device.startswith("cuda")
    k, av = c.spec.k, c.scheduler.async_verify
    return {"k": k, "batch": batch, "cuda_graphs": graphs, "async_verify": av and k > 0 and graphs,
            "tokens": n, "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 1),
            "tokens_per_s_runs": [round(n / t, 1) for t in times], "decode_tokens_per_s": None,
            "mean_acceptance_length": round(1 + st["accepted"] / st["verify_steps"], 3) if st["verify_steps"] else 1.0,
            # the timed runs: host wall time per CUDA-graph step (launch to commit) and the share of async steps
            "graph_step_ms": round(1e3 * st["graph_step_s"] / st["graph_steps"], 3) if st["graph_steps"] else None,
            "async_step_share": round(st["async_steps"] / st["steps"], 3) if st["steps"] else 0.0, "outputs": outs}


def run_batched(llm: LLM, ps: list[list[int]], max_tokens: int, device: str, repeats: int) -> dict:
    """All prompts in one generate call."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    st0, times = llm.engine.stats.snapshot(), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(ps, sp)
        times.append(time.perf_counter() - t0)
    return row(llm, len(ps), times, [o.outputs[0].token_ids for o in outs], st0, device)


def timed(llm: LLM, rid: str, p: list[int], sp: SamplingParams) -> tuple[list[int], float, float]:
    """One request through the engine's step loop -> (its tokens, seconds to its first token, seconds in all)."""
    eng, toks, t_first = llm.engine, [], 0.0
    t0 = time.perf_counter()
    eng.add_request(rid, p, sp)
    while eng.has_unfinished():
        for o in eng.step():
            if o.new_token_ids and not toks:
                t_first = time.perf_counter() - t0
            toks += o.new_token_ids
    return toks, t_first, time.perf_counter() - t0


def run_batch1(llms: list[LLM], ps: list[list[int]], max_tokens: int, device: str, repeats: int) -> list[dict]:
    """One request at a time, every engine side by side: per prompt each engine in turn (the order rotating) runs
    it to one token and to max_tokens, so a slow spell of the host hits every engine alike. Per engine:
    tokens/s: generated tokens over the full runs' time;
    decode tok/s: tokens after the first over the time after the first token (vLLM's TPOT; an MTP engine drafts
      after the prefill before it hands out the first token, so those drafts count in the time to the first token);
    decode tok/s incl. first drafts: tokens after the first over (full run - one-token run), the one-token run
      being prefill and first token without drafts: every cost that comes with generating more than one token."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    one = dataclasses.replace(sp, max_tokens=1)
    m, n = len(llms), len(ps)
    st0 = [llm.engine.stats.snapshot() for llm in llms]  # the one-token runs add no verify steps
    full, ttft, first = ([[0.0] * repeats for _ in llms] for _ in range(3))
    outs: list[list[list[int]]] = [[] for _ in llms]
    for r in range(repeats):
        for i, p in enumerate(ps):
            for j in range(m):
                e = (i + j + r) % m
                first[e][r] += timed(llms[e], f"one-{r}-{i}", p, one)[2]
                toks, t_first, t_all = timed(llms[e], f"full-{r}-{i}", p, sp)
                ttft[e][r] += t_first
                full[e][r] += t_all
                if r == 0:
                    outs[e].append(toks)
    rows = []
    for e, llm in enumerate(llms):
        res = row(llm, 1, full[e], outs[e], st0[e], device)
        dec = res["tokens"] - n
        res["decode_tokens_per_s"] = round(statistics.median(dec / (f - t) for f, t in zip(full[e], ttft[e])), 1)
        res["decode_incl_first_drafts_tokens_per_s"] = round(
            statistics.median(dec / (f - o) for f, o in zip(full[e], first[e])), 1)
        res["ttft_ms"] = round(1e3 * statistics.median(ttft[e]) / n, 3)
        rows.append(res)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/offline.json")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32, help="batch size of the batched rows")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers generate rows")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per row; the median is reported")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = LLM(max_num_seqs=1, device="cpu").tokenizer
    ps, pb = prompts(tok, args.prompts), prompts(tok, args.batch)
    tdtype = getattr(torch, args.dtype)
    rp = args.repeats
    hf1 = hfb = None
    if not args.no_transformers:
        hf1 = run_hf(ps, args.max_tokens, args.device, tdtype, batch=False, repeats=rp)
        hfb = run_hf(pb, args.max_tokens, args.device, tdtype, batch=True, repeats=rp)
    n = max(len(ps), len(pb))
    variants = [(k, True, True) for k in range(4)]  # (k, CUDA graphs, async verify): the defaults
    if args.device.startswith("cuda"):  # synchronous verify steps, and no graphs at all
        variants += [(k, True, False) for k in (1, 2, 3)] + [(0, False, True), (3, False, True)]
    llms = [make_llm(k, n, args.device, args.dtype, g, a) for k, g, a in variants]
    rows = run_batch1(llms, ps, args.max_tokens, args.device, rp)
    rows += [run_batched(llms[k], pb, args.max_tokens, args.device, rp) for k in (0, 3)]
    if args.device.startswith("cuda"):
        rows += [run_batched(llms[-2 + i], pb, args.max_tokens, args.device, 1) for i in (0, 1)]
    base1 = rows[0]["tokens_per_s"]
    k0 = {r["cuda_graphs"]: r for r in rows if r["batch"] == 1 and r["k"] == 0}  # per graphs setting
    for r in rows:
        ref = hf1 if r["batch"] == 1 else hfb
        outs = r.pop("outputs")
        r["same_tokens_as_transformers"] = outs == ref["outputs"] if ref else None
        r["speed_vs_k0_batch1"] = round(r["tokens_per_s"] / base1, 3) if r["batch"] == 1 else None
        r["speed_vs_transformers_same_batch"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3) if ref else None
        if r["batch"] == 1 and r["k"]:
            # the MTP target: decode speedup over k = 0 at least 0.8 x the mean acceptance length
            r["speedup_over_acceptance_length"] = round(r["speed_vs_k0_batch1"] / r["mean_acceptance_length"], 3)
            d0 = k0.get(r["cuda_graphs"])  # against k = 0 with the same graphs setting
            if d0 is not None:
                r["decode_speedup_vs_k0"] = round(r["decode_tokens_per_s"] / d0["decode_tokens_per_s"], 3)
                r["decode_speedup_over_acceptance_length"] = round(r["decode_speedup_vs_k0"]
                                                                   / r["mean_acceptance_length"], 3)
                r["decode_incl_first_drafts_speedup_over_acceptance_length"] = round(
                    r["decode_incl_first_drafts_tokens_per_s"] / d0["decode_incl_first_drafts_tokens_per_s"]
                    / r["mean_acceptance_length"], 3)
    for h in (hf1, hfb):
        if h:
            h.pop("outputs")
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"
                   + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "model": f"bundled tiny-qwen35-mtp ({args.dtype}, {args.device})", "prompts": args.prompts,
        "batch": args.batch, "prompt_tokens": 48, "max_tokens": args.max_tokens, "repeats": rp,
        "transformers_generate": [h for h in (hf1, hfb) if h], "mtp_ray": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if hf1 and hfb:
        print(f"transformers generate: batch 1 {hf1['tokens_per_s']} tok/s, batch {hfb['batch']} "
              f"{hfb['tokens_per_s']}")
    print("| k | batch | graphs | async verify | tok/s | vs transformers | mean acc. len | TTFT ms | decode tok/s | "
          "decode speedup / acc. len | decode tok/s incl. first drafts | its speedup / acc. len | same tokens as HF |")
    print("| --- " * 13 + "|")
    for r in rows:
        print(f"| {r['k']} | {r['batch']} | {r['cuda_graphs']} | {r['async_verify']} | {r['tokens_per_s']} | "
              f"{r['speed_vs_transformers_same_batch']} | {r['mean_acceptance_length']} | {r.get('ttft_ms')} | "
              f"{r['decode_tokens_per_s']} | {r.get('decode_speedup_over_acceptance_length')} | "
              f"{r.get('decode_incl_first_drafts_tokens_per_s')} | "
              f"{r.get('decode_incl_first_drafts_speedup_over_acceptance_length')} | "
              f"{r['same_tokens_as_transformers']} |")


if __name__ == "__main__":
    main()
