"""PhaseClock: where the host time of each engine step goes, summed per kind of step.

A step laps the clock after each of its phases (schedule, DPMeta gather, inputs, launch, resolve, commit); the
rank worker adds what it does around the step (inbox, publish). `get_stats` reports the sums per kind ("graph":
decode / verify graph replays, "mixed_graph": a general batch's token-bucket graph, "eager": eager forwards, "idle":
no rank had work), with the step count, wall and thread CPU
time: in a host-bound step wall - cpu is time the engine thread was blocked (the GIL held by other actor threads,
a device sync, a collective). A lap is one perf_counter call and a dict add: cheap enough to stay on.
"""

from __future__ import annotations

import time
from collections import defaultdict


class PhaseClock:
    def __init__(self) -> None:
        self.totals: dict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.kind = "idle"  # the kind of the step being timed (set by the step)
        self.last_kind = "idle"  # the kind of the last step closed (the worker's publish time goes there)
        self._laps: dict[str, float] = {}
        self._t = self._t0 = self._cpu0 = 0.0

    def begin(self) -> None:
        self._laps.clear()
        self.kind = "idle"
        self._t = self._t0 = time.perf_counter()
        self._cpu0 = time.thread_time()

    def lap(self, phase: str) -> None:
        t = time.perf_counter()
        self._laps[phase] = self._laps.get(phase, 0.0) + t - self._t
        self._t = t

    def close(self) -> None:
        tot = self.totals[self.kind]
        for phase, dt in self._laps.items():
            tot[phase] += dt
        tot["steps"] += 1
        tot["wall"] += time.perf_counter() - self._t0
        tot["cpu"] += time.thread_time() - self._cpu0
        self.last_kind = self.kind

    def add(self, phase: str, dt: float) -> None:
        """Time spent outside the step for it (the worker publishing its outputs)."""
        self.totals[self.last_kind][phase] += dt

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in self.totals.items()}
