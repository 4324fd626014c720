"""MetricsHub: one small actor per application that every engine group and every ingress replica reports to about
once a second, so that /metrics shows all of them, whichever ingress replica answers the scrape (Serve routes a
scrape to any one of them, and a group's own health call to any one group: counters went backwards between
scrapes). A reporter that stops reporting (its replica was replaced or scaled away) is retired after `stale_s`:
its counters stay in the totals, so every total is monotonic."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import ray

NAMESPACE = "mtp_ray"


class MetricsHub:
    def __init__(self, stale_s: float = 15.0):
        self.stale_s = stale_s
        self.live: dict[str, dict[str, dict]] = {"group": {}, "ingress": {}}  # kind -> reporter id -> its report
        self.seen: dict[tuple[str, str], float] = {}
        self.retired: dict[str, dict[str, float]] = {"group": defaultdict(float), "ingress": defaultdict(float)}

    def report(self, kind: str, reporter: str, snapshot: dict[str, Any]) -> None:
        """snapshot["totals"]: the reporter's monotonic counters (name -> value); the rest is shown as it is."""
        self.live[kind][reporter] = snapshot
        self.seen[(kind, reporter)] = time.monotonic()

    def retire(self, kind: str, reporter: str) -> None:
        snap = self.live[kind].pop(reporter, None)
        self.seen.pop((kind, reporter), None)
        if snap is not None:
            for name, v in snap.get("totals", {}).items():
                self.retired[kind][name] += v

    def view(self) -> dict[str, Any]:
        now = time.monotonic()
        for (kind, reporter), t in list(self.seen.items()):
            if now - t > self.stale_s:
                self.retire(kind, reporter)
        return {"live": self.live, "retired": {k: dict(v) for k, v in self.retired.items()}}


def hub_for(app_name: str):
    """The application's hub (created by whoever asks first; detached, so replacing any replica keeps it)."""
    return ray.remote(MetricsHub).options(name=f"hub_{app_name}", namespace=NAMESPACE, get_if_exists=True,
                                          lifetime="detached", num_cpus=0).remote()
