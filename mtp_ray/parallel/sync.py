"""Step synchronisation: how an engine agrees with its peers before each forward.

LocalSync (one rank): no gather; a step with no work is skipped, drafts run only for sequences that want them.
DPSync (a DP x EP group): one DPMeta all-gather before every target forward; the gathered table is set as the
forward context (read by the EP dispatcher) and cleared after the forward. Every rank runs the target forward (a
dummy one if it has no work) whenever any rank has work, and then exactly k draft forwards. The target gather
covers the draft forwards too (docs/design.md, rule 1, speed): their tables are derived from it, the same on every
rank (target EP mode; low-latency capacity from bounds on the draft token counts), and the collective counters they
move are compared at the next gather. `draft_gathers=True` gathers before every draft forward as well (exact mode).

Callers pair each agreement with its forward through the context managers of `Sync`: the table is the forward
context inside the `with` block and cleared when it ends, however the forward ends.

Waves (rule 5): `wave` counts the waves this rank has finished. Every rank ends a wave at the same step (the gathered
table shows no work anywhere), so the counter is the same on every rank; it goes into every DPMeta and the gather
checks it, so a rank that stepped into another wave is a lock-step error naming it rather than a hang.

Steps: `step` counts the serving steps this rank has ended. Each EngineCore.step ends here (`end_step`; a lock-step
step is one target gather on every rank), so the counter is the same on every rank; it goes into every DPMeta (the
step's own number: the steps ended before it) and the gather checks it. Warmup steps (`uncounted`) leave it where it
was.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from mtp_ray.parallel.context import DistContext
from mtp_ray.parallel.dp_meta import DPMeta, Gathered, draft_tables, pinned_ll_max_tokens


class Sync(ABC):
    """The forward-pairing context managers over a sync's target / draft / graph_drafts and done, and the wave and
    step counters."""

    def __init__(self) -> None:
        self.wave = 0  # waves finished, the same on every rank (end_wave)
        self._steps = 0  # serving steps ended, the same on every rank (end_step)
        self._counting = True  # False inside `uncounted` (warmup)

    @property
    def step(self) -> int:
        """Serving steps ended: inside a step, its number (carried by its DPMeta); after it, what its outputs are
        published with (runtime/worker.py)."""
        return self._steps

    def end_step(self) -> None:
        """The engine's step ended (EngineCore.step, not when it raised): the counter moves on, on every rank at
        the same step."""
        if self._counting:
            self._steps += 1

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Steps that are not serving steps (warmup, at start and on wake_up): every rank runs the same ones, and
        the counter stays where it was."""
        self._counting = False
        try:
            yield
        finally:
            self._counting = True

    @contextmanager
    def agree(self, local: DPMeta, graph_sizes: tuple[int, ...] = ()) -> Iterator[Gathered | None]:
        """The target forward's agreement: the gathered table (None: no rank has work, no forward), set as the
        forward context for the block."""
        table = self.target(local, graph_sizes)
        try:
            yield table
        finally:
            self.done()

    @contextmanager
    def drafting(self, local: DPMeta) -> Iterator[Gathered]:
        """One eager draft forward's table (derived from the target's, or gathered in exact mode)."""
        table = self.draft(local)
        try:
            yield table
        finally:
            self.done()

    @contextmanager
    def draft_graph(self, table: Gathered) -> Iterator[None]:
        """The draft loop replayed as one graph under the target step's table."""
        self.graph_drafts(table)
        try:
            yield
        finally:
            self.done()

    def end_wave(self) -> None:
        self.wave += 1

    @abstractmethod
    def target(self, local: DPMeta, graph_sizes: tuple[int, ...] = ()) -> Gathered | None: ...

    @abstractmethod
    def draft(self, local: DPMeta) -> Gathered: ...

    @abstractmethod
    def graph_drafts(self, table: Gathered) -> None: ...

    @abstractmethod
    def done(self) -> None: ...


class LocalSync(Sync):
    lockstep = False
    single_rank = True  # no peer: nothing collective in any forward

    def prefill_turn(self) -> bool | None:
        return None  # one rank: the scheduler alternates on its own

    def target(self, local: DPMeta, graph_sizes: tuple[int, ...] = ()) -> Gathered | None:
        if local.is_dummy:
            return None
        return Gathered((local,)).with_graph_size(graph_sizes)

    def draft(self, local: DPMeta) -> Gathered:
        return Gathered((local,))

    def graph_drafts(self, table: Gathered) -> None:
        pass

    def barrier(self) -> None:
        pass

    def done(self) -> None:
        pass


