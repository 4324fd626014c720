"""Prefix caching: TTFT and prefill tokens computed with the cache on vs off, side by side in one run.

    python bench/prefix.py [--device cpu|cuda] [--dtype auto] [--k 3] [--conversations 4] [--turns 4] [--samples 8]
                           [--model bundled|35b] [--layers 8] [--out bench/results/prefix.json]

Three workloads on the bundled model, or (--model 35b, GPU) random weights at the Qwen3.5-35B-A3B shapes cut to
--layers layers, where a prefill token costs what it does in serving (engine API, one rank):
- chat: --conversations conversations of --turns turns; every turn of every conversation is sent together, its
  prompt = a shared system prompt + the whole history (earlier user turns and the model's answers) + a new user
  turn; greedy answers of --answer tokens;
- samples: --samples sampled completions of one prompt sent together (a GRPO group; completions `n`);
- unique: --samples prompts that share nothing: what the cache costs when it never hits.
Per workload and setting: prompt tokens, prefill tokens computed (prompt tokens minus those taken from the cache),
TTFT (add -> first token, engine steps only), wall time, and the share of prompt tokens an ideal cache would reuse
(`shared`: tokens already seen by an earlier request of the workload, whole blocks before each prompt's last
token). `computed_drop` (1 - computed on / computed off) should be at least `shared`; greedy outputs must match.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, write_json  # noqa: E402


def serve(core, batch: list[tuple[list[int], object]]) -> tuple[list[list[int]], list[float], list[int]]:
    """Add every (prompt, params) at once, step to the end -> (outputs, TTFT seconds, cached prompt tokens)."""
    t0 = time.perf_counter()
    ids = [f"r{time.perf_counter_ns()}-{i}" for i in range(len(batch))]
    for rid, (prompt, params) in zip(ids, batch, strict=True):
        core.add_request(rid, prompt, params)
    outs = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    cached = dict.fromkeys(ids, 0)
    while core.has_unfinished():
        for o in core.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            outs[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens or 0
    return [outs[r] for r in ids], [first[r] for r in ids], [cached[r] for r in ids]


def shared_tokens(prompts_in_order: list[list[int]], block: int) -> int:
    """Tokens of each prompt that an earlier prompt already covered, in whole blocks before its last token."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for p in prompts_in_order:
        full = (len(p) - 1) // block
        n = 0
        while n < full and tuple(p[: (n + 1) * block]) in seen:
            n += 1
        total += n * block
        seen.update(tuple(p[: (i + 1) * block]) for i in range(full))
    return total


def run_chat(core, args, rng: random.Random, params) -> dict:
    system = [rng.randrange(3, 2000) for _ in range(args.system)]
    history = [list(system) for _ in range(args.conversations)]
    res = {"prompt_tokens": 0, "cached": 0, "ttft": [], "outputs": [], "prompts": []}
    t0 = time.perf_counter()
    for _ in range(args.turns):
        prompts = [h + [rng.randrange(3, 2000) for _ in range(rng.randint(20, 60))] for h in history]
        outs, ttft, cached = serve(core, [(p, params) for p in prompts])
        res["prompts"] += prompts
        res["prompt_tokens"] += sum(map(len, prompts))
        res["cached"] += sum(cached)
        res["ttft"] += ttft
        res["outputs"] += outs
        history = [p + o for p, o in zip(prompts, outs, strict=True)]
    res["wall_s"] = time.perf_counter() - t0
    return res


def run_samples(core, args, rng: random.Random) -> dict:
    from mtp_ray.engine.sampling_params import SamplingParams

    prompt = [rng.randrange(3, 2000) for _ in range(args.sample_prompt)]
    batch = [(prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=args.answer, ignore_eos=True))
             for i in range(args.samples)]
    t0 = time.perf_counter()
    outs, ttft, cached = serve(core, batch)
    return {"prompt_tokens": len(prompt) * args.samples, "cached": sum(cached), "ttft": ttft, "outputs": outs,
            "prompts": [prompt] * args.samples, "wall_s": time.perf_counter() - t0}


