"""Grammar-constrained decoding (structured outputs) with llguidance: a per-request token mask.

One `Grammar` per constrained request, local to its rank (no collective depends on it). Its state is the grammar
after the request's committed output: the sampler masks every row with it, a verify step asks for the masks along
the drafts (the state after each accepted draft prefix) and rolls back, and the output processor advances it with
the tokens a step commits. A draft the grammar forbids has probability 0 under the masked target, so it is
rejected, and greedy output is the same token sequence for every k.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING

from mtp_ray.engine.sampling_params import ParamError, StructuredOutputs

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


# json.dumps' layout: no free whitespace (a small model could otherwise emit newlines until max_tokens)
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed(schema):
    """An object schema with `properties` and no word on others gets additionalProperties: false, as in OpenAI's
    strict mode and xgrammar's default (vLLM): otherwise a model may add keys until max_tokens cuts the JSON."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: closed(sub) for name, sub in schema[k].items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = {"items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "additionalProperties",
               "contains"}


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar for a constraint; ParamError when it is not one llguidance can compile."""
    body = _body_text(spec)
    if spec.after is None:
        return body
    # free text up to `after` (llguidance's lazy suffix lexeme, which can roll back), optional whitespace, then
    # the constraint as a named sub-grammar
    grammars = (json.loads(body) if body.lstrip().startswith("{") else {"grammars": [{"lark_grammar": body}]}
                )["grammars"]
    grammars[0]["name"] = "body"
    top = f"start: free /[ \\t\\r\\n]*/ @body\nfree[suffix={json.dumps(spec.after)}]: /(.|\\n)*/"
    return json.dumps({"grammars": [{"lark_grammar": top}, *grammars]})


@contextmanager
def refused_as_param_error() -> Iterator[None]:
    """llguidance's errors on a constraint -> ParamError naming structured_outputs. Its Rust panics too: they arrive
    as pyo3's PanicException, a BaseException, which no `except Exception` catches (a rank's loop would die of it)."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise ParamError(f"structured_outputs: {e}", "structured_outputs") from None
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        first = (str(e).strip().splitlines() or ["no detail"])[0][:200]
        raise ParamError(f"structured_outputs: the constraint could not be compiled ({first})",
                         "structured_outputs") from None


def _body_text(spec: StructuredOutputs) -> str:
    import llguidance as lg

    with refused_as_param_error():
        if spec.json is not None or spec.json_object:
            schema = {"type": "object"} if spec.json_object else spec.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            schema = closed(schema)
            return lg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_STYLE)
        if spec.regex is not None:
            return lg.grammar_from("regex", spec.regex)
        if spec.choice is not None:
            return lg.grammar_from("choice", json.dumps(spec.choice))
        return lg.grammar_from("grammar", spec.grammar or "")


@functools.lru_cache(maxsize=256)
def _checked(key: str) -> str:
    import llguidance as lg

    spec = StructuredOutputs.coerce(json.loads(key))
    text = grammar_text(spec)
    with refused_as_param_error():
        err = lg.LLMatcher.validate_grammar(text)
    if err:
        raise ParamError(f"structured_outputs: invalid constraint: {err.strip().splitlines()[0]}",
                         "structured_outputs")
    return text


def _key(spec: StructuredOutputs) -> str:
    """The cache key, in the constraint's own key order: a schema's property order is the order the JSON is written
    in (OpenAI, vLLM and SGLang keep it; "reasoning" before "answer" is a schema's way to ask for it)."""
    raw = {k: v for k, v in vars(spec).items() if v is not None and v is not False}
    return json.dumps(raw)


_FAILED: dict[str, str] = {}  # constraint key -> why it did not compile (the newest 256): a retry fails at once
_FAILED_LOCK = threading.Lock()


def check_grammar(spec: StructuredOutputs) -> str:
    """Compiles (once per distinct constraint) -> the grammar text; ParamError naming the problem (remembered: the
    same constraint again fails without compiling again)."""
    key = _key(spec)
    why = _FAILED.get(key)
    if why is not None:
        raise ParamError(why, "structured_outputs")
    try:
        return _checked(key)
    except ParamError as e:
        note_failed(spec, str(e), key)
        raise


