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
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mtp_ray.config.engine import EngineConfig
from mtp_ray.config.model import ModelConfig
from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.request import check_prompt
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.serve.batcher import CallBatcher, detached
from mtp_ray.serve.group_commands import GroupCommands
from mtp_ray.serve.protocol import unpack_rows
from mtp_ray.serve.sinks import Collector, Sink, StreamSink
from mtp_ray.serve.worker import RankWorker

log = logging.getLogger("mtp_ray.group")


def _raise_if_error(finish_reason: str | None) -> None:
    """A rank's error row (finish reason "error: ...") ends its request as a ValueError with the rank's message."""
    if finish_reason and finish_reason.startswith("error"):
        raise ValueError(finish_reason[len("error: "):])


class GroupFailed(RuntimeError):
    """The group failed (a rank died, a collective timed out, a lock-step check fired); it is restarting."""


class GroupUnavailable(RuntimeError):
    """No group can serve right now (starting, restarting or shut down)."""


def rank_bundles(cfg: EngineConfig) -> list[dict]:
    """One bundle per DP rank: a GPU each on GPU machines (device cuda, or auto with GPUs in the cluster)."""
    gpu = cfg.device == "cuda" or (cfg.device == "auto" and ray.is_initialized()
                                   and ray.cluster_resources().get("GPU", 0) > 0)
    cpu = cfg.parallel.cpus_per_rank
    return [{"CPU": cpu, "GPU": 1} if gpu else {"CPU": cpu} for _ in range(cfg.parallel.dp)]


