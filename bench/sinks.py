"""Cost of routing rank outputs to requests in the engine actor (runtime/sinks.py), CPU, one process: N requests x S
steps of one-token rows, unpacked from the wire format, through StreamSink (a queue and a consumer coroutine woken per
step: HTTP streaming) vs Collector (appended in the poll loop, one wake-up at the end: the rollout handle).

    python bench/sinks.py [--requests 256] [--steps 64] [--out bench/results/sinks.json]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.runtime.messages import pack_step, unpack_step
from mtp_ray.runtime.sinks import Collector, StreamSink

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_json  # noqa: E402


def messages(n: int, steps: int) -> list[bytes]:
    return [pack_step(s, [StepOutput(f"r{i}", [5], [-0.1], [], s == steps - 1, "length" if s == steps - 1 else None,
                                     None, 32, {}) for i in range(n)]) for s in range(steps)]


async def route(kind: str, msgs: list[bytes], n: int) -> float:
    sinks: dict = {}
    waits = []
    if kind == "stream":
        async def consume(sink: StreamSink) -> None:
            toks: list[int] = []
            while True:
                out = await sink.queue.get()
                toks += out.new_token_ids
                if out.finished:
                    return

        for i in range(n):
            sinks[f"r{i}"] = StreamSink()
            waits.append(asyncio.ensure_future(consume(sinks[f"r{i}"])))
    else:
        for i in range(n):
            sinks[f"r{i}"] = Collector()
            waits.append(sinks[f"r{i}"].done)
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    for m in msgs:  # what EngineGroup._poll does with each message
        for out in unpack_step(m)[1]:
            sinks[out.request_id].put(out)
        await asyncio.sleep(0)
    await asyncio.gather(*waits)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default="bench/results/sinks.json")
    args = ap.parse_args()
    msgs = messages(args.requests, args.steps)
    rows = []
    for kind in ("stream", "collect"):
        best = min(asyncio.run(route(kind, msgs, args.requests)) for _ in range(3))
        rows.append({"sink": kind, "ms_per_step": round(1e3 * best / args.steps, 3),
                     "us_per_output": round(1e6 * best / args.steps / args.requests, 2)})
    write_json({"machine": machine(), "requests": args.requests, "steps": args.steps, "runs": rows}, args.out)


if __name__ == "__main__":
    main()
