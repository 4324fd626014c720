"""Graph steps whose rows are all plain greedy: acceptance on the device, one small device -> host copy per step.

The target graph leaves each row's argmax and log-prob (and with k the accepted count) in a greedy block; with k the
draft loop follows in the same launch (the fused graph: engine/graphs.py) and appends the next drafts. Async
scheduling (k = 0; k > 0 with scheduler.async_verify): the copy is started and the step is committed by the next one,
after the next one is launched, so the host's work for step N + 1 (schedule, DPMeta gather, inputs) overlaps the
device's step N. A row of step N + 1 whose inputs depend on step N names its row of step N (`src`): k = 0 reads its
token from there; k > 0 moves its whole verify by that row's accepted count (engine/graph_ops.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mtp_ray.engine.graphs import Fetched
from mtp_ray.engine.mtp import MTPProposer
from mtp_ray.engine.outputs import OutputProcessor, StepOutput
from mtp_ray.engine.request import Request
from mtp_ray.engine.runner import ModelRunner
from mtp_ray.engine.scheduler import Scheduled
from mtp_ray.engine.stats import EngineStats
from mtp_ray.parallel.dp_meta import Gathered


@dataclass
class InFlight:
    """A device-greedy graph step whose results are still on the device."""

    reqs: list[Request]  # its live sequences
    rows: dict[int, int]  # id(request) -> its row (where the next step's rows of that sequence take their inputs)
    results: Fetched


class DeviceGreedy:
    def __init__(self, runner: ModelRunner, proposer: MTPProposer, out: OutputProcessor, stats: EngineStats,
                 async_steps: bool, async_verify: bool = False):
        self.runner, self.proposer, self.out, self.stats = runner, proposer, out, stats
        self.k = runner.k
        self.async_steps = async_steps and (self.k == 0 or async_verify)
        self.inflight: InFlight | None = None

    def can_follow(self, graph_size: int, plain: bool) -> bool:
        """Whether a step may launch on top of the one in flight. k = 0: any graph step (its rows take their token
        from the device; the host path reads the argmax like the device path). k > 0: only a device-greedy step
        (graphs for the target and the draft loop, every row plain greedy: `plain`): the host path would need the
        drafts and the acceptance of the step in flight."""
        if not graph_size:
            return False
        return self.k == 0 or plain

    def src(self, sched: list[Scheduled]) -> list[int] | None:
        """For a graph step launched while another is in flight: per row, the in-flight step's row holding its
        input token (-1: the host has it)."""
        if self.inflight is None:
            return None
        rows = self.inflight.rows
        return [rows[id(s.req)] if s.req.num_inflight else -1 for s in sched]

    def step(self, sched: list[Scheduled], table: Gathered, fused: bool = False) -> list[StepOutput]:
        """After the target graph's replay: the draft-loop graph (unless `fused`: it ran in the same launch), then
        the results (or, async, leave them in flight). A row whose request already finished (it stopped at the
        step that was in flight) is dropped."""
        size = table.graph_size
        if self.k:
            self.proposer.replay_graph(table, fused=fused)
        fetched = self.runner.fetch_greedy(size, with_drafts=self.k > 0)
        if self.async_steps:
            assert self.inflight is None, "the step before is committed before this one is left in flight"
            live = [s.req for s in sched if not s.req.finished]
            for req in live:  # its KV is (being) written; its new token counts from now on
                req.num_computed += 1  # k > 0: the first of its 1..k + 1 tokens; the rest when committed
                req.num_inflight += 1
                if self.k:  # the next verify's drafts are on the device: placeholders keep it costed as a verify
                    req.drafts, req.draft_probs = [0] * self.k, None
            if live:
                self.inflight = InFlight(live, {id(s.req): i for i, s in enumerate(sched)}, fetched)
            self.stats.count_device_greedy(left_in_flight=True, fused=fused)
            return []
        self.stats.count_device_greedy(left_in_flight=False, fused=fused)
        res = self._wait(fetched)
        return [self._commit(s.req, res[i], counted=0) for i, s in enumerate(sched) if not s.req.finished]

    def resolve(self) -> list[StepOutput]:
        """Commit the step in flight, if any (waits for its results): a request that stopped or was aborted since
        it was launched drops its row."""
        inf, self.inflight = self.inflight, None
        if inf is None:
            return []
        res = self._wait(inf.results)
        outputs = []
        for req in inf.reqs:
            req.num_inflight -= 1
            if not req.finished:
                outputs.append(self._commit(req, res[inf.rows[id(req)]], counted=1))
        return outputs

    def _commit(self, req: Request, row: list[float], counted: int) -> StepOutput:
        """One sequence's row of the greedy block: its accepted drafts and the target's token after them (k = 0:
        the one token), and the next drafts. counted: tokens already counted in num_computed when the step was left
        in flight (with async verify, the device has already rotated the GDN slots of the step after it)."""
        if not self.k:
            req.num_computed += 1 - counted
            return self.out.emit_greedy(req, [int(row[0])], [row[1]])
        q = 1 + self.k
        a = int(row[2 * q])  # accepted drafts
        self.out.commit_spec(req, a, self.k)
        req.num_computed += a + 1 - counted
        out = self.out.emit_greedy(req, [int(t) for t in row[: a + 1]], row[q : q + a + 1])
        if not req.finished:
            req.drafts = [int(t) for t in row[2 * q + 1 :]]
        return out

    def _wait(self, fetched: Fetched) -> list[list[float]]:
        t0 = time.perf_counter()
        res = fetched.wait()
        self.stats.count_graph_wait(time.perf_counter() - t0)  # the host waiting for the device
        return res
