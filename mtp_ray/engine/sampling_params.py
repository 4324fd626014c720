"""Per-request sampling parameters (vLLM's names and meanings); every bad value is a ValueError naming the field."""

from __future__ import annotations

import numbers
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any

from mtp_ray.config.model import sampling_defaults
from mtp_ray.engine.grammar_budget import BudgetError, check_budget


class ParamError(ValueError):
    """A bad request value; `param` names the request field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def need(ok: bool, name: str, what: str) -> None:
    """A ParamError naming field `name` ("<name> <what>") unless ok."""
    if not ok:
        raise ParamError(f"{name} {what}", name)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output (vLLM's StructuredOutputsParams): exactly one of a JSON schema, any JSON object,
    a regular expression, a choice of strings, or a grammar (Lark or GBNF). Enforced by engine/grammar.py."""

    json: dict | str | None = None  # a JSON schema (an object, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance) or GBNF (llama.cpp) text
    # free text up to and including this string, then the constraint: a reasoning model's think block ("</think>"),
    # so the answer after it is constrained and the reasoning is not (set by the server, as vLLM does)
    after: str | None = None

    def __post_init__(self) -> None:
        set_ = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        set_ += ["json_object"] if self.json_object is True else []
        if len(set_) != 1:
            raise ParamError(f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {set_ or 'none'}", "structured_outputs")
        if not isinstance(self.json_object, bool):
            raise ParamError("structured_outputs.json_object must be a boolean", "structured_outputs")
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            raise ParamError("structured_outputs.after must be a non-empty string", "structured_outputs")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ParamError("structured_outputs.json must be a JSON schema (an object or its text)",
                             "structured_outputs")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ParamError(f"structured_outputs.{name} must be a non-empty string", "structured_outputs")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ParamError("structured_outputs.choice must be a non-empty list of non-empty strings",
                             "structured_outputs")
        try:  # sizes first: nothing compiles (or crosses a process) a constraint past them
            check_budget(self.json, self.regex if self.regex is not None else self.grammar, self.choice)
        except BudgetError as e:
            raise ParamError(f"structured_outputs {e}", "structured_outputs") from None

    @classmethod
    def coerce(cls, v: StructuredOutputs | dict | None) -> StructuredOutputs | None:
        if v is None or isinstance(v, cls):
            return v
        if not isinstance(v, dict):
            raise ParamError("structured_outputs must be an object", "structured_outputs")
        unknown = set(v) - {"json", "json_object", "regex", "choice", "grammar", "after"}
        if unknown:
            raise ParamError(f"structured_outputs: unknown field(s) {sorted(unknown)}", "structured_outputs")
        return cls(**v)


FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 (or below 1e-5): greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # n top logprobs per generated token (the sampled token's is always returned)
    repetition_penalty: float = 1.0  # over the prompt and the output (vLLM / HF)
    presence_penalty: float = 0.0  # OpenAI's, over the output: minus this once per token that occurred
    frequency_penalty: float = 0.0  # ... minus this per occurrence
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> added to its logit, in [-100, 100]
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None  # a grammar every sampled token must follow
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    prompt_logprobs: int | None = None  # log-probs of the prompt's tokens (+ n top alternatives per position)
    # vLLM's: these tokens' log-probs at each generated position, in place of the top-n alternatives (label reads)
    logprob_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last n tokens (-1: max_model_len), as vLLM
    detokenize: bool = True  # False: token ids only, no text (vLLM's; stop strings need text)
    bad_words: list[str] | None = None  # vLLM's: words never generated (as token sequences: update_from_tokenizer)
    # the token sequences banned, filled from bad_words where the prompt is tokenised (or given directly): a
    # sequence's last token is masked where the output so far ends with the rest of it (engine/sampler.py)
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's: requests reuse each other's cached prefixes only under the same salt (tenants that must not learn,
    # from timing, what another cached); no effect on the output
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        for name in ("stop", "stop_token_ids"):  # (vLLM's defaults are None)
            if getattr(self, name) is None:
                setattr(self, name, [])
        for f in fields(self):  # numpy scalars (np.int64 max_tokens, np.float32 temperature) as Python numbers
            v = getattr(self, f.name)
            if isinstance(v, numbers.Number) and not isinstance(v, (int, float, bool)) and hasattr(v, "item"):
                setattr(self, f.name, v.item())
        self.structured_outputs = StructuredOutputs.coerce(self.structured_outputs)
        self.validate()
        # as floats from here on: an integer past 2**63 (JSON allows any) fails the tensor arithmetic it meets on a
        # rank ("int too big to convert"), which would fail the whole group
        for name in FLOAT_FIELDS:
            setattr(self, name, float(getattr(self, name)))
        if self.logit_bias:
            self.logit_bias = {t: float(v) for t, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # vLLM's rule: below this, sampling is the argmax up to float overflow

    @property
    def penalized(self) -> bool:
        """Any logit penalty that depends on the tokens so far (the raw argmax is not the greedy token then): the
        repetition / presence / frequency penalties and bad words (a ban that depends on the output so far). Such a
        row is processed on the host with its history (engine/commit.py reads this), never on the device path."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.bad_words or self.bad_words_token_ids))

    @property
    def alternatives(self) -> bool:
        """Log-probs of tokens besides the sampled one per position (top-n or named ids): the host reads the row."""
        return bool(self.logprobs) or bool(self.logprob_token_ids)

    @property
    def reshapes_logits(self) -> bool:
        """The greedy token is not the raw argmax: penalties, bad words, a logit bias or a mask (grammar, allowed
        tokens). Such a request never takes the device-greedy fast path (engine/commit.py: plain_greedy)."""
        return (self.penalized or bool(self.logit_bias) or self.structured_outputs is not None
                or self.allowed_token_ids is not None)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the parameters exist (an id past the vocabulary would fail the step that uses it)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("logprob_token_ids", self.logprob_token_ids or ()),
                          ("bad_words" if self.bad_words else "bad_words_token_ids",
                           [t for q in self.bad_words_token_ids or () for t in q])):
            out = sorted({t for t in ids if t >= vocab_size})
            if out:
                raise ParamError(f"{name} token ids must be in [0, {vocab_size}) (the vocabulary has {vocab_size} "
                                 f"tokens): out of vocabulary: {', '.join(map(str, out[:8]))}", name)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ParamError(f"unknown sampling parameter(s): {sorted(unknown)}", sorted(unknown)[0])
        return cls(**raw)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """bad_words -> bad_words_token_ids, as vLLM's: each word (leading spaces stripped) encoded alone and after a
        space (add_special_tokens=False); the spaced form is kept where it starts with another token and has as many
        tokens (a new word token, not the same one split differently), so the word is banned at the start of the
        text and in its middle."""
        if not self.bad_words:
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            seqs += [bare] if bare else []
            if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
                seqs.append(spaced)
        self.bad_words_token_ids = seqs

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens keeps it: its last n tokens (-1: max_model_len), else as is."""
        n = self.truncate_prompt_tokens
        if n is None:
            return prompt_ids
        return prompt_ids[-(max_model_len if n == -1 else n):]

    def child(self, index: int) -> SamplingParams:
        """Sample `index` of n as a request of its own (n = 1): a seeded request's samples draw from seed, seed + 1,
        ... (vLLM), wrapping past 2**63 - 1 to -2**63, so every seed the parameters accept stays valid."""
        seed = self.seed if self.seed is None else self.seed + index % self.n
        return replace(self, n=1, seed=seed - 2**64 if seed is not None and seed >= 2**63 else seed)

    def validate(self) -> None:
        def is_num(x: Any) -> bool:  # a number a float can hold
            return isinstance(x, float) or (is_int(x) and abs(x) <= sys.float_info.max)

        need(is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        need(is_num(self.temperature) and self.temperature >= 0, "temperature",
             f"must be a number >= 0, got {self.temperature!r:.80}")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        need(is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k",
             f"must be -1 or >= 0, got {self.top_k!r}")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        need(self.seed is None or (is_int(self.seed) and -2**63 <= self.seed < 2**63), "seed",  # as vLLM's
             f"must be a signed 64-bit integer (greater_than_equal -2**63, less_than_equal 2**63 - 1), "
             f"got {self.seed!r}")
        need(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
             f"must be an integer >= 1, got {self.max_tokens!r}")
        need(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
             f"must be a string or a list of non-empty strings, got {self.stop!r}")
        need(isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            need(isinstance(getattr(self, flag), bool), flag, f"must be a boolean, got {getattr(self, flag)!r}")
        for name in ("logprobs", "prompt_logprobs"):  # (the engine's max_logprobs caps them: check_request)
            v = getattr(self, name)
            need(v is None or (is_int(v) and v >= -1), name,
                 f"must be an integer >= 0 or -1 (the whole vocabulary), got {v!r}")
        need(is_num(self.repetition_penalty) and 0 < self.repetition_penalty < float("inf"), "repetition_penalty",
             f"must be a number > 0, got {self.repetition_penalty!r:.80}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(is_num(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        bias = self.logit_bias
        need(bias is None or (isinstance(bias, dict) and all(is_int(t) and t >= 0 and is_num(v) and -100 <= v <= 100
                                                             for t, v in bias.items())),
             "logit_bias", f"must map token ids to numbers in [-100, 100], got {bias!r}")
        allowed = self.allowed_token_ids
        need(allowed is None or (isinstance(allowed, list) and allowed and all(is_int(t) and t >= 0 for t in allowed)),
             "allowed_token_ids", f"must be a non-empty list of token ids, got {allowed!r}")
        ids = self.logprob_token_ids
        need(ids is None or (isinstance(ids, list) and 0 < len(ids) <= 20 and all(is_int(t) and t >= 0 for t in ids)),
             "logprob_token_ids", f"must be a list of 1..20 token ids, got {ids!r:.80}")
        need(ids is None or self.logprobs is not None, "logprob_token_ids",
             "needs logprobs (their log-probs take the place of the top alternatives)")
        n = self.truncate_prompt_tokens
        need(n is None or (is_int(n) and (n >= 1 or n == -1)), "truncate_prompt_tokens",
             f"must be an integer >= 1 or -1 (max_model_len), got {n!r}")
        need(isinstance(self.detokenize, bool), "detokenize", f"must be a boolean, got {self.detokenize!r}")
        need(self.detokenize or not self.stop, "detokenize",
             "must be True for stop strings (they are matched in the text); use stop_token_ids")
        words = self.bad_words
        need(words is None or (isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words)),
             "bad_words", f"must be a list of non-empty strings, got {words!r:.80}")
        seqs = self.bad_words_token_ids
        need(seqs is None or (isinstance(seqs, list) and all(isinstance(q, list) and q for q in seqs)
                              and all(is_int(t) and t >= 0 for q in seqs for t in q)),
             "bad_words_token_ids", f"must be a list of non-empty token-id lists, got {seqs!r:.80}")
        need(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""), "cache_salt",
             f"must be a non-empty string if provided, got {self.cache_salt!r:.80}")


def model_defaults(generation_config: str, model: str) -> dict[str, float | int]:
    """The sampling defaults of requests that leave fields out (config/model.py: sampling_defaults), checked: a value
    SamplingParams refuses is a ValueError here, once, not in every request that takes it."""
    defaults = sampling_defaults(generation_config, model)
    SamplingParams(**defaults).validate()
    return defaults
