"""Beam search, as vLLM's (vllm/beam_search.py, LLM.beam_search, the server's use_beam_search): each step asks the
engine for every live beam's 2 x beam_width likeliest next tokens (one request of max_tokens 1 with log-probs: the
model's raw log-probabilities), extends each beam by each candidate, moves those that end with an end token to the
completed ones and keeps the beam_width best of the rest by cumulative log-prob / length ** length_penalty (the
length counts the prompt, as vLLM's). After max_tokens steps the beam_width best of completed + live are the result.

`BeamSearch` is one prompt's bookkeeping alone, pure Python: whoever runs the model (LLM.beam_search in this
process, serve/http/beams.py over the engine groups) loops `pending()` -> the engine -> `advance()`, several prompts'
searches side by side. Each step is a new request
for prompt + beam, so the prefix cache (cache.prefix_caching) saves recomputing the shared part."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mtp_ray.engine.sampling_params import SamplingParams, is_int, need
from mtp_ray.request_output import Logprob

MAX_BEAM_WIDTH = 10  # 2 x beam_width candidates per step: within the engine's default max_logprobs, 20


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams. temperature is accepted for vLLM callers and changes nothing: the candidates are
    each beam's likeliest tokens by the raw log-probs (vLLM also adds the one token its step samples)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        need(is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width",
             f"must be an integer in 1..{MAX_BEAM_WIDTH} (2 x beam_width log-probs per step, at most 20), "
             f"got {self.beam_width!r}")
        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
             f"must be an integer >= 1, got {self.max_tokens!r}")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        need(is_num(self.temperature) and self.temperature >= 0, "temperature",
             f"must be a number >= 0, got {self.temperature!r}")
        need(is_num(self.length_penalty), "length_penalty", f"must be a finite number, got {self.length_penalty!r}")
        need(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output",
             f"must be a boolean, got {self.include_stop_str_in_output!r}")

    def step_params(self, top_logprobs: int = 0, cache_salt: str | None = None) -> SamplingParams:
        """One step's request: one token and the 2 x beam_width likeliest (more when the response shows more),
        under the request's cache_salt."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              logprobs=max(2 * self.beam_width, top_logprobs), cache_salt=cache_salt)


@dataclass
class BeamSearchSequence:
    """One beam: prompt + generated tokens, per generated token the step's candidates {token: Logprob}, the sum of
    its tokens' log-probs; text (LLM.beam_search: the whole sequence decoded) once it is returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop": ended with an end token; "length": max_tokens
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: the beam_width best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_ids: tuple[int, ...], length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty; an end token last does not count (vLLM's get_beam_search_score)."""
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos_ids else 0)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


def ranked(top: dict[int, float]) -> dict[int, Logprob]:
    """A step's top-n {token: logprob} (the vocabulary's likeliest) as {token: Logprob}, likeliest first, ranked."""
    order = sorted(top.items(), key=lambda kv: -kv[1])
    return {t: Logprob(lp, i + 1) for i, (t, lp) in enumerate(order)}


class BeamSearch:
    """One prompt's beams, advanced a token at a time by whoever runs the model."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_ids: tuple[int, ...]):
        self.params, self.eos_ids = params, tuple(eos_ids)
        self.prompt_len = len(prompt)
        self.beams = [BeamSearchSequence(list(prompt))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    def pending(self) -> list[list[int]]:
        """The token ids (prompt + beam) of every live beam, whose candidates the next step needs; [] once
        max_tokens steps ran or no beam is left."""
        if self.steps >= self.params.max_tokens:
            return []
        return [b.tokens for b in self.beams]

    def advance(self, candidates: list[dict[int, Logprob]]) -> None:
        """Each pending beam's candidates {token: Logprob} (its step's top 2 x beam_width), in pending() order."""
        eos = () if self.params.ignore_eos else self.eos_ids
        assert len(candidates) == len(self.beams), "one candidate set per pending beam"
        grown = []
        for beam, cands in zip(self.beams, candidates, strict=True):
            for token, lp in cands.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [cands], beam.cum_logprob + lp.logprob)
                if token in eos:
                    new.finish_reason = "stop"
                    self.completed.append(new)
                else:
                    grown.append(new)
        grown.sort(key=self._score, reverse=True)
        self.beams = grown[:self.params.beam_width]
        self.steps += 1

    def results(self) -> list[BeamSearchSequence]:
        """The beam_width best of the completed and the live beams (finish_reason "length"), best first."""
        for b in self.beams:
            b.finish_reason = b.finish_reason or "length"
        return sorted(self.completed + self.beams, key=self._score, reverse=True)[:self.params.beam_width]

    def generated(self, seq: BeamSearchSequence) -> list[int]:
        """The tokens beam `seq` added to the prompt."""
        return seq.tokens[self.prompt_len:]

    def _score(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq, self.eos_ids, self.params.length_penalty)
