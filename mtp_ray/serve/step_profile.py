"""StepProfiler: cProfile over a rank's next N engine steps, on demand, split into graph-replay and eager steps.

Wall-clock cProfile on the engine thread inside the rank actor, so time the thread spends waiting for the GIL
(other actor threads: Ray task execution, polls) shows up inside the calls that released it (torch ops, device
syncs): side by side with the same steps in-process (bench/profile_step.py), it shows what the actor costs a step.
"""

from __future__ import annotations

import cProfile
import pstats
import threading
from pathlib import Path
from typing import Protocol


class _Core(Protocol):
    stats: dict

    def step(self) -> list: ...


class StepProfiler:
    def __init__(self) -> None:
        self.left = 0
        self.stats: dict[str, pstats.Stats] = {}
        self.counts: dict[str, int] = {}
        self.result: dict | None = None
        self.done = threading.Event()

    def start(self, steps: int) -> None:
        assert steps > 0, "steps must be > 0"
        self.stats, self.counts, self.result = {}, {}, None
        self.done.clear()
        self.left = steps  # last: the engine thread starts profiling once this is set

    def run(self, core: _Core) -> list:
        """One engine step (engine thread), profiled while steps are left."""
        if not self.left:
            return core.step()
        graphs, prof = core.stats.get("graph_steps", 0), cProfile.Profile()
        prof.enable()
        try:
            return core.step()
        finally:
            prof.disable()
            kind = "graph" if core.stats.get("graph_steps", 0) > graphs else "eager"
            if kind in self.stats:
                self.stats[kind].add(prof)
            else:
                self.stats[kind] = pstats.Stats(prof)
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.left -= 1
            if not self.left:
                self.result = {kind: summary(st, self.counts[kind]) for kind, st in self.stats.items()}
                self.done.set()


def summary(st: pstats.Stats, steps: int, top: int = 30) -> dict:
    """The heaviest functions by own time: ms per step, cumulative ms per step, calls per step."""
    rows = sorted(((v[2], v[3], v[1], f"{Path(fn[0]).name}:{fn[1]}:{fn[2]}") for fn, v in st.stats.items()),
                  reverse=True)[:top]
    return {"steps": steps, "step_ms": round(1e3 * st.total_tt / steps, 3), "functions": [
        {"fn": r[3], "own_ms_per_step": round(1e3 * r[0] / steps, 4), "cum_ms_per_step": round(1e3 * r[1] / steps, 4),
         "calls_per_step": round(r[2] / steps, 2)} for r in rows]}
