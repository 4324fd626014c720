"""What a burst of admissions costs in Ray Serve itself, with no engine behind it (issue 24's 128-stream line).

    python bench/serve_calls.py [--burst 1 32 128] [--repeats 3] [--num-cpus 2] [--out bench/results/serve_calls.json]

A caller deployment (standing in for the HTTP ingress) sends `burst` calls at once to a trivial deployment
(standing in for the group) and times each call to its first result: a streaming handle call that yields at once
and stays open (how the ingress admits a request today), a unary handle call, a plain Ray actor call (no
Serve routing), and one streaming call carrying the whole burst (what batched admission would cost). Their spread
at a burst of 128 is the admission floor Serve adds before any engine work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import ray
from ray import serve


@serve.deployment(max_ongoing_requests=2048)
class Target:
    async def admit(self, i: int):
        yield i
        await asyncio.sleep(2.0)  # stays open, as an admitted request's call does

    async def unary(self, i: int) -> int:
        return i

    async def admit_many(self, items: list[int]):
        yield items
        await asyncio.sleep(2.0)


@ray.remote
class PlainTarget:
    async def unary(self, i: int) -> int:
        return i


@serve.deployment(max_ongoing_requests=2048)
class Caller:
    def __init__(self, target):
        self.target = target
        self.streaming = target.options(stream=True)
        self.plain = PlainTarget.remote()

    async def burst(self, n: int, kind: str) -> dict:
        async def one(i: int) -> float:
            t0 = time.perf_counter()
            if kind == "serve_stream":
                gen = self.streaming.admit.remote(i)
                await gen.__anext__()
                gen.cancel()
            elif kind == "serve_stream_batch":  # (one call for all: every item waits for the same first result)
                gen = self.streaming.admit_many.remote(list(range(n)))
                await gen.__anext__()
                gen.cancel()
            elif kind == "serve_unary":
                await self.target.unary.remote(i)
            else:
                await self.plain.unary.remote(i)
            return time.perf_counter() - t0

        await self.target.unary.remote(-1)  # (routes known, actor warm)
        await self.plain.unary.remote(-1)
        t = sorted(await asyncio.gather(*(one(i) for i in range(1 if kind == "serve_stream_batch" else n))))
        n = len(t)
        ms = lambda x: round(x * 1e3, 2)  # noqa: E731
        return {"kind": kind, "burst": n, "p50_ms": ms(t[n // 2]), "p90_ms": ms(t[(9 * n) // 10]), "max_ms": ms(t[-1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--out", default="bench/results/serve_calls.json")
    args = ap.parse_args()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    handle = serve.run(Caller.bind(Target.bind()), name="serve_calls", route_prefix=None)
    rows = []
    for n in args.burst:
        for kind in ("serve_stream", "serve_unary", "ray_actor", "serve_stream_batch"):
            runs = [handle.burst.remote(n, kind).result() for _ in range(args.repeats)]
            row = {"kind": kind, "burst": n, **{k: sorted(r[k] for r in runs)[len(runs) // 2]
                                                 for k in ("p50_ms", "p90_ms", "max_ms")}}
            rows.append(row)
            print(row)
    serve.shutdown()
    result = {"ray": ray.__version__, "num_cpus": args.num_cpus, "repeats": args.repeats,
              "note": "median over repeats of each burst's per-call time to first result", "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