class DPSync(Sync):
    lockstep = True

    def __init__(self, ctx: DistContext, draft_gathers: bool = False, group_turns: bool = True,
                 ll_max_tokens: int = 0):
        super().__init__()
        self.ctx = ctx
        self.ll_max_tokens = ll_max_tokens  # the EP backend's low-latency capacity per rank (0: unbounded)
        self.draft_gathers, self.group_turns = draft_gathers, group_turns
        self.draft_tables: tuple[Gathered, Gathered] | None = None  # derived from the target gather: step 1, 2..k
        self.last_turn_prefill = False  # split scheduling: the group's previous turn
        self.last: Gathered | None = None  # the last gathered table (fault reports)
        self.step_table: Gathered | None = None  # the target gather of the last step (wave / command decisions)
        self.target_decode = False
        # per-rank counters for operators and tests; mixed_steps: target steps where, across the group, one rank
        # held a non-last prefill chunk, another decoded and a third was idle
        self.counters = {"gathers": 0, "forwards": 0, "dummy_forwards": 0, "chunk_steps": 0, "decode_steps": 0,
                         "mixed_steps": 0, "waves": 0, "graph_steps": 0, "graph_draft_loops": 0,
                         "uniform_group_steps": 0}
        self.timers = {"gather_s": 0.0, "forward_s": 0.0, "dummy_forward_s": 0.0}
        self._t0 = 0.0
        self._dummy = False

    @property
    def single_rank(self) -> bool:
        """A group of one: no EP exchange (local dispatch), so no forward's EP mode has to match a peer's."""
        return self.ctx.world == 1

    def prefill_turn(self) -> bool | None:
        """The split-scheduling turn of the coming step, the same on every rank: from the last gathered table."""
        if self.step_table is None or not self.group_turns:
            return None
        turn = self.step_table.next_prefill_turn(self.last_turn_prefill)
        self.last_turn_prefill = bool(turn)
        return turn

    def _gather(self, local: DPMeta, forward_idx: int) -> Gathered:
        local.wave, local.step, local.forward_idx = self.wave, self.step, forward_idx
        t0 = time.perf_counter()
        g = self.ctx.gather(local)
        self._t0 = time.perf_counter()
        self.timers["gather_s"] += self._t0 - t0
        self.counters["gathers"] += 1
        self.last = g
        self._dummy = bool(local.is_dummy)
        return g

    def target(self, local: DPMeta, graph_sizes: tuple[int, ...] = ()) -> Gathered | None:
        g = replace(self._gather(local, 0), ll_max_tokens=self.ll_max_tokens).with_graph_size(graph_sizes)
        self.step_table = g
        if g.all_dummy:
            return None  # nobody has work: every rank skips this step
        self.target_decode = g.global_decode
        self.draft_tables = draft_tables(g)
        self.ctx.set_forward(g)
        c = self.counters
        c["forwards"] += 1
        c["dummy_forwards"] += local.is_dummy
        c["chunk_steps"] += local.is_chunk
        c["decode_steps"] += local.is_decoding
        c["graph_steps"] += int(g.graph_size > 0)
        # every rank a uniform decode batch or idle: the steps a CUDA graph can take (counted on CPU too)
        c["uniform_group_steps"] += int(g.global_decode and all(m.graph_ok for m in g.ranks))
        c["mixed_steps"] += int(any(m.is_chunk for m in g.ranks) and any(m.is_decoding for m in g.ranks)
                                and any(m.is_dummy for m in g.ranks))
        return g

    def draft(self, local: DPMeta) -> Gathered:
        # rule 4: a draft forward keeps the target step's global decode state (and so its EP mode)
        local.is_decoding = int(self.target_decode)
        if self.draft_gathers:
            assert self.step_table is not None, "a draft forward before any target forward"
            g = replace(self._gather(local, local.forward_idx), ll_max_tokens=pinned_ll_max_tokens(self.step_table))
            if g.global_decode != self.target_decode and not g.all_dummy:
                # cannot differ when every rank follows the rule; checked so a broken rank cannot flip modes
                raise RuntimeError(f"draft forward changed the global decode state\n{g.describe()}")
        else:
            assert self.draft_tables is not None, "a draft forward before any target forward"
            g = self.draft_tables[0 if local.forward_idx <= 1 else 1]
            self._t0, self._dummy = time.perf_counter(), bool(local.is_dummy)
        self.ctx.set_forward(g)
        self.counters["forwards"] += 1
        self.counters["dummy_forwards"] += local.is_dummy
        return g

    def end_wave(self) -> None:
        super().end_wave()
        self.counters["waves"] += 1

    def barrier(self) -> None:
        """Graph captures: every rank starts (and ends) a capture together, so collectives inside line up."""
        self.ctx.barrier()

    def graph_drafts(self, table: Gathered) -> None:
        """The draft loop as one graph: no gather (every rank decided it from the target table), which stays
        the forward context so a capture sees the graph's EP mode and padding."""
        self.ctx.set_forward(table)
        self._t0 = time.perf_counter()
        self.counters["forwards"] += 1
        self.counters["graph_draft_loops"] += 1

    def done(self) -> None:
        if self.ctx.forward is not None:
            dt = time.perf_counter() - self._t0
            self.timers["dummy_forward_s" if self._dummy else "forward_s"] += dt
        self.ctx.forward = None
