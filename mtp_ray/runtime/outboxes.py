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
class Reader:
    """One reader's messages and the condition its long poll waits on (over the outboxes' one lock): a step wakes
    only the readers it has messages for, not every puller in the rank process."""

    wake: threading.Condition
    seen: float  # when it last pulled (or its first request arrived)
    msgs: list[bytes] = field(default_factory=list)
    rids: set[str] = field(default_factory=set)


class Outboxes:
    # a live subscriber pulls at least every second while it has requests here (serve/cluster/delivery.py: PULL_S); one
    # silent for 10 s is gone (a dead replica's requests ran 30 s for nobody before)
    def __init__(self, expire_s: float = 10.0):
        self.lock = threading.Lock()
        self.expire_s = expire_s
        self.group = Reader(threading.Condition(self.lock), time.monotonic())
        self.subs: dict[str, Reader] = {}
        self.sub_of: dict[str, str] = {}  # request id -> its subscriber (requests of the group's own are absent)

    def _reader(self, name: str) -> Reader:
        """(lock held) The group, or a subscriber (made on first sight)."""
        if name == GROUP:
            return self.group
        sub = self.subs.get(name)
        if sub is None:
            sub = self.subs[name] = Reader(threading.Condition(self.lock), time.monotonic())
        return sub

    def route(self, rid: str, subscriber: str) -> None:
        """Before the request can produce output (engine thread, when it is added). A new request is news of its
        subscriber: an idle one's last pull may be near expire_s old, and its first pull for this request is yet to
        come (it was dropped meanwhile, with the new request aborted)."""
        if subscriber == GROUP:
            return
        with self.lock:
            sub = self._reader(subscriber)
            sub.rids.add(rid)
            sub.seen = max(sub.seen, time.monotonic())
            self.sub_of[rid] = subscriber

    def publish(self, step: int, outs: list[StepOutput]) -> None:
        """One step's outputs: one message per reader that has any. The group's end notices of subscribed requests
        do not wake its poll (it returns within its timeout anyway, and needs them only for its load counts)."""
        if not self.sub_of:  # nobody subscribed: everything is the group's
            msg = pack_step(step, outs)
            with self.lock:
                self.group.msgs.append(msg)
                self.group.wake.notify_all()
            return
        mine: list[StepOutput] = []
        own = False  # outputs of the group's own requests (not only end notices): wake its poll
        theirs: dict[str, list[StepOutput]] = {}
        with self.lock:
            for o in outs:
                name = self.sub_of.get(o.request_id)
                if name is None:
                    mine.append(o)
                    own = True
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
        with self.lock:
            for name, msg in packed.items():
                sub = self.subs.get(name)
                if sub is not None:
                    sub.msgs.append(msg)
                    sub.wake.notify_all()
            if group is not None:
                self.group.msgs.append(group)
                if own:
                    self.group.wake.notify_all()

    def take(self, name: str, timeout: float, stop: Callable[[], bool]) -> list[bytes]:
        """Long poll: the reader's messages, waiting up to `timeout` for the first one (or until `stop()`: call
        `wake_all` after setting what it reads)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            r = self._reader(name)
            while not r.msgs and not stop() and time.monotonic() < deadline:
                r.seen = time.monotonic()
                r.wake.wait(max(0.0, deadline - time.monotonic()))
            r.seen = time.monotonic()
            msgs, r.msgs = r.msgs, []
            return msgs

    def wake_all(self) -> None:
        """Every waiting reader re-checks its stop condition (the rank failed or is stopping)."""
        with self.lock:
            for r in (self.group, *self.subs.values()):
                r.wake.notify_all()

    def expire(self) -> list[str]:
        """Drop the subscribers that stopped pulling; returns their requests (to abort)."""
        now, gone = time.monotonic(), []
        with self.lock:
            for name, sub in list(self.subs.items()):
                if now - sub.seen > self.expire_s:
                    gone += sub.rids
                    sub.wake.notify_all()
                    del self.subs[name]
        return gone

    def subscribers(self) -> dict[str, int]:
        """Requests in flight per subscriber (health)."""
        with self.lock:
            return {name: len(sub.rids) for name, sub in self.subs.items()}
