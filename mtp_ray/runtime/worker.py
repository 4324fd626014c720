"""RankWorker: the Ray actor of one DP rank. It owns an EngineCore over its EP shard and runs the lock-step engine
loop in a thread of its own; actor methods only queue work and hand out batched per-step outputs.

Waves: ranks step together while any rank has work and stop together when the gathered DPMeta says nobody has
(the table is identical everywhere, so every rank ends the same wave at the same step). A rank that has work
while idle starts wave `self.wave` on itself and asks its peers to start the same wave; a start request for a
wave that already ran is ignored, one for a wave not yet reached is kept until the rank gets there.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from mtp_ray.config.engine import EngineConfig
from mtp_ray.engine.core import EngineCore
from mtp_ray.engine.outputs import StepOutput
from mtp_ray.parallel.context import DistContext, free_port
from mtp_ray.runtime.messages import AbortRequest, AddRequest, GroupCommand
from mtp_ray.runtime.outboxes import GROUP, Outboxes
from mtp_ray.runtime.rank_commands import RankCommands
from mtp_ray.runtime.rank_setup import join_and_build
from mtp_ray.runtime.stalls import StallMonitor
from mtp_ray.runtime.step_profile import StepProfiler

log = logging.getLogger("mtp_ray.rank")


@dataclass
class PendingCommand:
    """A group command this rank holds until every rank has it (DPMeta.next_cmd), then runs at the same step."""

    cmd: GroupCommand
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class RankWorker:
    def __init__(self, cfg: EngineConfig, rank: int, world: int):
        torch.set_num_threads(cfg.parallel.threads_per_rank)
        self.cfg, self.rank, self.world = cfg, rank, world
        self.inbox: queue.Queue[AddRequest | AbortRequest] = queue.Queue()
        self.cond = threading.Condition()
        self.outboxes = Outboxes()  # step outputs for the group's poll and for subscribers' pulls
        self.start_wanted = -1  # highest wave index some rank asked to start
        self.running = False
        self.waves_s, self.wave_t0 = 0.0, 0.0  # wall time in waves (stepping, or between steps of a wave)
        self.error: str | None = None
        self.group_failure: str | None = None  # the group failed elsewhere (another rank): why, for subscribers
        self.stopped = False
        self.peers: list = []
        # group commands (sleep, wake_up, weight updates): run on every rank at the same step, in order
        self.cmds: list[PendingCommand] = []
        self.commands: RankCommands | None = None
        self.core: EngineCore | None = None
        self.ctx: DistContext | None = None
        self.profiler = StepProfiler()
        self.stalls = StallMonitor()
        self.last_add = 0.0
        # aborts this rank received, and those naming no request it holds (already finished, or never added)
        self.aborts = {"received": 0, "unknown": 0}
        # ids of those unknown aborts, newest last: a request cancelled while its add was in flight may have its abort
        # run first (this actor runs calls on several threads, in no set order); its add is then dropped here
        self.early_aborts: dict[str, None] = {}

    @property
    def wave(self) -> int:
        """Waves finished, the same on every rank: the sync's counter, which every DPMeta carries and the gather
        checks (docs/design.md, rule 5)."""
        return self.core.sync.wave if self.core is not None else 0

    # ---- set-up ----
    def rendezvous_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def init(self, addr: str, port: int, peers: list) -> dict:
        """Join the collective group, load this rank's experts, warm up in lock-step, start the loop."""
        self.ctx, self.core, expert_range, device = join_and_build(self.cfg, self.rank, self.world, addr, port)
        self.peers = [p for i, p in enumerate(peers) if i != self.rank]
        self.commands = RankCommands(self.core, self.ctx, self.rank)
        self.stalls.install()
        self.ctx.barrier()
        t0 = time.perf_counter()
        self.core.warmup()
        self.ctx.barrier()
        warmup_s = time.perf_counter() - t0
        log.info("rank %d: warmup %s (engine.warmup) took %.1f s", self.rank, self.cfg.warmup, warmup_s)
        gc.collect()
        gc.freeze()  # the model, caches and kernels stay out of every later collection (StallMonitor)
        threading.Thread(target=self._loop, name=f"rank{self.rank}-engine", daemon=True).start()
        return {"rank": self.rank, "pid": os.getpid(), "experts": expert_range, "device": str(device),
                "max_model_len": self.core.max_model_len, "num_blocks": self.core.runner.cache_shape.num_blocks,
                "warmup_s": round(warmup_s, 2)}

    # ---- requests (any thread) ----
    def add_many(self, items: list[AddRequest]) -> None:
        """New requests, in arrival order (validated by the group at admission): one actor call for a burst."""
        for item in items:
            self.inbox.put(item)
        self.last_add = time.monotonic()  # when the latest request reached this rank (system-wide clock)
        self._want_wave(None)

    def abort(self, request_id: str) -> None:
        self.aborts["received"] += 1
        self.inbox.put(AbortRequest(request_id))
        self._want_wave(None)

    def start_wave(self, wave: int) -> None:
        self._want_wave(wave)

    def _want_wave(self, wave: int | None) -> None:
        with self.cond:
            self.start_wanted = max(self.start_wanted, self.wave if wave is None else wave)
            self.cond.notify_all()

    def command(self, cmd: GroupCommand) -> Any:
        """Queue a group command; returns (or raises) once this rank ran it in lock-step with the others."""
        pending = PendingCommand(cmd)
        with self.cond:
            self.cmds.append(pending)
            self.start_wanted = max(self.start_wanted, self.wave)
            self.cond.notify_all()
        while not pending.done.wait(1.0):
            if self.error:
                raise RuntimeError(self.error)
            if self.stopped:
                raise RuntimeError(f"rank {self.rank} stopped before running command {cmd.name}")
        if pending.error is not None:
            raise pending.error
        return pending.result

    # The long polls run several times a second per rank, busy or idle: Ray's record of each call (task events,
    # kept by the GCS up to 100k calls) grew the GCS by ~30 MB per 1,000 requests in a soak, 77 % of it these two.
    @ray.method(enable_task_events=False)
    def poll(self, timeout: float = 0.5) -> dict:
        """The group's long poll: every step message for it since the last poll, plus progress counters. Also
        drops subscribers that stopped pulling, aborting their requests."""
        for rid in self.outboxes.expire():
            log.warning("rank %d: aborting %s, its subscriber stopped pulling", self.rank, rid)
            self.abort(rid)
        msgs = self.outboxes.take(GROUP, timeout, lambda: bool(self.error))
        sync = self.core.sync if self.core else None
        return {"rank": self.rank, "msgs": msgs, "error": self.error, "wave": self.wave, "running": self.running,
                "step": sync.step if sync else 0, "counters": dict(sync.counters) if sync else {},
                "num_running": len(self.core.scheduler.running) if self.core else 0,
                "num_preemptions": self.core.scheduler.num_preemptions if self.core else 0,
                "kv_usage": self.core.blocks.usage() if self.core else 0.0,
                "prefix_cache": self.core.blocks.prefix_stats() if self.core else {},
                "num_waiting": len(self.core.scheduler.waiting) + self.inbox.qsize() if self.core else 0,
                "spec": self.core.stats.snapshot() if self.core else {}, "aborts": dict(self.aborts),
                "collectives": self.ctx.collectives if self.ctx else 0,
                "subscribers": self.outboxes.subscribers()}  # requests in flight per ingress replica pulling here

    @ray.method(enable_task_events=False)
    def pull(self, subscriber: str, timeout: float = 1.0) -> dict:
        """A subscriber's long poll (an ingress replica): the step messages of its requests since its last pull,
        and the rank's error once its engine failed."""
        msgs = self.outboxes.take(subscriber, timeout, lambda: bool(self.error or self.group_failure) or self.stopped)
        return {"rank": self.rank, "msgs": msgs, "error": self.group_failure or self.error, "stopped": self.stopped}

    def group_failed(self, cause: str) -> None:
        """The group failed and is about to kill this rank: its subscribers' pulls return the group's cause (they
        read "this rank is gone" instead, when it went first)."""
        self.group_failure = cause
        self.outboxes.wake_all()

    def stats(self) -> dict:
        core = self.core
        return {"rank": self.rank, **(core.stats.snapshot() if core else {}), **(core.sync.counters if core else {}),
                **(core.sync.timers if core else {}),
                "collectives": self.ctx.collectives if self.ctx else 0, "wave": self.wave,
                "phases": core.clock.snapshot() if core else {}, "process_cpu_s": time.process_time(),
                "waves_s": self.waves_s + (time.perf_counter() - self.wave_t0 if self.running else 0.0),
                "stalls": self.stalls.snapshot(), "last_add_monotonic": self.last_add,
                "prefix_cache": core.blocks.prefix_stats() if core else {},
                "num_preemptions": core.scheduler.num_preemptions if core else 0,
                "last_meta": self.ctx.local.describe() if self.ctx else ""}

    def profile_steps(self, steps: int, timeout: float = 120.0, device: bool = False) -> dict:
        """cProfile the engine thread over its next `steps` steps that run (send work meanwhile); returns the
        heaviest functions per step of each kind ("graph" replays, "eager"), with device=True also the heaviest
        device kernels ("device"), or raises if the steps did not run within `timeout` seconds."""
        if steps <= 0:
            raise ValueError(f"steps must be > 0, got {steps}")
        if self.profiler.left:
            raise ValueError(f"rank {self.rank}: a profile of {self.profiler.left} more steps is already running")
        self.profiler.start(steps, device)
        if not self.profiler.done.wait(timeout):
            self.profiler.left = 0  # stop profiling the steps that come later
            raise TimeoutError(f"rank {self.rank}: {steps - self.profiler.left} of {steps} steps ran in {timeout:.0f}s")
        return {"rank": self.rank, **self.profiler.result}

    def shutdown(self) -> None:
        self.stopped = True
        with self.cond:
            self.cond.notify_all()
        self.outboxes.wake_all()

    # ---- engine thread ----
    def _loop(self) -> None:
        core, sync = self.core, self.core.sync
        try:
            while not self.stopped:
                with self.cond:
                    while not self.stopped and self.start_wanted < self.wave:
                        self.cond.wait(1.0)
                if self.stopped:
                    return
                start = self.wave
                for p in self.peers:  # idempotent: peers already in this wave ignore it
                    p.start_wave.remote(start)
                self.running, self.wave_t0 = True, time.perf_counter()
                while True:
                    t0 = time.perf_counter()
                    self._drain_inbox()
                    with self.cond:
                        next_cmd = self.cmds[0].cmd.seq if self.cmds else 0
                    t1 = time.perf_counter()
                    outs = self.profiler.run(core, next_cmd)  # the sync counts the step (Sync.end_step)
                    t2 = time.perf_counter()
                    if outs:
                        self.outboxes.publish(sync.step, outs)
                    core.clock.add("inbox", t1 - t0)
                    core.clock.add("publish", time.perf_counter() - t2)
                    g = sync.step_table
                    if g is not None and g.command_ready:
                        self._run_command()
                    elif g is not None and g.all_dummy and not g.any_unfinished and not g.any_command:
                        break
                with self.cond:
                    self.running = False
                    self.waves_s += time.perf_counter() - self.wave_t0
                    sync.end_wave()
                    # work that arrived during the wave's last step (after its DPMeta was gathered) starts the next
                    # wave: requests in the inbox, and group commands (a command queued then would wait forever)
                    if not self.inbox.empty() or core.has_unfinished() or self.cmds:
                        self.start_wanted = max(self.start_wanted, self.wave)
        # a collective failed or timed out, a lock-step check fired, or a native library panicked (pyo3's
        # PanicException is a BaseException): the rank reports it and the group restarts, never a silent hang
        except BaseException as e:
            last = sync.last.describe() if sync.last is not None else "  (none)"
            self.error = (f"rank {self.rank} failed at wave {self.wave} step {sync.step}: {type(e).__name__}: {e}\n"
                          f"rank {self.rank} last DPMeta: {self.ctx.local.describe()}\n"
                          f"last gathered DPMeta:\n{last}")
            log.error("%s\n%s", self.error, traceback.format_exc())
            with self.cond:
                self.cond.notify_all()
            self.outboxes.wake_all()  # the pollers return the error now

    def _run_command(self) -> None:
        with self.cond:
            pending = self.cmds.pop(0)
        self.core.drain()  # a command sees every token committed and no step on the device (sleep frees caches)
        try:
            pending.result = self.commands.run(pending.cmd)
        except Exception as e:  # reported to the caller; the rank keeps serving
            log.warning("rank %d: command %s failed: %s", self.rank, pending.cmd.name, e)
            pending.error = e
        pending.done.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            step = self.core.sync.step
            if isinstance(item, AddRequest):
                rid = item.request_id
                self.outboxes.route(rid, item.subscriber)
                if rid in self.early_aborts or self.core.runner.asleep:
                    # aborted before it arrived, or it raced a sleep(in_flight="abort"): aborted as the requests
                    # in flight were (rather than refused with "asleep")
                    self.early_aborts.pop(rid, None)
                    self.outboxes.publish(step, [StepOutput(rid, [], [], [], True, "abort")])
                    continue
                try:
                    self.core.add_request(rid, item.prompt_ids, item.params)
                except ValueError as e:  # validated by the group already; never take the rank down
                    self.outboxes.publish(step, [StepOutput(rid, [], [], [], True, "error", error=str(e))])
            else:
                out = self.core.abort_request(item.request_id)
                if out is not None:
                    self.outboxes.publish(step, [out])
                else:
                    self.aborts["unknown"] += 1
                    self.early_aborts[item.request_id] = None
                    if len(self.early_aborts) > 4096:  # mostly requests that had finished: keep the newest only
                        del self.early_aborts[next(iter(self.early_aborts))]

