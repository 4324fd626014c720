"""EngineCore: one rank's engine. A step is schedule -> agree (the DPMeta gather with the rank's peers) -> target
forward -> commit (sample / verify, stop checks, outputs) -> draft (the MTP loop).

Async scheduling (`scheduler.async_scheduling`, CUDA-graph steps of plain-greedy rows with k = 0, and with
`scheduler.async_verify` device-greedy verify steps with k > 0): a step's results stay on the device while the host
schedules, gathers and launches the next step, whose rows take their inputs from the device; the host then reads the
earlier step's results (the device is already busy with the next one) and commits them. A request that stopped at
the earlier step has also run in the later one: that row is dropped. Anything else (an eager step, sampling on the
host, a preemption, a group command) first resolves what is in flight.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent import futures

import torch

from mtp_ray.config.engine import EngineConfig
from mtp_ray.config.model import ModelConfig, tokenizer_eos_id
from mtp_ray.engine.block_manager import BlockManager
from mtp_ray.engine.commit import Committer, plain_greedy, stop_ids
from mtp_ray.engine.device_greedy import DeviceGreedy
from mtp_ray.engine.grammar import GrammarCompiler
from mtp_ray.engine.inputs import StepInputs, build, build_uniform, dummy_inputs, is_uniform, target_pieces
from mtp_ray.engine.mtp import MTPProposer
from mtp_ray.engine.outputs import OutputProcessor, StepOutput
from mtp_ray.engine.phases import PhaseClock
from mtp_ray.engine.prefix_steps import plan_snapshots, publish_prefixes, restore_prefixes
from mtp_ray.engine.request import Request, Status, check_request
from mtp_ray.engine.runner import ModelRunner
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.engine.scheduler import Scheduled, Scheduler
from mtp_ray.engine.stats import EngineStats
from mtp_ray.engine.warmup import warmup_forwards, warmup_requests
from mtp_ray.layers.moe import ExpertDispatcher, local_dispatch
from mtp_ray.parallel.dp_meta import DPMeta, Gathered
from mtp_ray.parallel.sync import LocalSync, Sync

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, cfg: EngineConfig, expert_range: tuple[int, int] | None = None,
                 dispatch: ExpertDispatcher = local_dispatch, sync: Sync | None = None):
        self.cfg = cfg
        self.sync = sync or LocalSync()
        self.pending_outputs: list[StepOutput] = []  # outputs made outside a step (abort_all)
        mc = ModelConfig.from_pretrained(cfg.model)
        cfg.check_fits(mc)
        self.max_model_len = cfg.scheduler.max_model_len or mc.max_position_embeddings
        self.k = cfg.spec.k
        self.runner = ModelRunner(cfg, self.max_model_len, expert_range, dispatch, self.sync.barrier)
        self.eos_ids = tuple(self.runner.model_config.eos_token_ids)
        self.grammars = GrammarCompiler(cfg.tokenizer or cfg.model, self.runner.model_config.vocab_size, self.eos_ids)
        shape = self.runner.cache_shape
        self.blocks = BlockManager(shape.num_blocks, shape.block_size, shape.num_state_slots, self.runner.slots_per_seq,
                                   self.runner.snapshot_slots, lookahead=int(self.k > 0))
        split = cfg.scheduler.split_prefill
        if split is None:  # auto: split when decode steps are graphs and a mixed step would not be one (k > 0:
            # verify rows are not in the mixed-step graphs; k = 0 decode rows ride along with the new prompts)
            split = bool(self.runner.graphs) and not (self.runner.varlen is not None and self.k == 0)
        self.scheduler = Scheduler(cfg.scheduler, self.blocks, lookahead=self.k, split=split)
        self.requests: dict[str, Request] = {}
        self.compiling: dict[str, Request] = {}  # waiting for their grammar (engine/grammar.py), not yet scheduled
        self._seeds = itertools.count(cfg.seed * 1_000_003 + 1)
        self.stats = EngineStats()
        self.proposer = MTPProposer(self.runner, self.blocks, self.k, self.sync, self.stats)
        self.clock = PhaseClock()  # host time per phase of a step (get_stats "phases")
        self.out = OutputProcessor(self.scheduler, self.requests, self.eos_ids, self.max_model_len, self.stats,
                                   tokenizer_eos_id(cfg.tokenizer or cfg.model))
        self.committer = Committer(self.runner, self.out, self.eos_ids, self.k)
        self.greedy = DeviceGreedy(self.runner, self.proposer, self.out, self.stats, cfg.scheduler.async_scheduling,
                                   cfg.scheduler.async_verify)
        if cfg.scheduler.max_num_batched_tokens < 1 + self.k:
            raise ValueError(f"scheduler.max_num_batched_tokens={cfg.scheduler.max_num_batched_tokens} cannot hold "
                             f"one verify step of 1 + k = {1 + self.k} tokens")
        need = self.runner.blocks_per_seq  # one sequence of max_model_len with its MTP lookahead
        if shape.num_blocks < need:
            raise ValueError(f"cache.num_blocks={shape.num_blocks} cannot hold one sequence of max_model_len "
                             f"{self.max_model_len} (needs {need} blocks)")

    # ---- requests ----
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.runner.asleep:
            raise ValueError("the engine is asleep: call wake_up() first")
        check_request(prompt_ids, params, self.runner.model_config.vocab_size, self.max_model_len,
                      self.cfg.max_logprobs)
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else next(self._seeds))
        req = Request(request_id, list(prompt_ids), params, arrival=time.monotonic(), generator=gen)
        if params.allowed_token_ids is not None:
            req.allowed = torch.zeros(self.runner.model_config.vocab_size, dtype=torch.bool)
            req.allowed[params.allowed_token_ids] = True
            if params.structured_outputs is not None:  # a constraint that is complete must be able to end there
                req.allowed[list(stop_ids(params, self.eos_ids))] = True  # (without one, as vLLM: only these ids)
        self.requests[request_id] = req
        if params.structured_outputs is None:
            self.scheduler.add(req)
            return
        # the constraint compiles off this thread; the request joins the scheduler when it is ready
        req.compiling = self.grammars.submit(params.structured_outputs, stop_ids(params, self.eos_ids))
        self.compiling[request_id] = req

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the scheduler; a constraint that failed ends its request
        with the error (a ValueError naming structured_outputs)."""
        if not self.scheduler.has_unfinished():  # nothing else to run: wait a little rather than spin empty steps
            futures.wait([r.compiling for r in self.compiling.values()], 0.002, futures.FIRST_COMPLETED)
        for rid, req in list(self.compiling.items()):
            if not req.compiling.done():
                continue
            del self.compiling[rid]
            try:
                req.grammar = req.compiling.result()
            except Exception as e:
                self.requests.pop(rid, None)
                req.status, req.finish_reason = Status.FINISHED, "error"
                self.pending_outputs.append(StepOutput(rid, [], [], [], True, "error", error=str(e)))
                continue
            req.compiling = None
            self.scheduler.add(req)

    def abort_request(self, request_id: str) -> StepOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if self.compiling.pop(request_id, None) is not None:  # not in the scheduler yet
            req.compiling.cancel()
            req.status, req.finish_reason = Status.FINISHED, "abort"
        else:
            self.scheduler.finish(req, "abort")
        self.stats.count_abort()
        return self.out.output(req, [], 0)

    def abort_all(self) -> int:
        """Abort every request (sleep, pause); their aborted outputs go out with the next step's messages."""
        ids = list(self.requests)
        self.pending_outputs += [o for o in (self.abort_request(r) for r in ids) if o is not None]
        return len(ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.compiling)

    # ---- one step ----
    def step(self, next_cmd: int = 0) -> list[StepOutput]:
        """schedule -> agree (the DPMeta gather) -> forward -> commit -> draft; outputs made outside a step first.
        next_cmd: the sequence number of the oldest group command the caller holds (0: none), carried by the step's
        DPMeta (a group runs a command once every rank has it: Gathered.command_ready). The step ends in the sync
        (Sync.end_step), which counts it."""
        if self.compiling:
            self._admit_compiled()
        early, self.pending_outputs = self.pending_outputs, []
        steps, graphs, t0 = self.stats.steps, self.stats.graph_steps, time.perf_counter()
        self.clock.begin()
        try:
            out = self._step(next_cmd)
        finally:
            self.clock.close()
        self.sync.end_step()
        if self.stats.steps > steps:
            self.stats.count_step_time(time.perf_counter() - t0, graph=self.stats.graph_steps > graphs)
        outs = early + out
        self.stats.count_outputs(sum(len(o.new_token_ids) for o in outs))
        return outs

    def _step(self, next_cmd: int) -> list[StepOutput]:
        clock = self.clock
        done: list[StepOutput] = []  # outputs of the step that was in flight
        if self.greedy.inflight is not None and self.scheduler.may_preempt():
            done = self.greedy.resolve()
        # schedule
        sched = self.scheduler.schedule(self.sync.prefill_turn() if self.scheduler.split else None)
        restore_prefixes(sched, self.runner)
        uniform = is_uniform(sched, 1 + self.k)
        local = self._local_meta(sched, uniform, next_cmd)
        clock.lap("schedule")
        # agree, then forward: the gathered table is the forward context inside the block
        with self.sync.agree(local, self.runner.graph_sizes) as table:
            clock.lap("gather")
            if table is None:
                return done + self.greedy.resolve()  # no rank has work this step
            clock.kind = "graph" if table.graph_size else "eager"
            plain = self._all_plain(sched, table)
            if self.greedy.inflight is not None and not self.greedy.can_follow(table.graph_size, plain):
                done += self.greedy.resolve()  # an eager or host-path step reads its inputs on the host
                sched = [s for s in sched if not s.req.finished]  # ended at the step that was in flight
                uniform = uniform and bool(sched)
                plain = self._all_plain(sched, table)  # min_tokens reached, a sampled request ended
                clock.lap("resolve")
            decodes = len(sched) if uniform else sum(s.req.is_decode for s in sched)
            self.stats.count_step(uniform, bool(table.graph_size), mixed=0 < decodes < len(sched),
                                  tokens=0 if local.is_dummy else local.num_tokens,  # what it scheduled
                                  rows=0 if local.is_dummy else len(sched))
            plan_snapshots(sched, self.blocks)
            # graph steps: per row, the row of the step in flight it follows (-1: its inputs are on the host)
            src = self.greedy.src(sched) if table.graph_size else None
            inp = self._inputs(sched, uniform, table, fed=self.k > 0 and bool(src) and min(src) >= 0)
            clock.lap("inputs")
            fused = plain and bool(sched)  # the draft loop in the target's launch (plain: a graph step)
            hidden, all_logits = self._forward(inp, table, fused, src)
        clock.lap("launch")
        done += self.greedy.resolve()  # the step before, while the device runs this one
        clock.lap("resolve")
        if not sched:  # a dummy forward: keep the group in lock-step through the draft loop too
            self.proposer.propose([], table)
            return done
        # commit (and, on the device greedy path, draft): a finished request's row (it stopped at the step that was
        # in flight) is computed and dropped
        fast = [True] if fused else [s.req.finished or plain_greedy(s.req) for s in sched]
        if fused or table.graph_size and (self.k == 0 or table.graph_drafts) and all(fast):  # (fused: all hold)
            done += self.greedy.step(sched, table, fused)
            clock.lap("commit")
            return done
        outputs, items = self.committer.commit(sched, inp, hidden, all_logits, fast)
        publish_prefixes(sched, self.blocks, self.runner)
        clock.lap("commit")
        # draft
        self.proposer.propose(items, table)
        clock.lap("drafts")
        return done + outputs

    def invalidate_prefixes(self) -> None:
        """Cached prefixes no longer hold (new weights, caches reset or freed): forget them all."""
        self.blocks.index.invalidate()

    def _inputs(self, sched: list[Scheduled], uniform: bool, table: Gathered, fed: bool) -> StepInputs:
        """Decodes + prefill pieces in one forward (a uniform batch is all decodes: no per-sequence scan); a graph
        step pads to the DP-wide graph size every rank replays. fed: every row follows a verify in flight, which
        sets its tokens, positions and KV slots on the device (build_uniform)."""
        pieces, q_len = target_pieces(sched), 1 + self.k
        if table.graph_size:
            return build_uniform(pieces, self.blocks, q_len, table.graph_size, self.runner.blocks_per_seq, fed)
        if uniform:
            return build_uniform(pieces, self.blocks, q_len)
        return build(pieces, self.blocks) if sched else dummy_inputs()

    def _all_plain(self, sched: list[Scheduled], table: Gathered) -> bool:
        """k > 0 and a draft-loop graph step: whether every row is plain greedy (the device decides the step)."""
        return self.k > 0 and table.graph_drafts and all(plain_greedy(s.req) for s in sched)

    def _forward(self, inp: StepInputs, table: Gathered, fused: bool, src: list[int] | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target forward -> (hidden [T, H], logits [T, V] when the graph computed them, else None); fused:
        the draft loop in the same graph launch; src: DeviceGreedy.src of a graph step."""
        if table.graph_size:
            return self.runner.replay_target(inp, table.graph_size, src, fused)
        bucket = self.runner.mixed_bucket(inp)  # (one-rank groups only: no collective depends on it)
        if bucket:
            self.clock.kind = "mixed_graph"
            self.stats.count_mixed_graph(inp.num_tokens, bucket)
            return self.runner.replay_mixed(inp, bucket), None
        self.stats.count_eager(inp.num_tokens)
        return self.runner.forward(inp), None

    def drain(self) -> None:
        """Before anything that must see every token committed (group commands): the results in flight go out with
        the next step's outputs."""
        self.pending_outputs += self.greedy.resolve()

    def warmup(self) -> None:
        """All ranks together: eager dummy decode and prefill steps with the k draft forwards, then (GPU) every CUDA
        graph size is captured, largest first, on padded rows only, so that no capture stalls a serving step; then a
        small synthetic workload is served (engine/warmup.py). `cfg.warmup` says how much: full (all of it),
        forwards (no workload) or none (only the closing gather; refused where graphs are in use)."""
        mode = self.cfg.warmup
        if mode == "none" and self.runner.graphs is not None:
            raise ValueError("warmup: none needs no CUDA graphs (graphs.enabled: false): they are captured at "
                             "warmup, and one captured on first use could meet a step in flight; use forwards")
        with self.sync.uncounted():  # not serving steps: the step counter stays (also on wake_up's re-warm)
            if mode != "none":
                warmup_forwards(self)
            if mode == "full":
                warmup_requests(self)
        self.drain()
        self.invalidate_prefixes()  # the workload's prefixes are nobody's
        self.pending_outputs = []  # the workload's last outputs: nobody's
        self.stats.reset()  # the counters count serving
        # a closing gather, no forward: the lock-step checks (collective counts, the EP mode each rank used) run
        # over the warmup's forwards now rather than at the first request
        with self.sync.agree(DPMeta(is_dummy=1)) as closing:
            assert closing is None  # every rank is idle: no forward

    def _pending(self, sched: list[Scheduled], uniform: bool) -> dict[str, int]:
        """Work left for the next step (split scheduling turns): prefill pieces not finished by this step, and
        decodes (running ones, and prefills this step completes)."""
        running = self.scheduler.running
        if uniform and len(sched) == len(running):  # every running sequence decodes this step (the common case)
            return {"pending_prefill": int(bool(self.scheduler.waiting)), "pending_decode": int(bool(running))}
        done = {id(s.req) for s in sched if s.completes_prefill}
        prefill = bool(self.scheduler.waiting) or any(not r.is_decode and id(r) not in done for r in running)
        decode = any(r.is_decode or id(r) in done for r in running)
        return {"pending_prefill": int(prefill), "pending_decode": int(decode)}

    def _local_meta(self, sched: list[Scheduled], uniform: bool, next_cmd: int) -> DPMeta:
        n = sum(s.num_new for s in sched)
        # a uniform batch decodes / verifies from a cached prefix: decoding, no chunk (is_uniform's conditions)
        decoding = uniform or (bool(sched) and all(s.verify or not s.req.is_prefill for s in sched))
        return DPMeta(
            num_tokens=max(n, 1), batch_size=len(sched), is_decoding=int(decoding),
            is_dummy=int(not sched), is_chunk=int(not uniform and any(not s.completes_prefill for s in sched)),
            has_unfinished=int(self.has_unfinished()), is_sleeping=int(self.runner.asleep),
            graph_ok=int(uniform or not sched), greedy_ok=int(all(s.req.params.greedy for s in sched)),
            next_cmd=next_cmd, **self._pending(sched, uniform),
        )
