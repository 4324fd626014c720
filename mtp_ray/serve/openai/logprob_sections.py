"""The log-prob sections of a response (OpenAI's completion and chat forms, vLLM's prompt_logprobs) from one choice's
accumulated tokens, log-probs and alternatives."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtp_ray.serve.openai.request import ParsedRequest

if TYPE_CHECKING:
    from mtp_ray.serve.openai.choice import Choice


class Render:
    """Token strings and log-prob sections of one request's responses."""

    def __init__(self, tok, req: ParsedRequest):
        self.tok, self.req = tok, req

    def s(self, t: int) -> str:
        return f"token_id:{t}" if self.req.tokens_as_ids else self.tok.decode([t])

    def completion_logprobs(self, c: Choice, start: int, offset0: int, with_prompt: bool) -> tuple[dict, int]:
        """OpenAI legacy logprobs, and the text_offset after them; with the prompt (echo): its tokens first, the
        first one without a log-prob. The top_logprobs map holds the chosen token as well (vLLM: logprobs 0 still
        names it). Offsets run over the tokens' strings from offset0, not over the text sent so far: a stop
        string's look-ahead holds text back while its tokens' log-probs go out."""
        top_n = self.top_n()
        ids, lps, tops = c.token_ids[start : len(c.logprobs)], c.logprobs[start:], c.top[start:]
        entries: list[tuple[int, float | None, list | None]] = []
        if with_prompt and c.prompt_logprobs is not None:
            entries = [(t, None, None) if e is None else (t, e[0], list(e[1].items()))
                       for t, e in zip(c.prompt, c.prompt_logprobs, strict=True)]
        entries += list(zip(ids, lps, tops, strict=True))
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        off = offset0
        for t, lp, top in entries:
            s = self.s(t)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if top is None else {  # the chosen token first, as vLLM
                s: lp, **{self.s(a): b for a, b in top[:top_n] if self.s(a) != s}})
            out["text_offset"].append(off)
            off += len(s)
        return out, off

    def top_n(self) -> int | None:
        """Alternatives per position: top_logprobs (None: all that came, for -1), or every token of
        logprob_token_ids (they replace them)."""
        named = self.req.params.logprob_token_ids
        n = len(named) if named else self.req.top_logprobs or 0
        return None if n < 0 else n

    def chat_logprobs(self, c: Choice, start: int) -> dict:
        top_n = self.top_n()

        def entry(t: int, lp: float) -> dict:
            s = self.s(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top[:top_n]]}
                            for t, lp, top in zip(c.token_ids[start:], c.logprobs[start:], c.top[start:])]}

    def prompt_logprobs(self, c: Choice) -> list | None:
        """vLLM's prompt_logprobs: per position None (the first) or {token id: {logprob, rank, decoded_token}}."""
        if self.req.prompt_logprobs is None or c.prompt_logprobs is None:
            return None
        out: list = []
        for t, e in zip(c.prompt, c.prompt_logprobs, strict=True):
            if e is None:
                out.append(None)
                continue
            lp, top, rank = e
            n = self.req.prompt_logprobs
            d = {str(a): {"logprob": b, "rank": i + 1, "decoded_token": self.s(a)}
                 for i, (a, b) in enumerate(list(top.items())[: None if n < 0 else n])}  # (-1: all)
            d[str(t)] = {"logprob": lp, "rank": rank, "decoded_token": self.s(t)}
            out.append(d)
        return out
