"""MetricsHub: one small actor per application that every engine group and every ingress replica reports to about
once a second, so that /metrics shows all of them, whichever ingress replica answers the scrape (Serve routes a
scrape to any one of them, and a group's own health call to any one group: counters went backwards between
scrapes). A reporter that stops reporting (its replica was replaced or scaled away) is retired after `stale_s`:
its counters stay in the totals, so every total is monotonic. Within one deploy of the app: a new deploy (build_app
stamps its replicas with `deploy`) starts from zero, as a restarted vLLM does, and replicas of an earlier deploy are
not counted; the hub ends itself once nobody has reported for `idle_s` (the app was deleted: it outlived `serve
shutdown`, and the next app of the name showed the old totals). Through it an ingress also sends a command to every
group (serve/cluster/broadcast.py): the answer to a group's report carries the commands posted for it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray import serve

from mtp_ray.runtime.batcher import detached
from mtp_ray.serve.cluster.broadcast import FRESH_S, CommandBoard
from mtp_ray.serve.cluster.failures import cause_of, first_line

NAMESPACE = "mtp_ray"
log = logging.getLogger("mtp_ray.metrics")


class MetricsHub:
    def __init__(self, stale_s: float = 15.0, idle_s: float = 120.0, end: Callable[[], None] | None = None):
        self.stale_s = stale_s
        self.deploy = 0
        self.board = CommandBoard()
        self._reset()
        self.last = time.monotonic()  # the last report
        if end is not None:  # (the actor: end_this_actor)
            threading.Thread(target=self._watch, args=(idle_s, end), daemon=True).start()

    def _reset(self) -> None:
        self.live: dict[str, dict[str, dict]] = {"group": {}, "ingress": {}}  # kind -> reporter id -> its report
        self.seen: dict[tuple[str, str], float] = {}
        self.retired: dict[str, dict[str, float]] = {"group": defaultdict(float), "ingress": defaultdict(float)}

    @ray.method(enable_task_events=False)  # (every replica, once a second: no task record each in the GCS)
    def report(self, kind: str, reporter: str, snapshot: dict[str, Any], deploy: int = 0) -> list[dict[str, Any]]:
        """snapshot["totals"]: the reporter's monotonic counters (name -> value); the rest is shown as it is.
        Returns the commands posted for this reporter since its last report (groups only)."""
        if deploy < self.deploy:  # a replica of an earlier deploy of the app, still draining
            return []
        if deploy > self.deploy:  # the app was deployed again: its counters start from zero
            self.deploy = deploy
            self._reset()
        self.live[kind][reporter] = snapshot
        self.seen[(kind, reporter)] = self.last = time.monotonic()
        return self.board.take(reporter) if kind == "group" else []

    def post_command(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        """A command for every group that reported within FRESH_S -> {"seq", "groups"} (serve/cluster/broadcast.py)."""
        now = time.monotonic()
        groups = [g for g in self.live["group"] if now - self.seen.get(("group", g), 0.0) <= FRESH_S]
        return {"seq": self.board.post(name, args, groups) if groups else 0, "groups": groups}

    def answer_command(self, group: str, seq: int, result: dict[str, Any]) -> None:
        self.board.answer(group, seq, result)
        snap = self.live["group"].get(group)
        if snap is not None and "sleeping" in result:  # fresher than the group's last report: GET /is_sleeping
            snap.setdefault("gauges", {})["group_sleep_level"] = result["sleeping"]  # right after /sleep reads it

    def command_status(self, seq: int) -> dict[str, Any]:
        self.view()  # retires the groups that stopped reporting: they will not answer
        return self.board.status(seq, self.live["group"])

    def _watch(self, idle_s: float, end: Callable[[], None]) -> None:
        while time.monotonic() - self.last <= idle_s:
            time.sleep(min(5.0, idle_s / 4))
        log.info("metrics hub: no report for %.0f s, the app is gone; ending", idle_s)
        end()

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


def end_this_actor() -> None:
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def hub_for(app_name: str):
    """The application's hub (created by whoever asks first; detached, so replacing any replica keeps it). Outside
    any placement group: a group replica's children are captured into its placement group, and the hub would die
    with that group when Serve replaces it (every counter it held lost: /metrics going backwards)."""
    return ray.remote(MetricsHub).options(name=f"hub_{app_name}", namespace=NAMESPACE, get_if_exists=True,
                                          lifetime="detached", num_cpus=0, scheduling_strategy="DEFAULT"
                                          ).remote(end=end_this_actor)


class HubReporter:
    """Sends `snapshot()` to the application's hub once a second from a detached task (an ingress replica, a
    group replica), started on the first `start()` (a Serve replica's event loop must be running). A group's
    reporter runs the commands the hub hands back with `command(name, args)` and answers each one."""

    def __init__(self, kind: str, reporter: str, snapshot: Callable[[], dict[str, Any]], deploy: int = 0,
                 command: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]] | None = None):
        self.kind, self.reporter, self.snapshot, self.deploy = kind, reporter, snapshot, deploy
        self.command = command
        self.hub = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self.hub = hub_for(serve.get_replica_context().app_name)
            self._task = detached(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                posted = await self.hub.report.remote(self.kind, self.reporter, self.snapshot(), self.deploy)
                for cmd in posted or ():
                    detached(self._run(self.hub, cmd))
            except Exception as e:  # the hub is being recreated: the next report goes to the new one
                log.warning("metrics report to the hub failed: %s", e)
                self.hub = hub_for(serve.get_replica_context().app_name)
            await asyncio.sleep(1.0)

    async def _run(self, hub, cmd: dict[str, Any]) -> None:
        """One posted command, run and answered (its failure is the answer: the ingress names it)."""
        log.info("group %s: %s %s (posted for every group)", self.reporter, cmd["name"], cmd["args"])
        try:
            assert self.command is not None, "commands are posted for groups only"
            result = {"ok": True, **(await self.command(cmd["name"], cmd["args"]) or {})}
        except Exception as e:
            log.warning("group %s: %s failed: %s", self.reporter, cmd["name"], e)
            result = {"ok": False, "error": first_line(cause_of(e))}
        try:
            await hub.answer_command.remote(self.reporter, cmd["seq"], result)
        except Exception as e:  # the hub went away: the ingress waiting for it fails on its own
            log.warning("group %s: answering %s failed: %s", self.reporter, cmd["name"], e)