class EngineGroup(GroupCommands):
    def __init__(self, cfg: EngineConfig, pg=None, bundle_offset: int = 0, restart_on_failure: bool = True):
        """restart_on_failure=False (Serve): a fault leaves the group failed, check_health reports it and Serve
        replaces the whole replica; True (actor handle): the group restarts its ranks itself."""
        self.cfg = cfg
        self.restart_on_failure = restart_on_failure
        self.group_id = uuid.uuid4().hex[:8]
        self.dp = cfg.parallel.dp
        self.model_config = ModelConfig.from_pretrained(cfg.model)
        self.pg, self.own_pg, self.bundle_offset = pg, pg is None, bundle_offset
        self.workers: list = []
        self.reqs: dict[str, tuple[int, Sink]] = {}
        self.load = [0] * self.dp
        self.abort_calls = [0] * self.dp  # aborts sent per rank (cancelled streams, abort()): health shows them
        self.abort_errors = [0] * self.dp  # ... and those whose call failed
        # new requests per rank: one add_many call for all that arrive while the previous one is in flight
        self.adds = [CallBatcher(lambda items, r=r: self.workers[r].add_many.remote(items)) for r in range(self.dp)]
        self.progress = [(0, time.monotonic())] * self.dp  # (step, when it last advanced) per rank
        self.last_poll: list[dict] = [{} for _ in range(self.dp)]
        self.epoch = 0  # bumps on every (re)start; pollers of an older epoch exit
        self.restarts = 0
        self.state = "new"
        self.last_failure: str | None = None
        self.max_model_len = 0
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # group commands (sleep / wake_up / weights): new requests are held while one runs or while asleep
        self._accepting = asyncio.Event()
        self._accepting.set()
        self._cmd_lock = asyncio.Lock()
        self._cmd_seq = 0
        self.sleeping = 0
        self.asleep_policy = "wait"  # a request that arrives while asleep: "wait" for wake_up, or "fail"
        self.weights_updated = False

    # ---- life cycle ----
    async def start(self) -> None:
        if self.pg is None:
            self.pg = placement_group(rank_bundles(self.cfg), strategy=self.cfg.parallel.placement_strategy)
        await asyncio.wait_for(self.pg.ready(), self.cfg.timeouts.start_s)
        await self._spawn()
        self._tasks.append(detached(self._watchdog()))

    async def _spawn(self) -> None:
        self.state = "starting"
        self.epoch += 1
        bundles = rank_bundles(self.cfg)
        cls = ray.remote(RankWorker)
        self.workers = [
            cls.options(
                num_cpus=bundles[r]["CPU"], num_gpus=bundles[r].get("GPU", 0), max_concurrency=16,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, self.bundle_offset + r),
                name=f"mtp_ray_rank_{self.group_id}_e{self.epoch}_r{r}",
            ).remote(self.cfg, r, self.dp)
            for r in range(self.dp)
        ]
        try:
            addr, port = await self.workers[0].rendezvous_address.remote()
            infos = await asyncio.wait_for(asyncio.gather(*[w.init.remote(addr, port, self.workers)
                                                            for w in self.workers]), self.cfg.timeouts.start_s)
        except BaseException as e:
            self._kill_workers()
            self.state = "failed"
            self.last_failure = f"group start failed: {type(e).__name__}: {e}"
            raise GroupFailed(self.last_failure) from e
        self.max_model_len = infos[0]["max_model_len"]
        now = time.monotonic()
        self.progress = [(0, now)] * self.dp
        self.load = [0] * self.dp
        self._tasks += [detached(self._poll(self.epoch, r)) for r in range(self.dp)]
        self.state = "ready"
        self._ready.set()
        log.info("group ready (epoch %d): %s", self.epoch, infos)

    async def shutdown(self) -> None:
        self.state = "stopped"
        self._ready.clear()
        self.epoch += 1
        for t in self._tasks:
            t.cancel()
        self._kill_workers()
        if self.own_pg and self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def _kill_workers(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []

    # ---- requests ----
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        check_prompt(prompt_ids, self.model_config.vocab_size, self.max_model_len)
        params.check_vocab(self.model_config.vocab_size)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       ready_timeout: float | None = None) -> AsyncIterator[StepOutput]:
        """Token deltas of one request: one StepOutput per engine step that produced tokens for it, or, when the
        consumer falls behind (each delta a Serve stream item costs the replica CPU), everything that arrived since
        its last one in one delta: under load the stream carries fewer, larger deltas instead of a backlog."""
        sink = StreamSink()
        rid, rank = await self._admit(prompt_ids, params, request_id, ready_timeout, sink)
        finished = False
        later: StepOutput | BaseException | None = None  # taken from the queue while coalescing, not yet handled
        try:
            while True:
                item, later = (later, None) if later is not None else (await sink.queue.get(), None)
                while isinstance(item, StepOutput) and not item.finished and not sink.queue.empty():
                    nxt = sink.queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        later = nxt  # the deltas before it go out first
                        break
                    item = item.then(nxt)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if finished:
                    _raise_if_error(item.finish_reason)
                yield item
                if finished:
                    return
        finally:
            self._release(rid, rank, finished)

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
            _raise_if_error(sink.finish_reason)
            return sink
        finally:
            self._release(rid, rank, finished)

    async def _admit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
                     ready_timeout: float | None, sink: Sink) -> tuple[str, int]:
        """Validate a new request, pick its rank (least loaded), route its rows to `sink` and send it there."""
        if self.state in ("stopped", "failed"):
            raise GroupUnavailable(f"the engine group is {self.state}: {self.last_failure or 'shut down'}")
        if not self._ready.is_set():  # (wait_for costs a task and a timer: not on every request of a ready group)
            try:
                await asyncio.wait_for(self._ready.wait(), ready_timeout or self.cfg.timeouts.start_s)
            except asyncio.TimeoutError as e:
                raise GroupUnavailable(f"the engine group is not ready ({self.state})") from e
        self.validate(prompt_ids, params)
        if self.sleeping and self.asleep_policy == "fail":
            raise GroupUnavailable("the engine is asleep (call wake_up first)")
        await self._accepting.wait()
        rid = request_id or uuid.uuid4().hex
        if rid in self.reqs:
            raise ValueError(f"request_id {rid!r} is already in flight")
        rank = min(range(self.dp), key=lambda r: self.load[r])
        self.reqs[rid] = (rank, sink)
        self.load[rank] += 1
        try:
            await self.adds[rank].submit((rid, list(prompt_ids), params.to_dict()))
        except BaseException:
            self._release(rid, rank, finished=False)
            raise
        return rid, rank

    def _release(self, rid: str, rank: int, finished: bool) -> None:
        if self.reqs.pop(rid, None) is not None:
            self.load[rank] -= 1
        if not finished and self.state == "ready":  # cancelled / client gone: free its KV on the rank
            self.abort_calls[rank] += 1
            detached(self._send_abort(self.workers[rank], rank, rid))  # not a child of the request being cancelled

    async def _send_abort(self, worker, rank: int, rid: str) -> None:
        try:
            await worker.abort.remote(rid)
        except Exception as e:  # the rank died (the restart drops its requests anyway) or the call was cancelled
            self.abort_errors[rank] += 1
            log.warning("abort of %s on rank %d failed: %s: %s", rid, rank, type(e).__name__, e)

    async def abort(self, request_id: str) -> None:
        if request_id in self.reqs:
            rank = self.reqs[request_id][0]
            self.abort_calls[rank] += 1
            await self.workers[rank].abort.remote(request_id)

    # ---- outputs, health, faults ----
    async def _poll(self, epoch: int, rank: int) -> None:
        worker = self.workers[rank]
        while self.epoch == epoch:
            try:
                res = await worker.poll.remote(0.5)
            except Exception as e:  # the actor died (RayActorError) or its node is gone
                if self.epoch == epoch:
                    await self._fail(epoch, f"rank {rank} died: {type(e).__name__}: {str(e).splitlines()[0]}")
                return
            if self.epoch != epoch:
                return
            self.last_poll[rank] = res
            if res["step"] != self.progress[rank][0]:
                self.progress[rank] = (res["step"], time.monotonic())
            for msg in res["msgs"]:
                for row in unpack_rows(msg)[1]:
                    entry = self.reqs.get(row[0])
                    if entry is not None:
                        entry[1].put_row(row)
            if res["error"]:
                await self._fail(epoch, res["error"])
                return

    async def _watchdog(self) -> None:
        """Hung = requests are in flight but a rank's step counter has not moved for timeouts.progress_s."""
        while self.state != "stopped":
            await asyncio.sleep(1.0)
            if self.state != "ready" or not self.reqs:
                now = time.monotonic()
                self.progress = [(s, now) for s, _ in self.progress]
                continue
            for r, (step, since) in enumerate(self.progress):
                if time.monotonic() - since > self.cfg.timeouts.progress_s:
                    await self._fail(self.epoch, f"rank {r} made no progress for {self.cfg.timeouts.progress_s:.0f}s "
                                                 f"(step {step}) with {len(self.reqs)} request(s) in flight")
                    break

    async def _fail(self, epoch: int, reason: str) -> None:
        if epoch != self.epoch or self.state != "ready":
            return
        self.state = "restarting"
        self._ready.clear()
        report = await self._rank_report()
        self.last_failure = f"{reason}\n{report}"
        log.error("engine group failed; restarting all %d ranks\n%s", self.dp, self.last_failure)
        then = "the group is restarting" if self.restart_on_failure else "the group will be replaced"
        err = GroupFailed(f"engine group failed, request aborted; {then}. Cause: {reason}")
        for _, sink in list(self.reqs.values()):
            sink.fail(err)
        self.epoch += 1
        self._kill_workers()
        if self.weights_updated:  # a restart would reload the checkpoint: never serve other weights silently
            self.state = "failed"
            self.last_failure += "\nnot restarted: weights were updated since start (recreate the engine)"
            return
        if not self.restart_on_failure:
            self.state = "failed"
            return
        self.restarts += 1
        try:
            await self._spawn()
        except Exception as e:  # leave the group unhealthy; check_health reports it
            self.state = "failed"
            self.last_failure += f"\nrestart failed: {e}"
            log.exception("group restart failed")

    async def _rank_report(self) -> str:
        lines = []
        for r, w in enumerate(self.workers):
            try:
                st = await asyncio.wait_for(w.stats.remote(), 3.0)
                lines.append(f"  rank {r}: step {self.progress[r][0]} wave {st['wave']} collectives "
                             f"{st['collectives']} last DPMeta: {st['last_meta']}")
            except Exception as e:
                lines.append(f"  rank {r}: unreachable ({type(e).__name__}); last poll step {self.progress[r][0]}")
        return "every rank's last state:\n" + "\n".join(lines)

    def health(self) -> dict:
        return {"healthy": self.state == "ready", "state": self.state, "restarts": self.restarts,
                "sleeping": self.sleeping,
                "in_flight": len(self.reqs), "load": list(self.load), "last_failure": self.last_failure,
                "add_calls": [b.calls for b in self.adds],  # actor calls that carried new requests, per rank
                "abort_calls": list(self.abort_calls), "abort_errors": list(self.abort_errors),
                "max_model_len": self.max_model_len,
                "ranks": [{"step": p.get("step", 0), "wave": p.get("wave", 0), "counters": p.get("counters", {}),
                           "collectives": p.get("collectives", 0), "num_running": p.get("num_running", 0),
                           "num_waiting": p.get("num_waiting", 0), "spec": p.get("spec", {}),
                           "aborts": p.get("aborts", {})}
                          for p in self.last_poll]}

    async def rank_stats(self) -> list[dict]:
        return list(await asyncio.gather(*[w.stats.remote() for w in self.workers]))
