"""Committer: the host path of a step's commit. Each sequence's rows are sampled or verified (logits reduced on
the device first; only rows that sample or report top-n log-probs come to the host), stop checks and outputs go
through the OutputProcessor, and each sequence that goes on gets its draft-loop item. Plain greedy rows of a graph
step skip this (engine/device_greedy.py); prompt log-probs are scored here, where the prefill's logits are."""

from __future__ import annotations

import torch

from mtp_ray.engine.inputs import StepInputs
from mtp_ray.engine.mtp import DraftItem
from mtp_ray.engine.outputs import NO_TOKEN_LEFT, NON_FINITE, OutputProcessor, StepOutput
from mtp_ray.engine.rejection import verify
from mtp_ray.engine.request import Request
from mtp_ray.engine.runner import ModelRunner
from mtp_ray.engine.sampler import (
    NoTokenLeft,
    Row,
    logprob_info,
    reduce_rows,
    sample_row,
    top_count,
)
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.engine.scheduler import Scheduled


def stop_ids(p: SamplingParams, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The token ids that end a request with these params."""
    return (() if p.ignore_eos else eos_ids) + tuple(p.stop_token_ids)


def plain_greedy(req: Request) -> bool:
    """Greedy on the raw logits (nothing reshapes or masks them), no top-n log-probs, prompt log-probs (if asked)
    already out with the first token: the device argmax decides."""
    p = req.params
    return (req.greedy_params and len(req.output_ids) >= p.min_tokens
            and (p.prompt_logprobs is None or req.prompt_lps_sent))


class Committer:
    def __init__(self, runner: ModelRunner, out: OutputProcessor, eos_ids: tuple[int, ...], k: int):
        self.runner, self.out, self.eos_ids, self.k = runner, out, eos_ids, k

    def commit(self, sched: list[Scheduled], inp: StepInputs, hidden: torch.Tensor, all_logits: torch.Tensor | None,
               fast: list[bool]) -> tuple[list[StepOutput], list[DraftItem]]:
        """Sample or verify each sequence's rows on the host path -> its output and its draft-loop item. Logits are
        reduced on the device; only rows that sample or report top-n log-probs come to the host."""
        self._score_prompts(sched, inp, hidden)
        rows = [r for rs in inp.logit_rows for r in rs]
        sl = None
        if rows:
            logits = all_logits[rows] if all_logits is not None else self.runner.logits(hidden[rows])  # [N, V]
            fast, masks = self._device_masks(sched, inp, fast)
            sl = reduce_rows(logits, [not f for f, lr in zip(fast, inp.logit_rows, strict=True) for _ in lr], masks)
        outputs, items, at, host_at = [], [], 0, 0
        for i, (s, start_row, lrows) in enumerate(zip(sched, inp.batch.cu_seqlens, inp.logit_rows, strict=False)):
            n, lg = len(lrows), None
            if n:
                full = lps = None
                if not fast[i]:
                    full, lps = sl.logits[host_at : host_at + n], sl.logprobs[host_at : host_at + n]
                    host_at += n
                lg = (full, lps, sl.ids[at : at + n], sl.lp[at : at + n])
            at += n
            out, item = self._postprocess(s, lg, hidden[start_row : start_row + s.num_new], i, fast[i])
            if out is not None:
                outputs.append(out)
            if item is not None:
                items.append(item)
        return outputs, items

    def _device_masks(self, sched: list[Scheduled], inp: StepInputs, fast: list[bool]
                      ) -> tuple[list[bool], tuple[list[int], torch.Tensor] | None]:
        """Greedy rows whose only logit processing is a mask (grammar, allowed_token_ids) take the masked argmax
        where the logits are (a verify's rows: the masks along its drafts), like plain greedy rows: only the masks
        go to the device, no logit row comes to the host. -> (fast per sequence, (flat rows, masks [M, V]))."""
        fast, rows, masks, at = list(fast), [], [], 0
        for i, (s, lrows) in enumerate(zip(sched, inp.logit_rows, strict=True)):
            req, p = s.req, s.req.params
            masked = req.grammar is not None or req.allowed is not None
            masked_greedy = (masked and p.greedy and not (p.penalized or p.logit_bias or p.alternatives)
                             and len(req.output_ids) >= p.min_tokens)
            if not fast[i] and lrows and masked_greedy and (s.verify or len(lrows) == 1):
                if s.verify:
                    ms = (req.grammar.masks_along(req.drafts) if req.grammar is not None
                          else [req.allowed] * len(lrows))
                else:
                    ms = [req.mask()]
                rows += range(at, at + len(lrows))
                masks += ms
                fast[i] = True
            at += len(lrows)
        if not rows:
            return fast, None
        return fast, (rows, torch.stack(masks).to(self.runner.device, non_blocking=True))

    def _postprocess(self, s: Scheduled, lg: tuple | None, hidden: torch.Tensor, index: int,
                     fast: bool) -> tuple[StepOutput | None, DraftItem | None]:
        """lg: this sequence's rows as (logits, log-probs, argmax ids, their log-probs), or None for a non-last
        prefill chunk; logits and log-probs (host, fp32) only when not `fast`. Plain greedy (`fast`) requests
        take the argmax as computed for the whole step on the device."""
        req, start = s.req, s.req.num_computed
        if req.finished:  # it stopped at the step that was in flight (async scheduling): this row is dropped
            return None, None
        logits, logprobs, g_ids, g_lp = lg if lg is not None else (None, None, [], [])
        table: list[int] = []  # the prefill's block table, kept past a finish that releases it (_named_kv_item)
        if s.verify:
            assert g_ids and (fast or logits is not None)
            k = len(req.drafts)
            if fast:  # accept while the draft is the target's argmax, then the argmax itself
                a = next((i for i in range(k) if req.drafts[i] != g_ids[i]), k)
                emitted = req.drafts[:a] + [g_ids[a]]
            else:
                out_before = len(req.output_ids)
                masks = req.grammar.masks_along(req.drafts) if req.grammar is not None else [req.allowed] * (k + 1)
                rows = [self._row(req, req.drafts[:i], out_before + i, masks[i]) for i in range(k + 1)]
                try:
                    emitted = verify(logits, req.drafts, req.draft_probs, rows, req.generator)
                except NoTokenLeft as e:
                    return self._failed(req, e), None
            a = len(emitted) - 1
            self.out.commit_spec(req, a, k)
            req.num_computed = start + a + 1
            committed = a + 1  # the draft loop's step 1 may still run over all k + 1 rows (uniform batch)
        elif s.completes_prefill:
            assert g_ids and (fast or logits is not None)
            table = list(req.block_ids) if self.k else []
            committed = s.num_new
            if fast:
                emitted = [g_ids[-1]]
            else:
                try:
                    emitted = [sample_row(logits[-1], self._row(req, [], len(req.output_ids), req.mask()),
                                          req.generator)]
                except NoTokenLeft as e:
                    return self._failed(req, e), None
                logprobs = logprobs[-1:]
            g_lp = g_lp[-1:]
            req.num_computed = start + s.num_new
        else:
            req.num_computed = start + s.num_new
            return None, DraftItem(req, start, hidden, False, index) if self.k else None
        if fast:  # the argmax: rank 1 (asked for or not, it costs nothing)
            info = [(g_lp[i], {}, 1) for i in range(len(emitted))]
        else:
            p = req.params
            info = [logprob_info(logprobs[i], t, p.logprobs, p.logprob_token_ids) for i, t in enumerate(emitted)]
        out = self.out.emit(req, emitted, info)
        if req.params.prompt_logprobs is not None and not req.prompt_lps_sent:  # with the first token
            out.prompt_logprobs, req.prompt_lps_sent = [None, *req.prompt_lps], True
        if req.finished:
            return out, self._named_kv_item(s, start, hidden, index, table) if table else None
        return out, DraftItem(req, start, hidden, True, index, committed) if self.k else None

    def _failed(self, req: Request, e: NoTokenLeft) -> StepOutput:
        """A row with no token left: the request ends with the model's error (non-finite logits) or its own (its
        constraints rule out every token); the step goes on."""
        self.out.fail(req, (NON_FINITE if e.model else NO_TOKEN_LEFT).format(len(req.output_ids)), model=e.model)
        return self.out.output(req, [], 0)

    def _named_kv_item(self, s: Scheduled, start: int, hidden: torch.Tensor, index: int,
                       table: list[int]) -> DraftItem | None:
        """A request that ended at the step that completed its prefill drafts nothing, but the blocks its piece
        named in the prefix cache (plan_snapshots) hold MTP KV too, which only MTP step 1 writes: a later hit on
        them would draft from KV never written (outputs stay exact, acceptance falls). Step 1 still runs over the
        piece's rows whose next token is a prompt token (named blocks end before the prompt's last token), through
        the table the request held: released in this step, its blocks go to no one before the step ends."""
        if s.num_new < 2 or not any(start < p for p in s.req.snap_points):
            return None
        return DraftItem(s.req, start, hidden, False, index, committed=s.num_new - 1, block_ids=table)

    def _row(self, req: Request, extra: list[int], num_output: int, allowed: torch.Tensor | None) -> Row:
        p = req.params
        history = req.all_ids + extra if p.penalized else []
        # min_tokens holds back every end token, ignore_eos or not (vLLM: _all_stop_token_ids)
        return Row(p, history, num_output, self.eos_ids + tuple(p.stop_token_ids), allowed)

    def _score_prompts(self, sched: list[Scheduled], inp: StepInputs, hidden: torch.Tensor) -> None:
        """prompt_logprobs: the rows of a prefill piece score the prompt tokens after them, where the logits are
        (only each position's log-prob, rank and top-n come to the host; a long prompt's [P, V] rows never do);
        positions already scored (a recompute after preemption) are skipped. The piece keeps its sampling row."""
        for i, s in enumerate(sched):
            req, rows = s.req, inp.logit_rows[i]
            n_top = req.params.prompt_logprobs
            if n_top is None or s.verify or not rows:
                continue
            start, prompt = req.num_computed, req.prompt_ids
            # row j scores prompt[start + j + 1]; the next unscored position is len(prompt_lps) + 1
            js = [j for j in range(len(rows)) if len(req.prompt_lps) < start + j + 1 < len(prompt)]
            for c in range(0, len(js), 512):  # bounded device memory: 512 rows of the vocabulary at a time
                part = js[c : c + 512]
                lp = torch.log_softmax(self.runner.logits(hidden[[rows[j] for j in part]]), dim=-1)  # [m, V]
                want = torch.tensor([prompt[start + j + 1] for j in part], device=lp.device)
                tok = lp.gather(1, want[:, None])  # [m, 1]
                rank = (lp > tok).sum(-1) + 1
                top = lp.topk(top_count(n_top, lp.shape[-1]), dim=-1) if n_top else None
                tok_l, rank_l = tok.squeeze(1).tolist(), rank.tolist()
                tv, ti = (top.values.tolist(), top.indices.tolist()) if top is not None else ([[]] * len(part),) * 2
                req.prompt_lps += [(a, dict(zip(i_, v_, strict=True)), r)
                                   for a, r, v_, i_ in zip(tok_l, rank_l, tv, ti, strict=True)]
            inp.logit_rows[i] = rows[-1:] if s.completes_prefill else []
