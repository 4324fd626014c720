"""Commands for every engine group of the application: the admin routes (vLLM's /sleep, /wake_up, /is_sleeping,
/reset_prefix_cache; SGLang's /flush_cache, /release_memory_occupation, /resume_memory_occupation) act on the
whole server, and a Serve handle call reaches one replica. So an ingress posts the command on the application's hub
(serve/cluster/metrics_hub.py, a CommandBoard), each group that reported lately takes it with its next report (about a
second later: HubReporter), runs it and answers; the ingress waits for every answer (`broadcast`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from mtp_ray.serve.openai.errors import ApiError

COMMANDS = ("sleep", "wake_up", "reset_prefix_cache")
FRESH_S = 3.0  # a group is sent a command when it reported within this long (reports come once a second)
WAIT_S = 300.0  # an ingress waits this long for every group's answer (sleep level 1 copies weights to the host)


@dataclass
class Posted:
    name: str
    args: dict[str, Any]
    targets: tuple[str, ...]  # the groups that must answer
    t: float
    taken: set[str] = field(default_factory=set)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # group -> {"ok": bool, "error"?: str, ...}


class CommandBoard:
    """The hub's list of posted commands: each group takes each command meant for it once, and answers it."""

    def __init__(self, keep_s: float = 600.0):
        self.seq = 0
        self.posted: dict[int, Posted] = {}
        self.keep_s = keep_s  # a command is forgotten this long after it was posted

    def post(self, name: str, args: dict[str, Any], groups: Collection[str]) -> int:
        if name not in COMMANDS:
            raise ValueError(f"unknown group command {name!r}")
        now = time.monotonic()
        for seq in [s for s, p in self.posted.items() if now - p.t > self.keep_s]:
            del self.posted[seq]
        self.seq += 1
        self.posted[self.seq] = Posted(name, dict(args), tuple(sorted(groups)), now)
        return self.seq

    def take(self, group: str) -> list[dict[str, Any]]:
        """The commands meant for `group` that it has not taken yet, oldest first (marked taken)."""
        out = []
        for seq, p in self.posted.items():
            if group in p.targets and group not in p.taken:
                p.taken.add(group)
                out.append({"seq": seq, "name": p.name, "args": p.args})
        return out

    def answer(self, group: str, seq: int, result: dict[str, Any]) -> None:
        p = self.posted.get(seq)
        if p is not None and group in p.targets:
            p.results[group] = result

    def status(self, seq: int, live: Collection[str]) -> dict[str, Any]:
        """{"done", "results"}: a target that is no longer live (retired, replaced) and never answered counts as
        failed, so a caller never waits for a group that is gone."""
        p = self.posted.get(seq)
        if p is None:
            return {"done": True, "results": {}, "error": f"command {seq} is not known (expired)"}
        results = dict(p.results)
        for g in p.targets:
            if g not in results and g not in live:
                results[g] = {"ok": False, "error": "the group went away before it answered"}
        return {"done": len(results) == len(p.targets), "results": results}


async def broadcast(hub, name: str, args: dict[str, Any], wait_s: float = WAIT_S) -> dict[str, dict[str, Any]]:
    """Post a command for every group and wait for their answers -> group -> result. ApiError: 503 no group is up,
    504 no answer within wait_s, 500 a group failed it (each one named)."""
    posted = await hub.post_command.remote(name, args)
    if not posted["groups"]:
        raise ApiError(503, f"{name}: no engine group is up", headers={"Retry-After": "5"})
    deadline = time.monotonic() + wait_s
    while True:
        st = await hub.command_status.remote(posted["seq"])
        if st["done"]:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(posted["groups"]) - set(st["results"]))
            raise ApiError(504, f"{name}: no answer within {wait_s:g}s from engine group(s) {', '.join(missing)}")
        await asyncio.sleep(0.1)
    if "error" in st:
        raise ApiError(500, f"{name}: {st['error']}")
    failed = {g: r.get("error", "failed") for g, r in st["results"].items() if not r.get("ok")}
    if failed:
        raise ApiError(500, f"{name} failed on " + "; ".join(f"group {g}: {e}" for g, e in sorted(failed.items())))
    return st["results"]
