"""MetricsHub: one small actor per application that every engine group and every ingress replica reports to about
once a second, so that /metrics shows all of them, whichever ingress replica answers the scrape (Serve routes a
scrape to any one of them, and a group's own health call to any one group: counters went backwards between
scrapes). A reporter that stops reporting (its replica was replaced or scaled away) is retired after `stale_s`:
its counters stay in the totals, so every total is monotonic."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

from mtp_ray.runtime.batcher import detached

NAMESPACE = "mtp_ray"
log = logging.getLogger("mtp_ray.metrics")


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
    """The application's hub (created by whoever asks first; detached, so replacing any replica keeps it). Outside
    any placement group: a group replica's children are captured into its placement group, and the hub would die
    with that group when Serve replaces it (every counter it held lost: /metrics going backwards)."""
    return ray.remote(MetricsHub).options(name=f"hub_{app_name}", namespace=NAMESPACE, get_if_exists=True,
                                          lifetime="detached", num_cpus=0, scheduling_strategy="DEFAULT").remote()


class HubReporter:
    """Sends `snapshot()` to the application's hub once a second from a detached task (an ingress replica, a
    group replica), started on the first `start()` (a Serve replica's event loop must be running)."""

    def __init__(self, kind: str, reporter: str, snapshot: Callable[[], dict[str, Any]]):
        self.kind, self.reporter, self.snapshot = kind, reporter, snapshot
        self.hub = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self.hub = hub_for(serve.get_replica_context().app_name)
            self._task = detached(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                await self.hub.report.remote(self.kind, self.reporter, self.snapshot())
            except Exception as e:  # the hub is being recreated: the next report goes to the new one
                log.warning("metrics report to the hub failed: %s", e)
                self.hub = hub_for(serve.get_replica_context().app_name)
            await asyncio.sleep(1.0)
