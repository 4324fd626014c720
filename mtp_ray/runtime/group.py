"""EngineGroup: one DP x EP group of RankWorker actors (asyncio). Routes each request to the least-loaded rank,
streams its per-step token deltas back, judges health by progress, and on any fault fails the in-flight requests
with a clear error and restarts every rank."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.util.placement_group import remove_placement_group

from mtp_ray.config.engine import EngineConfig
from mtp_ray.config.model import ModelConfig
from mtp_ray.engine.grammar import check_grammar, note_failed
from mtp_ray.engine.grammar_budget import COMPILE_S
from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.request import check_request
from mtp_ray.engine.sampling_params import ParamError, SamplingParams, StructuredOutputs
from mtp_ray.runtime.batcher import CallBatcher, detached
from mtp_ray.runtime.group_commands import GroupCommands
from mtp_ray.runtime.group_monitor import GroupFailed, GroupMonitor, GroupUnavailable
from mtp_ray.runtime.messages import AddRequest, Admission, AdmitItem, request_error
from mtp_ray.runtime.placement import new_placement_group, spawn_ranks, wait_placed
from mtp_ray.runtime.prefix_routing import rank_router
from mtp_ray.runtime.sinks import Collector, RemoteSink, Sink, StreamSink

log = logging.getLogger("mtp_ray.group")


def _raise_if_error(out: StepOutput | None) -> None:
    """A request its rank refused ends with a RequestError (a ValueError: the caller's) carrying the rank's message;
    one the model could not go on with, with a ModelError."""
    if out is not None and out.error is not None:
        raise request_error(out)


class EngineGroup:
    """Life cycle and requests; its commands (`commands`) and its health and faults (`monitor`) are objects of
    their own over it."""

    def __init__(self, cfg: EngineConfig, pg=None, bundle_offset: int = 0, restart_on_failure: bool = True):
        """restart_on_failure=False (Serve): a fault leaves the group failed, check_health reports it and Serve
        replaces the whole replica; True (actor handle): the group restarts its ranks itself."""
        self.cfg = cfg
        self.restart_on_failure = restart_on_failure
        self.group_id = uuid.uuid4().hex[:8]
        self.dp = cfg.parallel.dp
        self.model_config = ModelConfig.from_pretrained(cfg.model)
        cfg.check_fits(self.model_config)  # before any actor starts: the ranks would each raise it
        self.pg, self.own_pg, self.bundle_offset = pg, pg is None, bundle_offset
        self.workers: list = []
        self.reqs: dict[str, tuple[int, Sink]] = {}
        self.load = [0] * self.dp
        self.router = rank_router(self.cfg)
        self.admit_s, self.admits = 0.0, 0  # admissions through `admit` and the time the group spent on them
        self.abort_calls = [0] * self.dp  # aborts sent per rank (cancelled streams, abort()): health shows them
        self.abort_errors = [0] * self.dp  # ... and those whose call failed
        # new requests per rank: one add_many call for all that arrive while the previous one is in flight
        self.adds = [CallBatcher(lambda items, r=r: self._add_many(r, items)) for r in range(self.dp)]
        self.epoch = 0  # bumps on every (re)start; pollers of an older epoch exit
        self.state = "new"  # new -> starting -> ready -> (restarting -> starting -> ready | failed) ... stopped
        self.max_model_len = 0
        self.num_blocks = 0
        # a rank acks a request in milliseconds; one that does not within a quarter of the queue time is stuck
        # (stopped, or in a collective that will time out): the caller may send the request to another group
        self.ack_s = max(0.5, cfg.timeouts.queue_s / 4)
        self.ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.commands = GroupCommands(self)
        self.monitor = GroupMonitor(self)

    # ---- life cycle ----
    async def start(self) -> None:
        try:
            self.pg = self.pg or new_placement_group(self.cfg)
            try:
                await wait_placed(self.cfg, self.pg)
            except TimeoutError as e:
                self.end("failed")
                self.monitor.last_failure = str(e)
                raise GroupFailed(self.monitor.last_failure) from None
            await self.spawn()
        except BaseException:
            # a group that never served holds nothing: its own placement group goes (when it stayed, every failed
            # start of a rollout engine left its ranks' CPUs / GPUs reserved until the job ended)
            self._drop_own_pg()
            raise
        self._tasks.append(detached(self.monitor.watchdog()))

    async def wait_ready(self) -> None:
        """Until the group serves (a command waits through a restart); GroupUnavailable at once when it never will
        again (shut down, or failed past its restarts), or after timeouts.start_s."""
        if self.state == "ready":
            return
        self.check_not_ended()
        try:
            await asyncio.wait_for(self.ready.wait(), self.cfg.timeouts.start_s)
        except asyncio.TimeoutError as e:
            raise GroupUnavailable(f"the engine group is {self.state}, not ready after "
                                   f"{self.cfg.timeouts.start_s:g}s") from e

    async def spawn(self) -> None:
        self.state = "starting"
        self.epoch += 1
        self.workers = spawn_ranks(self.cfg, self.pg, self.bundle_offset, f"mtp_ray_rank_{self.group_id}_e{self.epoch}")
        try:
            addr, port = await self.workers[0].rendezvous_address.remote()
            infos = await asyncio.wait_for(asyncio.gather(*[w.init.remote(addr, port, self.workers)
                                                            for w in self.workers]), self.cfg.timeouts.start_s)
            await asyncio.wait_for(self.commands.restore(self.workers), self.cfg.timeouts.start_s)
        except BaseException as e:
            self.kill_workers()
            self.end("failed")
            self.monitor.last_failure = f"group start failed: {type(e).__name__}: {e}"
            raise GroupFailed(self.monitor.last_failure) from e
        self.max_model_len = infos[0]["max_model_len"]
        self.num_blocks = infos[0]["num_blocks"]  # KV blocks per rank (sized from memory on a GPU)
        self.monitor.reset()
        self.load = [0] * self.dp
        self.router = rank_router(self.cfg)  # new ranks: empty caches
        self._tasks += [detached(self.monitor.poll(self.epoch, r)) for r in range(self.dp)]
        self.state = "ready"
        self.ready.set()
        log.info("group ready (epoch %d): %s", self.epoch, infos)

    async def shutdown(self) -> None:
        self.end("stopped")
        self.ready.clear()
        self.epoch += 1
        for t in self._tasks:
            t.cancel()
        self.kill_workers()
        self._drop_own_pg()

    def _drop_own_pg(self) -> None:
        if self.own_pg and self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def _add_many(self, r: int, items: list):
        self.check_not_ended()  # (shut down between a request's admission and this batch: no workers left)
        return self.workers[r].add_many.remote(items)

    def check_not_ended(self) -> None:
        if self.state in ("stopped", "failed"):
            raise GroupUnavailable(f"the engine group is {self.state}: {self.monitor.last_failure or 'shut down'}")

    def end(self, state: str) -> None:
        """stopped or failed: for good. Requests held by a pause or a sleep wake up to find it so (_admit)."""
        assert state in ("stopped", "failed")
        self.state = state
        self.commands.accepting.set()

    def kill_workers(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []

    # ---- requests ----
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Admission: the prompt and the token ids the parameters name, against this model (SamplingParams checked
        their own values when they were made)."""
        check_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len, self.cfg.max_logprobs)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       ready_timeout: float | None = None, announce: bool = False) -> AsyncIterator[StepOutput]:
        """Token deltas of one request (StreamSink.deltas: one StepOutput per engine step that produced tokens for
        it, coalesced when the consumer falls behind). announce: first an empty delta once the request is admitted
        (a caller can tell a group that never admitted it, whose request may go to another group, from one that is
        computing its first token)."""
        sink = StreamSink()
        rid, rank = await self._admit(prompt_ids, params, request_id, ready_timeout, sink)
        if announce:
            yield StepOutput(rid, [], [], [], False)
        try:
            async for item in sink.deltas():
                if item.finished:
                    _raise_if_error(item)
                yield item
        finally:
            self._release(rid, rank, sink.ended)

    async def collect(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                      ready_timeout: float | None = None) -> Collector:
        """One request run to its end without streaming (the rollout handle): its rows are appended as they arrive
        and this returns once, when it finished."""
        sink = Collector()
        rid, rank = await self._admit(prompt_ids, params, request_id, ready_timeout, sink)
        finished = False
        try:
            try:
                await sink.done
            finally:  # a cancelled caller cancels the future it awaited: done() then, but the request is not
                finished = sink.done.done() and not sink.done.cancelled()
            _raise_if_error(sink.last)
            return sink
        finally:
            self._release(rid, rank, finished)

    async def admit_batch(self, items: list[AdmitItem], subscriber: str) -> AsyncIterator[list[Admission | Exception]]:
        """Requests whose outputs `subscriber` pulls from their ranks (`RankWorker.pull`; the HTTP ingress), in one
        call (the ingress batches a burst: a Serve call costs ~1.5 ms of routing and replica work,
        bench/serve_calls.py): yields one result per item, its Admission or the error that refused it, then stays
        open until every admitted one ended. Closing it earlier aborts those still running; one alone is aborted at
        its rank (`RankWorker.abort`). Autoscaling reads the group's count of requests (serve/cluster/scaling.py), not
        of calls."""
        assert subscriber, "the group's own requests go through generate / collect"
        t0 = time.monotonic()
        sinks = [RemoteSink() for _ in items]
        tasks = [asyncio.ensure_future(self._admit(it.prompt_ids, it.params, it.request_id, None, sink, subscriber))
                 for it, sink in zip(items, sinks)]
        try:
            got = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:  # cancelled while admitting: none of them may stay behind on a rank
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is None:
                    self._release(*t.result(), finished=False)
                t.cancel()
            raise
        live = {asyncio.ensure_future(sink.ended.wait()): r for r, sink in zip(got, sinks) if isinstance(r, tuple)}
        self.admit_s += time.monotonic() - t0  # the group's share of admissions (validate, route, ranks' acks)
        self.admits += len(live)
        try:
            yield [Admission(r[0], self.group_id, self.epoch, r[1], self.workers[r[1]]) if isinstance(r, tuple)
                   else r for r in got]
            while live:
                ended, _ = await asyncio.wait(live, return_when=asyncio.FIRST_COMPLETED)
                for f in ended:
                    self._release(*live.pop(f), finished=True)
        finally:
            for f, (rid, rank) in live.items():
                f.cancel()
                self._release(rid, rank, finished=False)

    async def _admit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
                     ready_timeout: float | None, sink: Sink, subscriber: str = "") -> tuple[str, int]:
        """Validate a new request, pick its rank (least loaded), route its rows to `sink` and send it there."""
        self.check_not_ended()
        if not self.ready.is_set():  # (wait_for costs a task and a timer: not on every request of a ready group)
            wait = ready_timeout or self.cfg.timeouts.queue_s
            try:
                await asyncio.wait_for(self.ready.wait(), wait)
            except asyncio.TimeoutError as e:
                cause = f"; last failure: {self.monitor.last_failure}" if self.monitor.last_failure else ""
                raise GroupUnavailable(f"the engine group is {self.state}, not ready after {wait:g}s{cause}") from e
        self.validate(prompt_ids, params)
        if params.structured_outputs is not None:  # compiles: up to seconds for a large schema, off the event loop
            await self._compile(params.structured_outputs)
        if self.commands.sleeping and self.commands.asleep_policy == "fail":
            raise GroupUnavailable("the engine is asleep (call wake_up first)")
        await self.commands.accepting.wait()
        self.check_not_ended()  # (it may have ended while the request was held)
        self.monitor.check_answering(self.ack_s)
        rid = request_id or uuid.uuid4().hex
        if rid in self.reqs:
            raise ValueError(f"request_id {rid!r} is already in flight")
        rank = (self.router.pick(prompt_ids, self.load, params.cache_salt) if self.router is not None
                else min(range(self.dp), key=lambda r: self.load[r]))
        self.reqs[rid] = (rank, sink)
        self.load[rank] += 1
        try:
            await asyncio.wait_for(self.adds[rank].submit(AddRequest(rid, list(prompt_ids), params, subscriber)),
                                   self.ack_s)
        except BaseException as e:
            self._release(rid, rank, finished=False)
            if isinstance(e, asyncio.TimeoutError):
                self.monitor.went_silent(rank)
                raise GroupUnavailable(f"rank {rank} of engine group {self.group_id} did not take the request "
                                       f"within {self.ack_s:g}s") from e
            if isinstance(e, (RayActorError, ActorUnavailableError)):  # a rank gone since the last health check
                raise GroupUnavailable(f"rank {rank} of engine group {self.group_id} is gone: "
                                       f"{type(e).__name__}") from e
            raise
        return rid, rank

    async def _compile(self, spec: StructuredOutputs) -> None:
        """The constraint compiles within the serving path's budget (COMPILE_S, and inside the admission wait,
        timeouts.queue_s): past it a 400 naming the budget, remembered for the same constraint (the compile thread
        runs on; its result is dropped), not a 503 that invites the client to send it again."""
        budget = min(COMPILE_S, 0.8 * self.cfg.timeouts.queue_s)
        try:
            await asyncio.wait_for(asyncio.to_thread(check_grammar, spec), budget)
        except asyncio.TimeoutError:
            why = f"structured_outputs: the constraint did not compile within {budget:g}s (the server's budget)"
            note_failed(spec, why)
            raise ParamError(why, "structured_outputs") from None

    def _release(self, rid: str, rank: int, finished: bool) -> None:
        if self.reqs.pop(rid, None) is not None:
            self.load[rank] -= 1
        if not finished and self.state == "ready":  # cancelled / client gone: free its KV on the rank
            self._abort_on_rank(rank, rid)

    def _abort_on_rank(self, rank: int, rid: str) -> asyncio.Task:
        """Send (and count) an abort from a task of its own: not a child of a request being cancelled."""
        self.abort_calls[rank] += 1
        return detached(self._send_abort(self.workers[rank], rank, rid))

    async def _send_abort(self, worker, rank: int, rid: str) -> None:
        try:
            await worker.abort.remote(rid)
        except Exception as e:  # the rank died (the restart drops its requests anyway) or the call was cancelled
            self.abort_errors[rank] += 1
            log.warning("abort of %s on rank %d failed: %s: %s", rid, rank, type(e).__name__, e)

    async def abort(self, request_id: str) -> None:
        if request_id in self.reqs:
            await asyncio.shield(self._abort_on_rank(self.reqs[request_id][0], request_id))

    def abort_all(self) -> int:
        """Abort every request in flight (their callers get 'abort' results); returns how many."""
        for rid, (rank, _) in list(self.reqs.items()):
            self._abort_on_rank(rank, rid)
        return len(self.reqs)
