"""Incremental detokenisation and stop-string matching for one request's output."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import regex

# tokens decoded together at most (beyond it the older ones are committed as text): each add decodes the tail since
# the boundary, so this bounds a token's decoding cost (the ingress's largest per-token cost, bench/serve.py profile)
WINDOW = 16
KEEP = 4  # tokens left after the boundary when committing (_commit checks the split is exact)
CTX = 4  # tokens before the boundary decoded with the tail as context
REGEX_LOOKBACK = 256  # characters before the new text a stop_regex match may start in


def decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """tokenizer.decode, or the same decode straight from a fast tokenizer's Rust backend when transformers would
    return its text unchanged (no clean_up_tokenization_spaces): ~10 us less Python per call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


# stop strings are matched in text: a model without tokenizer files stops on token ids only
STOP_NEEDS_TOKENIZER = "stop: stop strings need a tokenizer; use stop_token_ids"


@dataclass
class Detokenizer:
    tokenizer: object
    stop: list[str]
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # output text so far, cut at the stop string once one matched
    stopped_by: str | None = None
    stopped_on: str | None = None  # what matched: the stop string, or the stop_regex pattern (SGLang's matched_stop)
    stop_regex: list[str] = field(default_factory=list)  # SGLang's stop_regex: a match ends the text like a stop
    stop_tokens: int | None = None  # tokens up to the one that completed the stop (the rest are not output)
    min_tokens: int = 0  # a stop counts only if it ends past the text of this many tokens (vLLM's min_tokens)
    checked: int = 0  # text searched for stops (or held back by min_tokens): a stop must end past it
    held: int = 0  # text of the first min_tokens tokens: no stop_regex match may end inside it
    emitted: int = 0  # characters already handed out by delta()
    # text of token_ids[:committed] (decoding only the tail keeps a long generation linear, not quadratic)
    committed: int = 0
    committed_text: str = ""
    ctx_text: str = ""  # the text of the CTX tokens before the boundary, decoded alone (see _after)

    def __post_init__(self) -> None:
        self._dec = decoder(self.tokenizer) if self.tokenizer is not None else None
        # stop_regex as the `regex` module compiles it: its partial matches say what text may still become a match
        # (None: a pattern it reads otherwise than `re`; then all text a match could start in is held back)
        self._partial = [_partial_pattern(p) for p in self.stop_regex]

    def decode(self, ids: list[int]) -> str:
        """ids as text, decoded as this request's output is (skip_special_tokens)."""
        return self._dec(ids, self.skip_special_tokens)

    def _after(self, split: int, ctx_text: str, end: int | None = None) -> str | None:
        """The text token_ids[split:end] add after the text of token_ids[:split]: decoded together with the CTX
        tokens before `split` (whose text alone is `ctx_text`) and that prefix cut off. The context matters for
        decoders that join or strip across tokens (WordPiece adds the space between words, Metaspace drops the
        first word's); decoding token_ids[split:] alone loses it. None where the context's text is no prefix."""
        whole = self.decode(self.token_ids[max(0, split - CTX) : end])
        return whole[len(ctx_text):] if whole.startswith(ctx_text) else None

    def _commit(self, tail: str) -> str:
        """Move the boundary forward to KEEP tokens before the end, only where the two sides decoded apart (each
        with its context) give exactly the text decoded together (so text always equals a full decode). Returns
        the text of the tokens after the boundary."""
        split = len(self.token_ids) - KEEP
        head = self._after(self.committed, self.ctx_text, split)
        ctx_text = self.decode(self.token_ids[max(0, split - CTX) : split])
        rest = self._after(split, ctx_text)
        if head is None or rest is None or head + rest != tail or "\ufffd" in head[-1:] + ctx_text[-1:]:
            return tail  # (a boundary inside a multi-byte character decodes as U+FFFD on one side)
        self.committed, self.committed_text, self.ctx_text = split, self.committed_text + head, ctx_text
        return rest

    def add(self, new_ids: list[int], stop_token: bool = False) -> None:
        """Append tokens; on a stop string set stopped_by and cut the text there. stop_token: the last one is the
        stop / end token that ended the request: kept in token_ids, its text only with include_stop_str_in_output
        (vLLM)."""
        if self.stopped_by is not None:
            return
        if stop_token and new_ids and not self.include_stop_str_in_output:
            self.add(new_ids[:-1])
            if self.stopped_by is None:
                self.token_ids.append(new_ids[-1])  # (the request ended: no later add decodes it)
            return
        if self.stop_regex and len(new_ids) > 1:  # each token's text on its own: an end-anchored pattern (`$`,
            for t in new_ids:                    # `x(?!y)`) must not cut where a step's or a pull's grouping ends
                self.add([t])
            return
        before = len(self.token_ids)
        self.token_ids.extend(new_ids)
        if self.tokenizer is None:  # token ids only: no text, no stop strings
            return
        tail = self._after(self.committed, self.ctx_text)
        if tail is None:  # (not seen: the boundary's context decodes differently now) start over from the top
            self.committed, self.committed_text, self.ctx_text = 0, "", ""
            tail = self.decode(self.token_ids)
        if len(self.token_ids) - self.committed > WINDOW:
            tail = self._commit(tail)
        full = self.committed_text + tail
        if len(self.token_ids) <= self.min_tokens:  # held back: a stop must end in later text (vLLM)
            self.text = full
            self.checked = self.held = len(full.rstrip("\ufffd"))
            return
        if before < self.min_tokens:  # this add crossed min_tokens (k > 0: several tokens a step)
            self.checked = self.held = len(self.decode(self.token_ids[: self.min_tokens]).rstrip("\ufffd"))
        else:  # (a character still incomplete at the end of the text before is not searched yet)
            self.checked = min(self.checked, len(self.text.rstrip("\ufffd")))
        hit = self._find_stop(full)
        self.checked = len(full)
        if hit is not None:
            i, j, self.stopped_by, self.stopped_on = hit
            self.stop_tokens = self._tokens_through(j, len(self.token_ids) - len(new_ids))
            full = full[: j if self.include_stop_str_in_output else i]
        self.text = full

    def _find_stop(self, full: str) -> tuple[int, int, str, str] | None:
        """The first stop in the new text (a stop string ending past `checked`, a stop_regex match that needed it)
        -> (start, end, the text matched, the stop string or pattern)."""
        hits = [(i, i + len(s), s, s) for s in self.stop
                if (i := full.find(s, max(0, self.checked - len(s) + 1))) >= 0]
        # A match may end before `checked`: one with a lookahead (`x(?= \*)`) completes with later text. An empty
        # match counts too, as SGLang's re.search (`^`, `\b`). Any match ending in held-back text is new.
        for pattern in self.stop_regex:
            m = next((m for m in re.compile(pattern).finditer(full, max(0, self.checked - REGEX_LOOKBACK))
                      if m.end() > self.held or m.start() == m.end() == self.held), None)
            if m is not None:
                hits.append((m.start(), m.end(), m.group(), pattern))
        return min(hits) if hits else None

    def cut(self, *per_token: list) -> None:
        """Drop the entries (token ids, log-probs, ...) past the token that completed a stop string: they are not
        output, nor counted (with k > 0 a step's later drafts follow it)."""
        if self.stop_tokens is not None:
            for entries in per_token:
                del entries[self.stop_tokens :]

    def _tokens_through(self, end: int, before: int) -> int:
        """The fewest tokens whose text reaches `end` (they hold the whole stop): usage counts only these."""
        for m in range(before + 1, len(self.token_ids)):
            if len(self.decode(self.token_ids[:m])) >= end:
                return m
        return len(self.token_ids)

    def delta(self, finished: bool) -> str:
        """New text to stream. Until the request ends, hold back what could still become a stop string, the start of
        a stop_regex match, or an incomplete multi-byte character (a streamed text is the whole text's prefix)."""
        end = len(self.text)
        if not finished and self.stopped_by is None:
            if self.text.endswith("\ufffd"):
                end -= 1
            if self.stop:
                end = end - (max(len(s) for s in self.stop) - 1)
            if self._partial:
                end = min(end, self._regex_hold())
            end = max(self.emitted, end)
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out

    def _regex_hold(self) -> int:
        """Where the text that may still become (part of) a stop_regex match starts: the earliest match reaching the
        end of the text, partial (it needs more text) or whole (it may go on). len(text): none."""
        text = self.text
        start, hold = max(0, len(text) - REGEX_LOOKBACK), len(text)
        for p in self._partial:
            if p is None:
                return start
            m = next((m for m in p.finditer(text, start, partial=True) if m.end() == len(text)), None)
            if m is not None:
                hold = min(hold, m.start())
        return hold


def _partial_pattern(pattern: str) -> regex.Pattern | None:
    try:
        return regex.compile(pattern)
    except regex.error:
        return None