def note_failed(spec: StructuredOutputs, why: str, key: str | None = None) -> None:
    """Remember that a constraint does not compile (or took longer than the serving path allows: runtime/group.py)."""
    with _FAILED_LOCK:
        _FAILED[key or _key(spec)] = why
        while len(_FAILED) > 256:
            del _FAILED[next(iter(_FAILED))]


class Grammar:
    """One request's grammar state over the model's vocabulary."""

    def __init__(self, matcher, vocab_size: int, stop_ids: tuple[int, ...]):
        self.m, self.vocab_size, self.stop_ids = matcher, vocab_size, list(stop_ids)

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next; every stop token once the grammar may end here."""
        import torch  # (here: the serving side checks grammars with this module and runs no model, so no torch)

        bias = torch.frombuffer(bytearray(self.m.compute_logit_bias()), dtype=torch.uint8)
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(bias.numel(), self.vocab_size)
        mask[:n] = bias[:n] != 0
        if self.stop_ids and (mask[self.stop_ids].any() or self.m.is_accepting()):
            mask[self.stop_ids] = True
        return mask

    def masks_along(self, drafts: list[int]) -> list[torch.Tensor]:
        """k + 1 masks: after the committed output, then after each draft prefix while the grammar accepts the
        drafts (a forbidden draft is rejected there, so the later masks are never read: the last one repeats).
        The state is rolled back: only commit() advances it."""
        masks = [self.allowed()]
        taken = 0
        for d in drafts:
            if not masks[-1][d] or d in self.stop_ids or not self.m.consume_token(d):
                break
            taken += 1
            masks.append(self.allowed())
        if taken:
            self.m.rollback(taken)
        return masks + [masks[-1]] * (len(drafts) + 1 - len(masks))

    def commit(self, token: int) -> str | None:
        """A committed output token (not a stop token: the request ends there) -> None, or why the matcher could
        not take it (it failed: a constraint that validates may still exceed the lexer's limits as it runs)."""
        if self.m.consume_token(token) and not self.m.is_error():
            return None
        err = (self.m.get_error() or "the constraint refused the token").strip().splitlines()[0]
        log.warning("grammar refused committed token %d: %s", token, err)
        return err

    @property
    def finished(self) -> bool:
        """Nothing but the end can follow (a complete JSON value, one of the choices)."""
        return self.m.is_stopped()


class GrammarCompiler:
    """Builds request grammars against one tokenizer (loaded on first use: an engine without structured requests
    never pays for it). `submit` compiles off the engine's thread: a large schema takes seconds (llguidance drops the
    GIL meanwhile), and a rank's step must not wait for it, nor its DP peers in lock-step with it."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_ids: tuple[int, ...]):
        self.path, self.vocab_size, self.eos_ids = tokenizer_path, vocab_size, eos_ids
        self._tok = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, spec: StructuredOutputs, stop_ids: tuple[int, ...]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        return self._pool.submit(self.grammar, spec, stop_ids)

    def _tokenizer(self):
        with self._lock:
            return self._load()

    def _load(self):
        if self._tok is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            try:
                hf = AutoTokenizer.from_pretrained(self.path)
            except Exception as e:  # a checkpoint without tokenizer files serves token ids only
                raise ParamError(f"structured_outputs need the model's tokenizer, which did not load: {e}",
                                 "structured_outputs") from None
            eos = list(self.eos_ids) or None
            self._tok = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
        return self._tok

    def grammar(self, spec: StructuredOutputs, stop_ids: tuple[int, ...]) -> Grammar:
        import llguidance as lg

        tok, text = self._tokenizer(), check_grammar(spec)
        with refused_as_param_error():
            m = lg.LLMatcher(tok, text, log_level=0)
        if m.is_error():
            raise ParamError(f"structured_outputs: {m.get_error()}", "structured_outputs")
        return Grammar(m, self.vocab_size, stop_ids)
