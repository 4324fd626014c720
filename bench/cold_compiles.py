"""Triton compiles a fresh engine meets after its warmup, under a serving-like workload (GPU).

    python bench/cold_compiles.py [--model bundled|35b] [--layers 4] [--k 0] [--out bench/results/cold_compiles.json]

A cold server's first burst of requests waited seconds in Triton JIT compiles the warmup had not met
(bench/serve.py `cold_burst`). This builds an engine in a process of its own with an empty Triton cache (set
TRITON_CACHE_DIR to a fresh folder), warms it up as a rank does, then serves requests arriving as a server sees
them: one at a time, a few per step while others decode (mixed steps), a burst, a prompt longer than a prefill
chunk, greedy and sampled rows, prompt lengths of every residue. Every compile is recorded with its Triton
specialization (the JIT cache key: argument types, alignment / value classes); after warmup there should be none.
For each kernel compiled after warmup the JSON lists the specializations the warmup compiled, to show what differs.
--model 35b: random weights at the Qwen3.5-35B-A3B shapes and the scheduler of deployments/qwen35_gpu.yaml.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import machine, write_json  # noqa: E402


class Compiles:
    """Triton's post-compile hook: (phase, kernel name, specialization, seconds) of every compile."""

    def __init__(self) -> None:
        self.phase = "warmup"
        self.seen: list[dict] = []
        self._t = 0.0
        try:
            from triton import knobs
        except ImportError:  # CPU: nothing compiles (a smoke run of the workload)
            return
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after

    def _before(self, **kw: object) -> bool:
        self._t = time.perf_counter()
        return False

    def _after(self, **kw: object) -> bool:
        name = getattr(kw.get("fn"), "name", "?")
        comp = kw.get("compile") or {}
        self.seen.append({"phase": self.phase, "kernel": name, "s": round(time.perf_counter() - self._t, 3),
                          "key": str(comp.get("key", ""))[:4000], "attrs": str(comp.get("configs", ""))[:2000]})
        return False


def workload(core, rng: random.Random, k: int) -> int:
    """Requests arriving as a server sees them; returns the steps served."""
    from mtp_ray.engine.sampling_params import SamplingParams

    sched = core.cfg.scheduler
    vocab = core.runner.model_config.vocab_size
    ids = iter(range(10**9))

    def add(n_tokens: int, sampled: bool | None = None) -> None:
        sampled = rng.random() < 0.5 if sampled is None else sampled
        p = (SamplingParams(temperature=0.7, top_p=0.9, top_k=rng.choice([0, 20]), seed=rng.randrange(99),
                            max_tokens=rng.randint(1, 24), ignore_eos=True) if sampled
             else SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=True))
        n = max(1, min(n_tokens, core.max_model_len - p.max_tokens - k - 2))
        core.add_request(f"r{next(ids)}", [rng.randrange(3, vocab) for _ in range(n)], p)

    def run(arrivals: list[list[int]]) -> int:
        """arrivals[i]: prompt lengths added before step i; then steps until nothing is left."""
        steps = 0
        for wave in arrivals:
            for n in wave:
                add(n)
            core.step()
            steps += 1
        while core.has_unfinished():
            core.step()
            steps += 1
        return steps

    steps = 0
    for n in (1, 2, 7, 16, 17, 31, 33, 100, 127):  # one request alone: N = 1, every length residue
        steps += run([[n]])
    steps += run([[rng.randint(1, 200) for _ in range(rng.randint(0, 3))] for _ in range(48)])  # mixed steps
    steps += run([[32] * min(64, sched.max_num_seqs)])  # a burst of equal prompts
    steps += run([[rng.randint(1, 300) for _ in range(min(40, sched.max_num_seqs))]])  # a burst of mixed lengths
    steps += run([[5, 9], [], [sched.prefill_chunk + rng.randint(1, 200)], [], [3]])  # a long prompt amid decodes
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["bundled", "35b"], default="bundled")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--k", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/cold_compiles.json")
    args = ap.parse_args()

    from mtp_ray.llm import LLM

    compiles = Compiles()
    kw: dict = {"device": args.device, "dtype": "bfloat16" if args.device == "cuda" else "float32",
                "num_speculative_tokens": args.k}
    if args.model == "35b":
        from decode import hf_config

        path = Path(tempfile.mkdtemp(prefix="cold35b-"))
        (path / "config.json").write_text(json.dumps(hf_config(args.layers, mtp=args.k > 0)))
        kw.update(model=str(path), load_format="dummy", max_num_seqs=128, max_num_batched_tokens=8192,
                  prefill_chunk=2048, max_model_len=32768)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    warmup_s = time.perf_counter() - t0
    compiles.phase = "serving"
    t0 = time.perf_counter()
    steps = workload(llm.engine, random.Random(args.seed), args.k)
    serving_s = time.perf_counter() - t0
    after = [c for c in compiles.seen if c["phase"] == "serving"]
    warm = [c for c in compiles.seen if c["phase"] == "warmup"]
    out = {
        "machine": machine(), "model": args.model, "layers": args.layers, "k": args.k,
        "engine_start_s": round(warmup_s, 2), "serving_s": round(serving_s, 2), "serving_steps": steps,
        "compiles_in_warmup": len(warm), "compile_s_in_warmup": round(sum(c["s"] for c in warm), 2),
        "compiles_after_warmup": len(after), "compile_s_after_warmup": round(sum(c["s"] for c in after), 2),
        "after_warmup": after,
        # what the warmup compiled of the same kernels: the difference is the specialization it missed
        "warmup_specializations": {c["kernel"]: [f'{w["key"]} {w["attrs"]}' for w in warm
                                                 if w["kernel"] == c["kernel"]] for c in after},
    }
    write_json(out, args.out)


if __name__ == "__main__":
    main()
