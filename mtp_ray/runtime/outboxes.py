"""Outboxes: where a rank's per-step outputs wait for whoever reads them (docs/design.md, "Streams").

A request added with a subscriber (an HTTP ingress replica) has its outputs packed for that subscriber, who
long-polls the rank itself (`RankWorker.pull`): the token stream goes rank -> ingress in one message per step and
subscriber, and the group replica (admission, health, load) is not on the per-token path. Every other request's
outputs go to the group's own poll, as before. The group still hears when a subscribed request ends (a bare
finished StepOutput), so its per-rank load stays right.

A subscriber that has not pulled for `expire_s` (its replica died or was scaled away) is dropped: its requests are
aborted (the caller runs the aborts), and later outputs for them are discarded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.runtime.messages import pack_step

GROUP = ""  # the group's poll


@dataclass
class Subscriber:
    seen: float  # when it last pulled (or its first request arrived)
    msgs: list[bytes] = field(default_factory=list)
    rids: set[str] = field(default_factory=set)


class Outboxes:
    def __init__(self, cond: threading.Condition, expire_s: float = 30.0):
        self.cond = cond  # the worker's: its waiters also wake on errors and on stop
        self.expire_s = expire_s
        self.group: list[bytes] = []
        self.subs: dict[str, Subscriber] = {}
        self.sub_of: dict[str, str] = {}  # request id -> its subscriber (requests of the group's own are absent)

    def route(self, rid: str, subscriber: str) -> None:
        """Before the request can produce output (engine thread, when it is added)."""
        if subscriber == GROUP:
            return
        with self.cond:
            sub = self.subs.get(subscriber)
            if sub is None:
                sub = self.subs[subscriber] = Subscriber(time.monotonic())
            sub.rids.add(rid)
            self.sub_of[rid] = subscriber

    def publish(self, step: int, outs: list[StepOutput]) -> None:
        """One step's outputs: one message per reader that has any."""
        if not self.sub_of:  # nobody subscribed: everything is the group's
            msg = pack_step(step, outs)
            with self.cond:
                self.group.append(msg)
                self.cond.notify_all()
            return
        mine: list[StepOutput] = []
        theirs: dict[str, list[StepOutput]] = {}
        with self.cond:
            for o in outs:
                name = self.sub_of.get(o.request_id)
                if name is None:
                    mine.append(o)
                    continue
                if name in self.subs:
                    theirs.setdefault(name, []).append(o)
                if o.finished:  # the group releases its load on this rank
                    mine.append(StepOutput(o.request_id, [], [], [], True, o.finish_reason))
                    del self.sub_of[o.request_id]
                    if name in self.subs:
                        self.subs[name].rids.discard(o.request_id)
        packed = {name: pack_step(step, rows) for name, rows in theirs.items()}
        group = pack_step(step, mine) if mine else None
        with self.cond:
            for name, msg in packed.items():
                if name in self.subs:
                    self.subs[name].msgs.append(msg)
            if group is not None:
                self.group.append(group)
            self.cond.notify_all()

    def take(self, subscriber: str, timeout: float, stop: Callable[[], bool]) -> list[bytes]:
        """Long poll: the reader's messages, waiting up to `timeout` for the first one (or until `stop()`)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            if subscriber == GROUP:
                while not self.group and not stop() and time.monotonic() < deadline:
                    self.cond.wait(max(0.0, deadline - time.monotonic()))
                msgs, self.group = self.group, []
                return msgs
            sub = self.subs.get(subscriber)
            if sub is None:
                sub = self.subs[subscriber] = Subscriber(time.monotonic())
            while not sub.msgs and not stop() and time.monotonic() < deadline:
                sub.seen = time.monotonic()
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            sub.seen = time.monotonic()
            msgs, sub.msgs = sub.msgs, []
            return msgs

    def expire(self) -> list[str]:
        """Drop the subscribers that stopped pulling; returns their requests (to abort)."""
        now, gone = time.monotonic(), []
        with self.cond:
            for name, sub in list(self.subs.items()):
                if now - sub.seen > self.expire_s:
                    gone += sub.rids
                    del self.subs[name]
        return gone

    def subscribers(self) -> dict[str, int]:
        """Requests in flight per subscriber (health)."""
        with self.cond:
            return {name: len(sub.rids) for name, sub in self.subs.items()}
