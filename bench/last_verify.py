"""A request's last async verify, side by side in one run (GPU): batch-1 requests through a k = 0 engine, a k = 3
engine as shipped (a verify step whose rows all may reach max_tokens in flight is not launched: the step in flight is
committed first) and a k = 3 engine that launches it anyway (the rule before: only a row certain to end in flight
sat out), interleaved request by request as bench/offline.py runs them, two sets of the three engines. Per engine:
decode tok/s after the first token, mean acceptance length, graph steps per request, host wall per graph step, and
speedup / acceptance length against the k = 0 engine of its set (issue 27's metric).

    python bench/last_verify.py --out bench/results/last_verify_h200.json [--max-tokens 64 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mtp_ray import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402
from offline import make_llm, prompts, run_batch1  # noqa: E402

KINDS = ("k0", "k3", "k3_launch_anyway")


def engines(sets: int) -> list[LLM]:
    out = []
    for _ in range(sets):
        k0, k3, old = make_llm(0, 1, "cuda", "bfloat16"), make_llm(3, 1, "cuda", "bfloat16"), make_llm(
            3, 1, "cuda", "bfloat16")
        old.engine.scheduler._may_end_in_flight = lambda req: False  # the rule before: launch on top regardless
        out += [k0, k3, old]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/last_verify.json")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sets", type=int, default=2)
    args = ap.parse_args()
    llms = engines(args.sets)
    ps = prompts(llms[0].tokenizer, args.prompts)
    res: dict = {"device": torch.cuda.get_device_name(), "prompts": args.prompts, "repeats": args.repeats, "runs": {}}
    for mt in args.max_tokens:
        steps0 = [llm.engine.stats.graph_steps for llm in llms]
        rows = run_batch1(llms, ps, mt, "cuda", args.repeats)
        runs = []
        for i, r in enumerate(rows):
            base = rows[i - i % 3]
            steps = llms[i].engine.stats.graph_steps - steps0[i]  # full and one-token runs of every repeat
            e = {"set": i // 3, "engine": KINDS[i % 3], "decode_tokens_per_s": r["decode_tokens_per_s"],
                 "mean_acceptance_length": r["mean_acceptance_length"], "graph_step_ms": r["graph_step_ms"],
                 "graph_steps_per_request": round(steps / (args.repeats * args.prompts), 2)}
            if i % 3:
                e["speedup_over_acceptance_length"] = round(
                    r["decode_tokens_per_s"] / base["decode_tokens_per_s"] / r["mean_acceptance_length"], 3)
            runs.append(e)
        # the rule changes when a step launches, never a token
        res.setdefault("same_tokens", {})[str(mt)] = all(
            rows[i + 1]["outputs"] == rows[i + 2]["outputs"] for i in range(0, len(rows), 3))
        res["runs"][str(mt)] = runs
    write_json(res, args.out)


if __name__ == "__main__":
    main()
