"""SGLang's native generate API (`POST /generate`) over the completions path, for the clients written against it
(RL rollout loops, sglang's RuntimeEndpoint, scripts that post `{"text", "sampling_params"}`): text or input_ids, one
or a batch; sampling_params in SGLang's names; return_logprob with top_logprobs_num and logprob_start_len; stream.

The answer per request is {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "e2e_latency", log-probs}}, a list of them for a batch or n > 1 (prompt-major,
as SGLang orders them). Streamed: one server-sent event per update with the text and ids so far (SGLang's default,
not incremental), then `data: [DONE]`. Log-prob entries are SGLang's [logprob, token id, text or null] triples.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from mtp_ray import __version__
from mtp_ray.engine.sampling_params import is_int
from mtp_ray.serve.openai.errors import bad
from mtp_ray.serve.openai.field_table import names, renames
from mtp_ray.serve.openai.fields import check_fields, flag
from mtp_ray.serve.openai.request import int_field

_DEFAULT_MAX_NEW = 128  # SGLang's max_new_tokens default
# passed on to the completions route (its field rules take them: honoured, ignored, or neutral values only); the
# sampling_params under the completion field's name (SGLang's max_new_tokens is max_tokens)
_PASSED = names("generate", "pass")
_SAMPLING = renames("sampling_params")


def front(body: dict, model: str, tok) -> tuple[dict, Native]:
    """A /generate request -> (its completion body, the Native that answers it); 400 naming a field it cannot take."""
    check_fields(body, "generate")
    prompt, single = _prompt(body)
    out = {**{k: body[k] for k in _PASSED if k in body}, "prompt": prompt, **_sampling(body.get("sampling_params"))}
    stream, want_lp = flag(body, "stream"), flag(body, "return_logprob")
    score_only = out["max_tokens"] == 0  # the prompt's log-probs only (scoring): the completions path's echo form
    if score_only:
        if stream:
            raise bad("'max_new_tokens' 0 (scoring the prompt) is answered whole: send 'stream' false", "stream")
        out["echo"] = True
    out.update(stream=stream, return_token_ids=True, return_tokens_as_token_ids=True)
    start = int_field(body, "logprob_start_len", 0, minus_one="no prompt log-probs")
    start = -1 if start is None else start
    top = int_field(body, "top_logprobs_num", 0) or 0
    if want_lp:
        out["logprobs"] = top
        if start >= 0:
            if stream:  # (the completions path scores a prompt in a whole answer only)
                raise bad("the prompt's log-probs (logprob_start_len >= 0) are answered whole: send 'stream' false, "
                          "or logprob_start_len -1", "logprob_start_len")
            out["prompt_logprobs"] = top
    rid, prompts, n = body.get("rid"), 1 if single else len(prompt), out.get("n", 1)
    if rid is not None and not (isinstance(rid, str) or (_list_of(rid, str) and len(rid) == prompts)):
        raise bad("'rid' must be a string, or a list of strings with one per prompt", "rid")
    n = n if is_int(n) else 1  # (a bad n: the completions path names it)
    words = tok if flag(body, "return_text_in_logprobs") else None
    return out, Native(n, start, top if want_lp else 0, words, score_only, rid, flag(body, "return_prompt_token_ids"),
                       single and n == 1)


def _prompt(body: dict) -> tuple[str | list, bool]:
    """text or input_ids -> (the completion's prompt, whether it is one request rather than a batch)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad("send exactly one of 'text' and 'input_ids'", "text" if text is not None else "input_ids")
    if text is not None:
        if not (isinstance(text, str) or _list_of(text, str)):
            raise bad("'text' must be a string or a list of strings", "text")
        return text, isinstance(text, str)
    if not (_list_of(ids, int) or (_list_of(ids, list) and all(_list_of(x, int) for x in ids))):
        raise bad("'input_ids' must be a list of token ids or a list of such lists", "input_ids")
    return ids, _list_of(ids, int)


def _sampling(sp) -> dict:
    """SGLang's sampling_params (one object, or one per request that all agree) -> completion fields; null values
    keep the default, max_new_tokens 128 when absent (SGLang's)."""
    if isinstance(sp, list):  # one per request: a batch's must agree (the completions path samples them alike)
        if not sp or any(s != sp[0] for s in sp):
            raise bad("per-request 'sampling_params' that differ within one batch are not supported: send the "
                      "requests separately", "sampling_params")
        sp = sp[0]
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise bad("'sampling_params' must be an object", "sampling_params")
    out = {"max_tokens": _DEFAULT_MAX_NEW}
    check_fields(sp, "sampling_params")
    out.update({_SAMPLING[k]: v for k, v in sp.items() if k in _SAMPLING and v is not None})
    return out


def model_info(info: dict, tokenizer_path: str) -> dict:
    """GET /get_model_info: what SGLang's clients read to know the model (a generative one)."""
    return {"model_path": info["model"], "tokenizer_path": tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": None}


def server_info(info: dict, tokenizer_path: str, served: str, totals: dict[str, float]) -> dict:
    """GET /get_server_info: the server's settings in SGLang's names and its internal state (sglang.bench_serving
    reads internal_states[0].avg_spec_accept_length: here from this ingress replica's counters)."""
    k, dp = info["k"], info["dp"]
    drafts = totals.get("spec_decode_num_drafts_total", 0.0)
    state = {"avg_spec_accept_length": 1 + totals.get("spec_decode_num_accepted_tokens_total", 0.0) / drafts
             if drafts else None}
    return {**model_info(info, tokenizer_path), "served_model_name": served, "context_length": info["max_model_len"],
            "dp_size": dp, "tp_size": 1, "ep_size": dp, "enable_dp_attention": dp > 1,
            "speculative_algorithm": "NEXTN" if k else None, "speculative_num_steps": k or None,
            "speculative_eagle_topk": 1 if k else None, "speculative_num_draft_tokens": k + 1 if k else None,
            "version": __version__, "internal_states": [state]}


def _list_of(x, kind: type) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(v, kind) and not isinstance(v, bool) for v in x)


def _id_of(s: str) -> int:
    return int(s.removeprefix("token_id:"))


class Native:
    """One /generate request: the completion answer (or its chunks) -> SGLang's outputs."""

    def __init__(self, n: int, logprob_start: int, top_n: int, tok, score_only: bool,
                 rid: str | list[str] | None, prompt_ids: bool, single: bool):
        """tok: the tokenizer, to give log-prob entries their text (None: null); rid: the client's id(s) for
        meta_info.id (SGLang's: "<rid>_<i>" in a batch); prompt_ids: return_prompt_token_ids."""
        self.single, self.start, self.top_n, self.tok, self.score_only = single, logprob_start, top_n, tok, score_only
        self.rid, self.prompt_ids, self.n = rid, prompt_ids, n
        self.t0 = time.monotonic()
        self.acc: dict[int, dict] = {}  # streamed: per choice index, what came so far

    def _triple(self, lp: float | None, t: int) -> list:
        return [lp, t, self.tok.decode([t]) if self.tok is not None else None]

    def _tops(self, top: dict[int, float] | None) -> list | None:
        """A position's alternatives -> its top_logprobs_num best triples (SGLang's, the chosen one among them)."""
        if top is None:
            return None
        best = sorted(top.items(), key=lambda kv: -kv[1])[: self.top_n]
        return [self._triple(lp, t) for t, lp in best]

    def _output_logprobs(self, lp: dict | None) -> dict:
        """The completion's log-probs section (tokens as "token_id:<id>") -> SGLang's output lists."""
        if lp is None or self.score_only:  # (scoring: the section holds the echoed prompt only)
            lp = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        out = {"output_token_logprobs": [self._triple(v, _id_of(s))
                                         for s, v in zip(lp["tokens"], lp["token_logprobs"], strict=True)]}
        if self.top_n:  # (as SGLang: the top lists only when asked for)
            out["output_top_logprobs"] = [self._tops(None if t is None else {_id_of(k): v for k, v in t.items()})
                                          for t in lp["top_logprobs"]]
        return out

    def _input_logprobs(self, prompt: list[int], plp: list | None) -> dict:
        """vLLM's prompt_logprobs ({id: {logprob, rank}} per position, None first) -> SGLang's input lists from
        logprob_start_len (-1, its default: none)."""
        ins, tops = [], []
        if plp is not None and self.start >= 0:
            for t, e in list(zip(prompt, plp, strict=True))[self.start :]:
                ins.append(self._triple(None if e is None else e[str(t)]["logprob"], t))
                tops.append(None if e is None else self._tops({int(k): v["logprob"] for k, v in e.items()
                                                                if v["rank"] <= self.top_n}))
        return {"input_token_logprobs": ins, **({"input_top_logprobs": tops} if self.top_n else {})}

    def _rid(self, i: int, ours: str) -> str:
        """Output i's meta_info.id: the client's rid (a batch's: "<rid>_<i>"; one rid per prompt: that prompt's,
        "<rid>_<sample>" with n > 1), else the completion's id."""
        if isinstance(self.rid, list):
            p, j = divmod(i, self.n)
            return self.rid[p] if self.n == 1 else f"{self.rid[p]}_{j}"
        return (self.rid or ours) if self.single else f"{self.rid or ours}_{i}"

    def _finish(self, c: dict, n_out: int) -> dict | None:
        kind = c.get("finish_reason")
        if kind is None:
            return None
        if kind == "stop":
            return {"type": "stop", "matched": c.get("matched_stop")}
        if kind == "length":
            return {"type": "length", "length": n_out}
        return {"type": "abort", "message": kind}

    def _one(self, rid: str, c: dict, text: str, ids: list[int], prompt: list[int], cached: int, lp: dict | None,
             plp: list | None) -> dict:
        meta = {"id": self._rid(c["index"], rid), "finish_reason": self._finish(c, len(ids)),
                "prompt_tokens": len(prompt), "completion_tokens": len(ids), "cached_tokens": cached,
                "e2e_latency": round(time.monotonic() - self.t0, 6)}
        if lp is not None or plp is not None:
            meta.update(self._input_logprobs(prompt, plp), **self._output_logprobs(lp))
        out = {"text": text, "output_ids": ids, "meta_info": meta}
        if self.prompt_ids:
            out["prompt_token_ids"] = prompt
        return out if self.single else {**out, "index": c["index"]}

    def whole(self, cmpl: dict) -> dict | list[dict]:
        """A completion -> one output (a single prompt, n = 1) or the list of them."""
        details = cmpl["usage"].get("prompt_tokens_details") or {}
        cached = (details.get("cached_tokens") or 0) if len(cmpl["choices"]) == 1 else 0  # (not known per choice)
        outs = []
        for c in cmpl["choices"]:
            ids = [] if self.score_only else c["token_ids"]
            text = "" if self.score_only else c["text"]
            outs.append(self._one(cmpl["id"], c, text, ids, c["prompt_token_ids"], cached, c["logprobs"],
                                  c.get("prompt_logprobs")))
        return outs[0] if self.single else outs

    async def convert(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """Completion chunks -> SGLang's events: each choice's text and ids so far, then [DONE]."""
        async for chunk in chunks:
            if "error" in chunk:
                yield f"data: {json.dumps(chunk)}\n\n"
                continue
            for c in chunk.get("choices") or []:
                a = self.acc.setdefault(c["index"], {"text": "", "ids": [], "prompt": [], "lp": None})
                a["text"] += c.get("text") or ""
                a["ids"] += c.get("token_ids") or []
                a["prompt"] = c.get("prompt_token_ids") or a["prompt"]
                if c.get("logprobs"):
                    lp = a["lp"] = a["lp"] or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
                    for key in lp:
                        lp[key] += c["logprobs"][key]
                out = self._one(chunk["id"], c, a["text"], list(a["ids"]), a["prompt"], 0, a["lp"], None)
                yield f"data: {json.dumps(out)}\n\n"
        yield "data: [DONE]\n\n"
