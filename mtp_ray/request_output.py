"""What LLM.generate returns, in vLLM's shape (vllm/outputs.py, vllm/logprobs.py), so vLLM code reads it as is:
`logprobs` per generated token as {token id: Logprob}, `cumulative_logprob`, prompt_logprobs likewise. The raw
per-token floats stay beside them (`token_logprobs`, `top_logprobs`), as RL code wants them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's: a token's log-probability, its rank among the vocabulary (1: the likeliest; None where unknown: a
    logprob_token_ids entry) and its text alone."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the generated tokens' log-probs
    logprobs: list[dict[int, Logprob]] | None  # per token: the sampled one and the top-n (None: not asked)
    finish_reason: str | None
    stop_reason: int | str | None
    token_logprobs: list[float] = field(default_factory=list)  # each generated token's log-prob, asked or not
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per token the top-n (logprobs=n)
    token_ranks: list[int | None] = field(default_factory=list)  # per token its rank in the vocabulary (None: unknown)
    spec: dict = field(default_factory=dict)  # drafted / accepted / mean acceptance length
    error: str | None = None  # finish_reason "error": why (e.g. a constraint that failed while generating)

    def finish_logprobs(self, asked: bool, ranked: bool, decode: Callable[[int], str] | None) -> None:
        """The vLLM fields from the raw ones, once the output ended (cut at its stop). ranked: the top dicts are
        the top-n (logprobs=n), not the log-probs of given tokens (logprob_token_ids)."""
        self.cumulative_logprob = sum(self.token_logprobs)
        if asked:
            self.logprobs = [_entry(t, lp, top, decode, rank, by_order=ranked) for t, lp, top, rank in
                             zip(self.token_ids, self.token_logprobs, self.top_logprobs, self.token_ranks,
                                 strict=True)]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # per prompt position None (the first) or {token: Logprob} of the prompt's token (its true rank) and the top-n
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # prompt tokens taken from the prefix cache (the most any of its n samples took; None: caching off), as vLLM's
    num_cached_tokens: int | None = None


def _entry(token: int, lp: float, top: dict[int, float], decode: Callable[[int], str] | None,
           rank: int | None = None, by_order: bool = True) -> dict[int, Logprob]:
    """{token: Logprob} of one position: the token itself first (its rank given, or found among the top-n), then
    `top`, ranked by their order (highest first) where by_order (the top-n; not given tokens' log-probs)."""
    ranked = {t: i + 1 for i, (t, _) in enumerate(sorted(top.items(), key=lambda kv: -kv[1]))} if by_order else {}
    name = decode if decode is not None else (lambda _t: None)
    out = {t: Logprob(v, ranked.get(t), name(t)) for t, v in top.items()}
    out[token] = Logprob(lp, rank if rank is not None else ranked.get(token), name(token))
    return {token: out.pop(token), **out}


def prompt_logprobs(entries: list, prompt_ids: list[int], decode: Callable[[int], str] | None
                    ) -> list[dict[int, Logprob] | None]:
    """StepOutput.prompt_logprobs (per position None or (logprob, {token: logprob} top-n, rank)) in vLLM's shape."""
    return [None if e is None else _entry(t, e[0], e[1], decode, e[2])
            for e, t in zip(entries, prompt_ids, strict=True)]
