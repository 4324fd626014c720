"""Committing a step's tokens to a request: stop conditions, acceptance statistics, the streamed StepOutput.

Shared by the host path (sampling / verification on the host) and the device greedy path (acceptance on the
device): both end in `OutputProcessor.emit` and, for a verify step, `commit_spec`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mtp_ray.engine.request import Request
from mtp_ray.engine.scheduler import Scheduler
from mtp_ray.engine.stats import EngineStats

# why a request ended with an error at a token (here, where StepOutput lives: the serving side imports this module
# without torch)
NON_FINITE = ("the model's logits are not finite at output token {} (NaN / inf): are its weights finite (e.g. after "
              "update_weights) and in its dtype's range?")
NO_TOKEN_LEFT = ("allowed_token_ids, bad_words, min_tokens and logit_bias together rule out every token at output "
                 "token {}")


def first_nan(logprobs: list[float]) -> int | None:
    """The first NaN log-prob (a non-finite logit row: its argmax means nothing), or None; one sum in the common
    case (log-probs are <= 0, so only a NaN makes the sum NaN)."""
    s = sum(logprobs)
    if s == s:
        return None
    return next(i for i, lp in enumerate(logprobs) if lp != lp)


@dataclass
class StepOutput:
    """What one step produced for one request (the unit streamed to clients)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    spec: dict = field(default_factory=dict)
    error: str | None = None  # the request was refused (finish_reason "error"): why, for the caller's exception
    timings: dict = field(default_factory=dict)  # at the end: Request.timings() (queue / prefill / decode seconds)
    # with the first token, when asked: per prompt position None (the first) or (logprob, {token: logprob} top-n)
    prompt_logprobs: list | None = None
    # prompt tokens taken from the prefix cache (None: prefix caching is off): usage.prompt_tokens_details
    num_cached_tokens: int | None = None
    # the last token is the stop token or end token that ended it: in token_ids, not in the text unless
    # include_stop_str_in_output (vLLM's detokenizer)
    stop_token: bool = False
    # per new token its rank in the vocabulary (1: the likeliest) where the step knew it; None: not known
    new_ranks: list[int | None] | None = None
    model_fault: bool = False  # the error is the model's (non-finite logits), not the caller's: 500, not 400

    def then(self, later: StepOutput) -> StepOutput:
        """This delta followed by a later one of the same request, as one (its end state is the later one's)."""
        assert later.request_id == self.request_id and not self.finished
        return StepOutput(self.request_id, self.new_token_ids + later.new_token_ids,
                          self.new_logprobs + later.new_logprobs, self.new_top_logprobs + later.new_top_logprobs,
                          later.finished, later.finish_reason, later.stop_reason, later.num_prompt_tokens, later.spec,
                          later.error, later.timings,
                          self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
                          later.num_cached_tokens, later.stop_token,
                          None if self.new_ranks is later.new_ranks is None else self.ranks() + later.ranks(),
                          later.model_fault)

    def ranks(self) -> list[int | None]:
        """new_ranks, one per new token (None where not known)."""
        return self.new_ranks if self.new_ranks is not None else [None] * len(self.new_token_ids)


