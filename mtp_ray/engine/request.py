"""Request state inside one engine (one DP rank): tokens, cache ownership, drafts, stats."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mtp_ray.engine.sampling_params import ParamError, SamplingParams

if TYPE_CHECKING:  # (hints only: the HTTP ingress checks requests with this module and imports no torch)
    import torch

    from mtp_ray.engine.grammar import Grammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    stop_token: bool = False  # its last token is the stop / end token that ended it (its text is not output)
    # KV and state ownership
    block_ids: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)  # [main, spec_0..spec_k]
    num_computed: int = 0  # tokens whose KV / state is in the cache (target)
    # prefix caching (engine/scheduler.py): names of its full blocks before the last known token, the block
    # boundaries where it publishes its blocks with a GDN state snapshot (ascending; its prompt's end, and where
    # other prompts share its prefix), the snapshot to restore before its first forward, the tokens it took from
    # the cache
    prefix_hashes: list[bytes] = field(default_factory=list)
    hashed_known: int = -1  # num_known when prefix_hashes was computed
    snap_points: list[int] = field(default_factory=list)
    restore_from: int | None = None
    num_cached_tokens: int = 0
    # async scheduling: tokens sampled by a step whose results are still on the device; they count in num_tokens
    # (so the next step decodes after them) but are not in output_ids yet
    num_inflight: int = 0
    # speculative decoding
    drafts: list[int] = field(default_factory=list)  # proposed tokens for the next verify
    draft_probs: torch.Tensor | None = None  # [k, V] the draft distribution each draft was sampled from
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_verify_steps: int = 0
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when it first left the waiting queue (queue time ends)
    # output constraints: the grammar after the committed output, and allowed_token_ids as a mask [V]
    grammar: Grammar | None = None
    compiling: Future | None = None  # the grammar being compiled (the request waits outside the scheduler)
    allowed: torch.Tensor | None = None
    error: str | None = None  # why it ended with finish_reason "error" (StepOutput.error: the caller's ValueError)
    model_fault: bool = False  # ... and the error is the model's (non-finite logits), not the caller's
    # prompt_logprobs: (logprob, {token: logprob} top-n, rank) of prompt token p + 1, for p = 0 .. as computed
    prompt_lps: list[tuple[float, dict[int, float], int]] = field(default_factory=list)
    prompt_lps_sent: bool = False
    # its parameters allow the device-greedy path (engine/commit.py: plain_greedy): read per row every graph step,
    # so decided once (the engine does not change a request's parameters)
    greedy_params: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.greedy_params = p.greedy and not p.reshapes_logits and not p.alternatives

    def mask(self) -> torch.Tensor | None:
        """bool [V] of the tokens this request may sample next (None: any)."""
        if self.grammar is None:
            return self.allowed
        m = self.grammar.allowed()
        return m if self.allowed is None else m & self.allowed

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (this runs for every sequence every step). Positions of
        in-flight tokens read 0: their ids are on the device, where the step that feeds them takes them."""
        p, known = len(self.prompt_ids), self.num_known
        if end == start + 1:  # one token (a decode step): the common case, kept short
            if start >= known:  # in flight (its id is on the device), or past the end (an empty slice)
                return [0] if start < known + self.num_inflight else []
            return [self.output_ids[start - p]] if start >= p else [self.prompt_ids[start]]
        if self.num_inflight and end > known:
            pad = [0] * max(0, min(end, known + self.num_inflight) - max(start, known))
            return (self.tokens(start, known) if start < known else []) + pad
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has (prompt and committed output)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def ends_in_flight(self) -> bool:
        """Its in-flight tokens reach max_tokens: nothing after them is generated, whatever they turn out to be."""
        m = self.params.max_tokens
        return self.num_inflight > 0 and m is not None and len(self.output_ids) + self.num_inflight >= m

    @property
    def is_prefill(self) -> bool:
        """True until every token but the newest one is in the cache."""
        return self.num_computed < self.num_tokens - 1

    @property
    def is_decode(self) -> bool:
        """The next step feeds only the newest token (plus drafts) on top of a cached prefix."""
        return 0 < self.num_computed == self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def timings(self) -> dict[str, float]:
        """vLLM's per-request phases, in seconds, at its end: queue (arrival -> first scheduled), prefill (-> first
        token), decode (-> now), inference (first scheduled -> now)."""
        now = time.monotonic()
        sched = self.first_scheduled_time if self.first_scheduled_time is not None else now
        first = self.first_token_time if self.first_token_time is not None else now
        return {"queue_s": sched - self.arrival, "prefill_s": first - sched, "decode_s": now - first,
                "inference_s": now - sched}

    def spec_stats(self) -> dict:
        return {
            "num_drafts": self.num_verify_steps,
            "num_draft_tokens": self.num_drafted,
            "num_accepted_tokens": self.num_accepted,
            "accepted_per_pos": list(self.accepted_per_pos),
            # tokens emitted per verify step (accepted drafts + the target's own token)
            "mean_acceptance_length": (1 + self.num_accepted / self.num_verify_steps) if self.num_verify_steps else 0.0,
        }


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  max_logprobs: int = 20) -> None:
    """The one place a request is checked against the model (offline API, engine, group): its token-id prompt and the
    token ids its parameters name; ValueError naming the field. (params.validate() checks the values themselves; a
    constraint compiles with engine/grammar.py: check_grammar, which may take seconds, so callers run it where
    that does not block: the group off its event loop, the engine in its compile threads.)"""
    if not prompt_ids:
        raise ParamError("prompt must not be empty", "prompt")
    bad_ids = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad_ids:
        raise ParamError(f"prompt token ids must be integers in [0, {vocab_size}); out of vocabulary: "
                         f"{', '.join(map(repr, bad_ids[:8]))}", "prompt")
    if max_model_len and len(prompt_ids) >= max_model_len:
        raise ParamError(f"prompt has {len(prompt_ids)} tokens; the maximum context length is {max_model_len} "
                         f"(prompt + at least one generated token)", "prompt")
    # what only the tokenising side can do reaches here done, or fails: never silently ignored
    keep = params.truncate_prompt_tokens
    if keep is not None and keep > 0 and len(prompt_ids) > keep:
        raise ParamError(f"truncate_prompt_tokens: the prompt has {len(prompt_ids)} tokens, more than the {keep} it "
                         "keeps: LLM.generate cuts prompts, this path takes them as given", "truncate_prompt_tokens")
    if params.bad_words and params.bad_words_token_ids is None:
        raise ParamError("bad_words need the tokenizer's token sequences (SamplingParams.update_from_tokenizer, done "
                         "by LLM.generate and the server); or pass bad_words_token_ids", "bad_words")
    params.check_vocab(vocab_size)
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        n = getattr(params, name)
        n = vocab_size if n == -1 else n
        if n is not None and n > cap:  # (vLLM's words)
            raise ParamError(f"Requested {what} logprobs of {n}, which is greater than max allowed: {cap} "
                             "(the engine's max_logprobs)", name)
