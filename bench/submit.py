"""Cost of a burst of new requests to the rank process, side by side in one run: one actor call per request (the
old `add`) vs the group's CallBatcher (`add_many` for everything that arrived while the previous call was in
flight). The rank is a stand-in actor with the RankWorker's add / add_many bodies (queue puts), so the figure is
the Ray task overhead alone: CPU the rank process spends (GIL held) that its engine thread would lose.

    python bench/submit.py [--requests 512] [--repeats 3] [--out bench/results/submit.json]
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import resource
import statistics
import sys
import time
from pathlib import Path

import ray

from mtp_ray.runtime.batcher import CallBatcher

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, start_ray, write_json  # noqa: E402


class Rank:
    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()

    def add(self, rid: str, ids: list[int], params: dict) -> None:
        self.inbox.put((rid, ids, params))

    def add_many(self, items: list) -> None:
        for it in items:
            self.inbox.put(tuple(it))

    def cpu_s(self) -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime


class Group:
    def __init__(self, rank):
        self.rank = rank
        self.batcher = CallBatcher(lambda items: self.rank.add_many.remote(items))

    async def burst(self, n: int, batched: bool) -> int:
        reqs = [(f"r{i}", list(range(32)), {"temperature": 0, "max_tokens": 64}) for i in range(n)]
        calls = self.batcher.calls
        if batched:
            await asyncio.gather(*[self.batcher.submit(r) for r in reqs])
        else:
            await asyncio.gather(*[self.rank.add.remote(*r) for r in reqs])
        return self.batcher.calls - calls if batched else n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/submit.json")
    args = ap.parse_args()
    start_ray(2)
    rank = ray.remote(max_concurrency=16)(Rank).remote()
    group = ray.remote(Group).remote(rank)
    for batched in (False, True):  # warm-up
        ray.get(group.burst.remote(16, batched))
    rows = {False: [], True: []}
    for _ in range(args.repeats):
        for batched in (False, True):
            c0, t0 = ray.get(rank.cpu_s.remote()), time.perf_counter()
            calls = ray.get(group.burst.remote(args.requests, batched))
            wall = time.perf_counter() - t0
            rows[batched].append({"wall_ms": round(1e3 * wall, 1),
                                  "rank_cpu_ms": round(1e3 * (ray.get(rank.cpu_s.remote()) - c0), 1),
                                  "calls": calls})
    out = {"machine": machine(), "requests": args.requests,
           "one_call_per_request": rows[False], "call_batcher": rows[True],
           "median_rank_cpu_ms": {"one_call_per_request": statistics.median(r["rank_cpu_ms"] for r in rows[False]),
                                  "call_batcher": statistics.median(r["rank_cpu_ms"] for r in rows[True])}}
    write_json(out, args.out)
    ray.shutdown()


if __name__ == "__main__":
    main()