def prompt_logprob_dicts(entries: list, prompt_ids: list[int]) -> list[dict[int, float] | None]:
    """StepOutput.prompt_logprobs as vLLM's offline form: per position None (the first) or {token: logprob} of the
    prompt's token and the top-n alternatives."""
    return [None if e is None else {t: e[0], **dict(e[1])} for e, t in zip(entries, prompt_ids, strict=True)]


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, requests: dict[str, Request], eos_ids: tuple[int, ...],
                 max_model_len: int, stats: EngineStats, primary_eos: int | None = None):
        self.scheduler, self.requests = scheduler, requests  # finished requests leave both
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        # the end token whose stop has no stop_reason (the tokenizer's; else the model's first)
        self.primary_eos = primary_eos if primary_eos is not None else (eos_ids[0] if eos_ids else None)
        self.stats = stats  # the engine's counters: verify steps here

    def emit(self, req: Request, emitted: list[int], info: list[tuple[float, dict[int, float], int | None]]
             ) -> StepOutput:
        """The tokens a step produced for one request (drafts used up): appended until a stop, as one output.
        info: per token (log-prob, top log-probs, rank or None)."""
        req.drafts, req.draft_probs = [], None
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        n = self._append(req, emitted, [lp for lp, _, _ in info], [top for _, top, _ in info])
        out = self.output(req, emitted[:n], n)
        if any(r is not None for _, _, r in info):
            out.new_ranks = [r for _, _, r in info[:n]]
        return out

    def emit_greedy(self, req: Request, tokens: list[int], logprobs: list[float]) -> StepOutput:
        """emit() of plain-greedy tokens (no top log-probs) read from the device's greedy block: every sequence of
        every device-greedy step (k = 0: one token; k > 0: the accepted drafts and the target's token)."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.drafts = []
        n = self._append(req, tokens, logprobs, None)
        if n < len(tokens):
            tokens, logprobs = tokens[:n], logprobs[:n]
        done = req.finished
        return StepOutput(req.request_id, tokens, logprobs, [{} for _ in tokens], done, req.finish_reason,
                          req.stop_reason, len(req.prompt_ids), req.spec_stats() if done else {}, req.error,
                          req.timings() if done else {}, None, self._cached(req),
                          new_ranks=[1] * len(tokens) if req.params.logprobs is not None else None,  # the argmax
                          model_fault=req.model_fault)

    def commit_spec(self, req: Request, accepted: int, k: int) -> None:
        """GDN rollback: the state after token `accepted` of the verify becomes the sequence's state."""
        self.stats.count_verify(k, accepted)
        req.num_verify_steps += 1
        req.num_drafted += k
        req.num_accepted += accepted
        if len(req.accepted_per_pos) < k:
            req.accepted_per_pos += [0] * (k - len(req.accepted_per_pos))
        for i in range(accepted):
            req.accepted_per_pos[i] += 1
        slots = req.state_slots
        slots[0], slots[1 + accepted] = slots[1 + accepted], slots[0]

    def _append(self, req: Request, tokens: list[int], logprobs: list[float],
                tops: list[dict[int, float]] | None) -> int:
        """Append emitted tokens (with their log-probs and top log-probs: None, none asked) until a stop condition;
        returns how many were kept. A NaN log-prob (no finite logit in its row) ends the request with the model's
        error after the tokens before it."""
        bad = first_nan(logprobs)
        if bad is not None:
            n = self._append(req, tokens[:bad], logprobs[:bad], None if tops is None else tops[:bad])
            if not req.finished:
                self.fail(req, NON_FINITE.format(len(req.output_ids)))
            return n
        p = req.params
        if self._none_stops(req, tokens):  # the common case, in bulk: a verify emits up to k + 1 tokens a step
            req.output_ids += tokens
            req.output_logprobs += logprobs
            req.top_logprobs += [{} for _ in tokens] if tops is None else tops
            return len(tokens)
        for i, t in enumerate(tokens):
            req.output_ids.append(t)
            req.output_logprobs.append(logprobs[i])
            req.top_logprobs.append({} if tops is None else tops[i])
            reason = None
            if t in p.stop_token_ids:
                reason, req.stop_reason = "stop", t  # vLLM: the stop token id; None for the end-of-sequence token
                req.stop_token = True
            elif t in self.eos_ids and not p.ignore_eos:
                reason, req.stop_token = "stop", True
                if t != self.primary_eos:  # vLLM: generation_config's other end tokens are stop_token_ids
                    req.stop_reason = t
            elif req.grammar is not None and (failed := req.grammar.commit(t)) is not None:
                # a token the constraint cannot run past ends the request with an error, not a plausible "stop"
                del req.output_ids[-1], req.output_logprobs[-1], req.top_logprobs[-1]
                self.fail(req, f"structured_outputs: the constraint failed while generating: {failed}", model=False)
                return i
            elif req.grammar is not None and req.grammar.finished:
                reason = "stop"  # the output is complete (nothing but the end may follow): as an end token would
            elif p.max_tokens is not None and len(req.output_ids) >= p.max_tokens:
                reason = "length"
            elif req.num_known >= self.max_model_len:  # tokens still in flight (async scheduling) do not count
                reason = "length"
            if reason:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
                return i + 1
        return len(tokens)

    def _none_stops(self, req: Request, tokens: list[int]) -> bool:
        """Whether no stop condition of `_append`'s can hold at any of these tokens (no constraint to advance)."""
        p, n = req.params, len(tokens)
        return (req.grammar is None and not any(t in p.stop_token_ids for t in tokens)
                and (p.ignore_eos or not any(t in self.eos_ids for t in tokens))
                and (p.max_tokens is None or len(req.output_ids) + n < p.max_tokens)
                and req.num_known + n < self.max_model_len)

    def output(self, req: Request, new: list[int], n: int) -> StepOutput:
        return StepOutput(
            request_id=req.request_id, new_token_ids=list(new),
            new_logprobs=req.output_logprobs[len(req.output_logprobs) - n:] if n else [],
            new_top_logprobs=req.top_logprobs[len(req.top_logprobs) - n:] if n else [],
            finished=req.finished, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            num_prompt_tokens=len(req.prompt_ids), spec=req.spec_stats() if req.finished else {},
            timings=req.timings() if req.finished else {}, num_cached_tokens=self._cached(req), error=req.error,
            stop_token=req.stop_token, model_fault=req.model_fault,
        )

    def fail(self, req: Request, message: str, model: bool = True) -> None:
        """End a request with an error: the model's (its logits were not finite) or its own (model=False: its
        constraints left no token, or its grammar failed); the others go on."""
        req.error, req.model_fault = message, model
        self.scheduler.finish(req, "error")
        self.requests.pop(req.request_id, None)

    def _cached(self, req: Request) -> int | None:
        return req.num_cached_tokens if self.scheduler.blocks.caching else None
