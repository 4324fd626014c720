"""StepProfiler: cProfile over a rank's next N engine steps, on demand, split into graph-replay and eager steps;
optionally torch.profiler over the same steps for the device kernels (on a GPU: NCCL inside the graphs included).

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

from mtp_ray.engine.stats import EngineStats


class _Core(Protocol):
    stats: EngineStats

    def step(self, next_cmd: int = 0) -> list: ...


class StepProfiler:
    def __init__(self) -> None:
        self.left = 0
        self.stats: dict[str, pstats.Stats] = {}
        self.counts: dict[str, int] = {}
        self.result: dict | None = None
        self.done = threading.Event()
        self.device = False
        self.tprof = None  # torch.profiler.profile over all the profiled steps (device=True)

    def start(self, steps: int, device: bool = False) -> None:
        assert steps > 0, "steps must be > 0"
        self.stats, self.counts, self.result, self.device, self.tprof = {}, {}, None, device, None
        self.done.clear()
        self.left = steps  # last: the engine thread starts profiling once this is set

    def run(self, core: _Core, next_cmd: int = 0) -> list:
        """One engine step (engine thread; next_cmd: EngineCore.step's), profiled while steps are left."""
        if not self.left:
            return core.step(next_cmd)
        if self.device and self.tprof is None:
            self.tprof = _torch_profiler()
            self.tprof.start()
        graphs, prof = core.stats.graph_steps, cProfile.Profile()
        prof.enable()
        try:
            return core.step(next_cmd)
        finally:
            prof.disable()
            kind = "graph" if core.stats.graph_steps > graphs else "eager"
            if kind in self.stats:
                self.stats[kind].add(prof)
            else:
                self.stats[kind] = pstats.Stats(prof)
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.left -= 1
            if not self.left:
                self.result = {kind: summary(st, self.counts[kind]) for kind, st in self.stats.items()}
                if self.tprof is not None:
                    self.result["device"] = device_summary(self.tprof, sum(self.counts.values()))
                self.done.set()


def _torch_profiler():
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


def device_summary(tprof, steps: int, top: int = 30) -> dict:
    """The heaviest device kernels (self time) per step; on the CPU the heaviest host ops instead."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    tprof.stop()
    ev = tprof.key_averages()
    dev = [e for e in ev if getattr(e, "self_device_time_total", 0) > 0]
    key = (lambda e: e.self_device_time_total) if dev else (lambda e: e.self_cpu_time_total)
    rows = sorted(dev or ev, key=key, reverse=True)[:top]
    return {"steps": steps, "on": "device" if dev else "host",
            "busy_ms_per_step": round(sum(key(e) for e in (dev or ev)) / 1e3 / steps, 3),
            "ops": [{"name": e.key[:90], "us_per_step": round(key(e) / steps, 2),
                     "count_per_step": round(e.count / steps, 2)} for e in rows]}


def summary(st: pstats.Stats, steps: int, top: int = 30) -> dict:
    """The heaviest functions by own time: ms per step, cumulative ms per step, calls per step."""
    rows = sorted(((v[2], v[3], v[1], f"{Path(fn[0]).name}:{fn[1]}:{fn[2]}") for fn, v in st.stats.items()),
                  reverse=True)[:top]
    return {"steps": steps, "step_ms": round(1e3 * st.total_tt / steps, 3), "functions": [
        {"fn": r[3], "own_ms_per_step": round(1e3 * r[0] / steps, 4), "cum_ms_per_step": round(1e3 * r[1] / steps, 4),
         "calls_per_step": round(r[2] / steps, 2)} for r in rows]}