def run_unique(core, args, rng: random.Random, params) -> dict:
    """Prompts that share nothing: what the cache costs when it never hits (hashing, and each prompt's snapshot
    taken inside its prefill: the GDN recurrence over its rows once more)."""
    prompts = [[rng.randrange(3, 2000) for _ in range(args.sample_prompt)] for _ in range(args.samples)]
    t0 = time.perf_counter()
    outs, ttft, cached = serve(core, [(p, params) for p in prompts])
    return {"prompt_tokens": sum(map(len, prompts)), "cached": sum(cached), "ttft": ttft, "outputs": outs,
            "prompts": prompts, "wall_s": time.perf_counter() - t0}


def summary(r: dict, block: int) -> dict:
    computed = r["prompt_tokens"] - r["cached"]
    return {"prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached"], "prefill_tokens_computed": computed,
            "shared": round(shared_tokens(r["prompts"], block) / r["prompt_tokens"], 3),
            "ttft_ms_mean": round(1e3 * statistics.mean(r["ttft"]), 1),
            "ttft_ms_p50": round(1e3 * statistics.median(r["ttft"]), 1), "wall_s": round(r["wall_s"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on a GPU (near-ties may differ), fp32 on CPU")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=200, help="system prompt tokens")
    ap.add_argument("--answer", type=int, default=32, help="tokens per answer / sample")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--sample-prompt", type=int, default=300)
    ap.add_argument("--model", choices=["bundled", "35b"], default="bundled")
    ap.add_argument("--layers", type=int, default=8, help="--model 35b: layers kept of the 40")
    ap.add_argument("--out", default="bench/results/prefix.json")
    args = ap.parse_args()
    model: dict = {}
    if args.model == "35b":  # config.json only: random weights (load_format dummy), a bounded cache
        import json
        import tempfile

        from decode import hf_config

        tmp = Path(tempfile.mkdtemp(prefix="prefix35b-"))
        (tmp / "config.json").write_text(json.dumps(hf_config(args.layers, mtp=args.k > 0)))
        model = {"model": str(tmp), "load_format": "dummy", "num_blocks": 4096, "max_model_len": 8192}

    from mtp_ray.config.flat import engine_config
    from mtp_ray.engine.core import EngineCore
    from mtp_ray.engine.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=args.answer, ignore_eos=True)
    name = "bundled" if args.model == "bundled" else f"random Qwen3.5-35B-A3B shapes, {args.layers} layers"
    result = {"machine": machine(), "device": args.device, "k": args.k, "model": name, "args": vars(args),
              "workloads": {}}
    for name in ("chat", "samples", "unique"):
        rows = {}
        for on in (False, True):
            cfg = engine_config(num_speculative_tokens=args.k, device=args.device, dtype=args.dtype,
                                enable_prefix_caching=on,
                                max_num_seqs=max(args.conversations, args.samples), max_num_batched_tokens=1024,
                                **model)
            core = EngineCore(cfg)
            if core.runner.graphs is not None:
                core.warmup()
            rng = random.Random(0)
            r = (run_chat(core, args, rng, greedy) if name == "chat" else run_samples(core, args, rng)
                 if name == "samples" else run_unique(core, args, rng, greedy))
            rows["on" if on else "off"] = (summary(r, cfg.cache.block_size), r["outputs"])
            del core  # its device memory back before the next engine
            if args.device == "cuda":
                import torch

                gc.collect()
                torch.cuda.empty_cache()
        (on_s, on_out), (off_s, off_out) = rows["on"], rows["off"]
        w = {"cache_off": off_s, "cache_on": on_s,
             "computed_drop": round(1 - on_s["prefill_tokens_computed"] / max(1, off_s["prefill_tokens_computed"]), 3),
             "ttft_on_over_off": round(on_s["ttft_ms_mean"] / off_s["ttft_ms_mean"], 3),
             "outputs_equal": on_out == off_out}
        w["drop_at_least_shared"] = w["computed_drop"] >= on_s["shared"] - 1e-9
        result["workloads"][name] = w
        print(f"{name}: prefill tokens computed {off_s['prefill_tokens_computed']} -> "
              f"{on_s['prefill_tokens_computed']} (drop {w['computed_drop']}, shared {on_s['shared']}), TTFT mean "
              f"{off_s['ttft_ms_mean']} -> {on_s['ttft_ms_mean']} ms, outputs equal {w['outputs_equal']}")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
