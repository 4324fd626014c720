"""Continuous-batching scheduler (pure Python): FCFS, a token budget per step, chunked prefill, preemption by
recompute when KV blocks run out.

Mixed mode: one step holds prefill pieces and decodes together. Split mode (`split`): a step holds either prefill
pieces (with admissions) or decodes, never both; while both kinds wait they alternate, so a decode step is a uniform
batch (a CUDA graph replay) and no decode waits more than one prefill step.

A request always computes tokens [num_computed, num_tokens): a prefill (or a recompute after preemption) is
more than one token, a decode is exactly the newest token, followed by its k drafts when it has them (verify).
Blocks are reserved for `lookahead` positions past the step so the MTP draft loop can write its KV.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from mtp_ray.config.engine import SchedulerConfig
from mtp_ray.engine.block_manager import BlockManager
from mtp_ray.engine.request import Request, Status


@dataclass
class Scheduled:
    req: Request
    num_new: int  # target tokens this step (prefill piece, 1, or 1 + k for verify)
    verify: bool  # decode with drafts
    # after this step every token is computed: the last row's logits sample a new token. Fixed when scheduled
    # (read several times per sequence per step, always before the step moves num_computed)
    completes_prefill: bool = field(init=False)
    # prefix-cache snapshots this forward takes inside the piece: (tokens into the piece, state slot); set by
    # prefix_steps.plan_snapshots once the step's batch is final
    snapshots: list[tuple[int, int]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.completes_prefill = self.req.num_computed + self.num_new >= self.req.num_tokens


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, lookahead: int, split: bool = False):
        self.cfg = cfg
        self.blocks = blocks
        self.lookahead = lookahead
        self.split = split
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.last_was_prefill = False

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def _decode_cost(req: Request) -> tuple[int, bool]:
        """A decode's tokens: the newest one, with its drafts when it has them (verify)."""
        return (1 + len(req.drafts), True) if req.drafts else (1, False)

    def _need(self, req: Request, n: int) -> int:
        """Tokens req's blocks must hold for a step of n new tokens: with the draft loop's lookahead, and with a
        verify in flight (async) the up to lookahead (= k) drafts it may still accept before this step's tokens."""
        return req.num_computed + n + self.lookahead * (2 if req.num_inflight else 1)

    def _cost(self, req: Request, budget: int) -> tuple[int, bool]:
        remaining = req.num_tokens - req.num_computed
        if remaining == 1:
            return self._decode_cost(req)
        # a recompute that kept its drafts (_preempt) stops before the newest token, which its verify feeds.
        # prefix-cache snapshot points inside the piece do not cut it: the GDN layers take them in the same forward
        return min(remaining - bool(req.drafts), self.cfg.prefill_chunk, budget), False

    def schedule(self, prefill_turn: bool | None = None) -> list[Scheduled]:
        """prefill_turn (split mode): the turn a DP group agreed on (None: this scheduler alternates alone). In a
        group decode turn a rank with only prefill work waits one step, so the group's decode step stays uniform;
        in a prefill turn a rank with no prefill work decodes."""
        if not self.split:
            return self._schedule(decodes=True, prefills=True)
        has_decode = any(r.is_decode for r in self.running)
        has_prefill = self.has_prefill_work()
        group = prefill_turn is not None
        if not group:
            prefill_turn = has_prefill and not (has_decode and self.last_was_prefill)
        elif prefill_turn and not has_prefill:
            prefill_turn = False
        out = self._schedule(decodes=not prefill_turn, prefills=prefill_turn)
        if not out and has_decode and prefill_turn:  # nothing admissible (blocks): decode instead
            out = self._schedule(decodes=True, prefills=False)
            prefill_turn = False
        self.last_was_prefill = bool(prefill_turn) and bool(out)
        return out

    def has_prefill_work(self) -> bool:
        return bool(self.waiting) or not all(r.is_decode for r in self.running)

    def _schedule(self, decodes: bool, prefills: bool) -> list[Scheduled]:
        budget = self.cfg.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted = False
        i = 0
        room = self.blocks.block_size  # tokens per block (a decode whose blocks already hold its step skips ensure)
        while i < len(self.running):
            req = self.running[i]
            is_decode = 0 < req.num_computed == req.num_tokens - 1  # Request.is_decode, inlined: runs per sequence
            if not (decodes if is_decode else prefills) or req.ends_in_flight:
                i += 1  # the other kind's step, or its last token is already in flight
                continue
            n, verify = self._decode_cost(req) if is_decode else self._cost(req, budget)
            if n > budget or n == 0:
                i += 1  # no room this step; it keeps its blocks and runs next step
                continue
            need = self._need(req, n)
            while (need > len(req.block_ids) * room or not req.state_slots) and not self.blocks.ensure(req, need):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue  # req preempted itself; running shrank
            out.append(Scheduled(req, n, verify))
            budget -= n
            i += 1
        # after a preemption nothing new is admitted this step (it would only be preempted again)
        while prefills and self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not preempted:
            req = self.waiting[0]
            hashes = self._hashes(req)
            if hashes and self._awaits_prefix(hashes):
                break  # its prefix is being computed by a running request: a few steps, then it hits
            hit = self._match(req, hashes)
            n, verify = self._cost(req, budget)  # a verify: a recompute whose cache hit reaches its newest token
            if not self.blocks.ensure(req, self._need(req, n)):
                if hit:  # not admitted after all: give the cached blocks back
                    self.blocks.free(req)
                    req.num_computed, req.restore_from, req.num_cached_tokens = 0, None, 0
                break  # FCFS: nobody jumps the queue
            if self.blocks.caching:
                self.blocks.index.count(len(req.prefix_hashes) * self.blocks.block_size, req.num_cached_tokens)
            self.waiting.popleft()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(Scheduled(req, n, verify))
            budget -= n
        if out and all(s.verify and self._may_end_in_flight(s.req) for s in out):
            # every row's verify in flight may be its last (1..k + 1 tokens each): a step launched now would often
            # have every row dropped, and at batch 1 that launch is a whole step of host work (bench/offline.py: ~4 %
            # of a k = 3 request's decode time). Committing first costs a short wait for the device; a row that goes
            # on runs in the next step.
            return []
        return out

    def _hashes(self, req: Request) -> list[bytes] | None:
        """The block names a request starting from nothing looks up (prefix caching on); None: it does not (prompt
        log-probs need every prompt position's logits)."""
        if not self.blocks.caching or req.block_ids or req.num_computed or req.params.prompt_logprobs is not None:
            return None
        return self.blocks.prefix_hashes(req)

    def _awaits_prefix(self, hashes: list[bytes]) -> bool:
        """n > 1, repeated prompts and a shared system prompt share one prefill: a running request that has not
        yet reached one of its snapshot points, where its prefix is this one's, is about to publish it. Derived
        from the running list each time, so a preempted or finished publisher never leaves anyone waiting."""
        bs = self.blocks.block_size
        for r in self.running:
            for p in r.snap_points:
                i = p // bs - 1
                if r.num_computed < p and i < len(hashes) and hashes[i] == r.prefix_hashes[i]:
                    return True
        return False

    def _match(self, req: Request, hashes: list[bytes] | None) -> bool:
        """Prefix caching: a request starting from nothing takes the longest cached prefix (its blocks, and the GDN
        snapshot to restore before its first forward), and gets its snapshot points: its own prompt's end, the
        end of the cached blocks it shares (a prefix another request computed without a snapshot there), and the
        end of what it shares with requests waiting behind it (they will wait for it: `_awaits_prefix`)."""
        if hashes is None:
            return False
        bs = self.blocks.block_size
        points = {len(hashes) * bs, self.blocks.index.named_run(hashes) * bs}
        for other in itertools.islice(self.waiting, 1, 33):
            theirs = self._hashes(other)
            if theirs:
                points.add(_common(hashes, theirs) * bs)
        hit = self.blocks.match(req, hashes)
        if hit is not None:
            req.num_computed = req.num_cached_tokens = hit.tokens
            req.restore_from = hit.snapshot
        req.snap_points = sorted(p for p in points if p > req.num_computed)
        return hit is not None

    @staticmethod
    def _may_end_in_flight(req: Request) -> bool:
        """Its verify in flight (1..k + 1 tokens; the k drafts it holds stand for the next verify's) may reach
        max_tokens."""
        m = req.params.max_tokens
        return (req.num_inflight > 0 and m is not None
                and len(req.output_ids) + req.num_inflight * (1 + len(req.drafts)) >= m)

    def may_preempt(self) -> bool:
        """Whether the next schedule could preempt: a running prefill may need any number of blocks; decodes need
        what their next verify and the draft lookahead reach. Async scheduling resolves in-flight tokens first then
        (a preempted request re-prefills its tokens, so they must be known)."""
        need, blocks_for = 0, self.blocks.blocks_for
        for r in self.running:
            if not 0 < r.num_computed == r.num_tokens - 1:  # not a decode (Request.is_decode, inlined)
                return True
            need += max(0, blocks_for(self._need(r, self._decode_cost(r)[0])) - len(r.block_ids))
        return need > self.blocks.num_free_blocks

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop its cache, keep its tokens and its drafts; it re-prefills prompt + output up
        to the newest token later, then verifies the drafts it had. Dropping them would change a seeded sample's
        output: their draws are already taken from its generator, and a recompute that samples the next token
        afresh draws differently from a verify."""
        assert not req.num_inflight, "preempting a request with tokens in flight"
        self.running.remove(req)
        self.blocks.free(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req)
        req.status = Status.FINISHED
        req.finish_reason = req.finish_reason or reason


def _common(a: list[bytes], b: list[bytes]) -> int:
    """Leading block names two prompts share (chain hashes: equal at i means equal up to i)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
