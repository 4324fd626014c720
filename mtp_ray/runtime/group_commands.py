"""GroupCommands: the engine group's commands (sleep, wake_up, weight updates, ...), sent to every rank and run there
in lock-step at the same step (runtime/rank_commands.py), one at a time. It also owns admission while they run: new
requests are held while a command runs or while the group sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from mtp_ray.runtime.batcher import detached
from mtp_ray.runtime.messages import GroupCommand


class CommandedGroup(Protocol):
    """What the commands need of their group (runtime/group.py: EngineGroup)."""

    workers: list  # the ranks' actor handles (new ones after a restart)
    reqs: dict  # requests in flight (wait_in_flight: until there are none)

    async def wait_ready(self) -> None: ...


class GroupCommands:
    def __init__(self, group: CommandedGroup):
        self.group = group
        self.accepting = asyncio.Event()  # cleared: new requests wait (held, not refused)
        self.accepting.set()
        self._lock = asyncio.Lock()
        self._seq = 0
        self.sleeping = 0  # the sleep level the ranks are in (0: awake)
        self.asleep_policy = "wait"  # a request that arrives while asleep: "wait" for wake_up, or "fail"
        self.weights_updated = False  # a restart would reload the checkpoint: the group must not restart then
        self.paused = False  # pause_generation: held until resume_generation, whatever command runs meanwhile

    def hold(self) -> None:
        """New requests wait (they are not refused) until release()."""
        self.paused = True
        self.accepting.clear()

    def release(self) -> None:
        self.paused = False
        self._reopen()

    def _reopen(self) -> None:
        """New requests go on again unless the group sleeps or is paused (a command ends; wake_up; resume)."""
        if not self.sleeping and not self.paused:
            self.accepting.set()

    async def command(self, name: str, *args, wait_in_flight: bool = False,
                      then: Callable[[], None] | None = None) -> list:
        """Run a command on every rank (in lock-step there), then `then` (the group's own state); returns the
        per-rank results. All or nothing even when the caller is cancelled: the command runs in a task of its own
        (the caller's cancel is recursive in Ray and could drop the call to some ranks only, which would then wait
        for peers that never run it) and the caller only stops waiting for it."""
        return await asyncio.shield(detached(self._command(name, args, wait_in_flight, then)))

    async def _command(self, name: str, args: tuple, wait_in_flight: bool, then: Callable[[], None] | None) -> list:
        g = self.group
        await g.wait_ready()
        async with self._lock:
            self.accepting.clear()
            try:
                while wait_in_flight and g.reqs:
                    await asyncio.sleep(0.02)
                self._seq += 1
                cmd = GroupCommand(self._seq, name, args)
                res = await asyncio.gather(*[w.command.remote(cmd) for w in g.workers], return_exceptions=True)
            finally:
                self._reopen()
        for r, e in enumerate(res):
            if isinstance(e, BaseException):
                cause = e.cause if hasattr(e, "cause") and e.cause is not None else e
                msg = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
                raise (ValueError if isinstance(cause, ValueError) else RuntimeError)(f"{name} on rank {r}: {msg}")
        if then is not None:
            then()
        return list(res)

    async def restore(self, workers: list) -> None:
        """A restarted group's new ranks (awake, from the checkpoint) take the state the commands had left: asleep
        at the same level, so wake_up works and requests stay held (they hung: the group said asleep, the ranks
        were not, and wake_up was refused)."""
        if self.sleeping:
            self._seq += 1
            cmd = GroupCommand(self._seq, "sleep", (self.sleeping, "abort"))
            await asyncio.gather(*[w.command.remote(cmd) for w in workers])

    async def sleep(self, level: int = 1, in_flight: str = "abort") -> list:
        if level not in (1, 2) or isinstance(level, bool):  # here: the ranks abort what runs before they check
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if in_flight not in ("abort", "wait"):
            raise ValueError("in_flight must be 'abort' or 'wait'")

        def asleep() -> None:
            self.sleeping = level
            self.accepting.clear()

        return await self.command("sleep", level, in_flight, wait_in_flight=in_flight == "wait", then=asleep)

    async def wake_up(self) -> list:
        def awake() -> None:
            self.sleeping = 0
            self._reopen()

        return await self.command("wake_up", then=awake)

    async def update_weights(self, items) -> list:
        return await self.command("update_weights", items, wait_in_flight=True, then=self.mark_weights_updated)

    def mark_weights_updated(self) -> None:
        self.weights_updated = True
