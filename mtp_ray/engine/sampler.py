"""Logit processing and sampling, one row per (request, position).

A row's target distribution, in vLLM's order: the logit bias, repetition penalty over its history, presence /
frequency penalties over its output tokens, bad words (over its output tokens), min_tokens masking of stop tokens,
temperature, top-k, top-p, min-p.
Greedy rows take the argmax of the processed logits. Logprobs are reported from the raw model distribution
(log_softmax of the logits), as vLLM does by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_ray.engine.sampling_params import SamplingParams


@dataclass
class Row:
    params: SamplingParams
    history: list[int]  # prompt + output (+ drafts before this position) where params.penalized, else []
    num_output: int  # output tokens before this position (min_tokens)
    stop_ids: tuple[int, ...]  # eos + stop_token_ids: masked until min_tokens
    allowed: torch.Tensor | None = None  # bool [V]: the only tokens it may sample (grammar, allowed_token_ids)


def process(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """logits: [V] fp32 -> processed logits (temperature not applied)."""
    p = row.params
    mask_stops = row.num_output < p.min_tokens and bool(row.stop_ids)
    if not (p.reshapes_logits or mask_stops or row.allowed is not None):
        return logits
    logits = logits.clone()  # one copy for every change below: the step's row stays as the model computed it
    # vLLM's order: the bias, then the penalties (a repetition penalty scales by the sign of the biased logit)
    if p.logit_bias:
        logits[list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    if p.repetition_penalty != 1.0 and row.history:
        idx = torch.tensor(sorted(set(row.history)), dtype=torch.long)
        vals = logits[idx]
        logits[idx] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    output = row.history[len(row.history) - row.num_output:]  # this row's output tokens (penalized rows)
    if (p.presence_penalty or p.frequency_penalty) and output:
        ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    if p.bad_words_token_ids:
        banned = banned_tokens(p.bad_words_token_ids, output)
        if banned:
            logits[banned] = float("-inf")
    allowed = row.allowed
    if mask_stops:
        if allowed is None:
            logits[list(row.stop_ids)] = float("-inf")
        elif bool(allowed.sum() > allowed[list(row.stop_ids)].sum()):  # a grammar that must end now ends
            allowed = allowed.clone()
            allowed[list(row.stop_ids)] = False
    if allowed is not None:
        logits.masked_fill_(~allowed, float("-inf"))
    return logits


def banned_tokens(seqs: list[list[int]], output: list[int]) -> list[int]:
    """vLLM's bad words: the last token of each sequence whose other tokens end the output so far (a one-token
    sequence: always). Over the output only, as vLLM v1 (a word the prompt started is not finished for it)."""
    return [q[-1] for q in seqs if len(q) <= len(output) + 1 and output[len(output) - len(q) + 1:] == q[:-1]]


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, safe to softmax: +inf (a huge bias or penalty) becomes the largest finite value (the
    distribution's limit: the argmax), nan is never drawn, a masked token (-inf) stays masked, and the logits are
    shifted by their max first, so a tiny temperature cannot overflow (softmax does not see the shift). A row with
    no finite logit stays all -inf (`probs` and `draft_probs` say so)."""
    x = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))
    top = x.max()
    return x if bool(torch.isneginf(top)) else (x - top) / temperature


class NoTokenLeft(ArithmeticError):
    """Every token of a row is ruled out: by non-finite logits (`model`: non-finite weights, an overflow) or by the
    request's own constraints (allowed_token_ids with bad_words, min_tokens or a logit bias). The request ends with
    that error (OutputProcessor.fail); the step and the group go on."""

    def __init__(self, model: bool):
        super().__init__("non-finite logits" if model else "constraints rule out every token")
        self.model = model


def check_left(logits: torch.Tensor, x: torch.Tensor) -> None:
    """NoTokenLeft unless some token of the processed row x survives (logits: the row as the model computed it)."""
    if not bool((x > float("-inf")).any()):  # (NaN compares false: a NaN-only row has none left either)
        raise NoTokenLeft(model=not bool(torch.isfinite(logits).any()))


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed logits [V] (check_left passed) -> the distribution to sample from (temperature > 0)."""
    x = tempered(logits, params.temperature)
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    pr = torch.softmax(x, dim=-1)
    if params.min_p > 0:
        pr = pr.masked_fill(pr < params.min_p * pr.max(), 0.0)
    if params.top_p < 1.0:
        sp, si = torch.sort(pr, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (sp.cumsum(0) - sp) >= params.top_p * sp.sum()
        pr = pr.scatter(0, si[drop], 0.0)
    return pr / pr.sum()


def draft_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A sampled draft's distribution [V]: the MTP head's tempered softmax, or all mass on token 0 when none of
    its logits is finite (a draft only proposes: verification is exact for any distribution it was drawn from)."""
    x = tempered(logits, temperature)
    if bool(torch.isneginf(x).all()):
        return torch.nn.functional.one_hot(torch.tensor(0, device=x.device), x.numel()).to(x.dtype)
    return torch.softmax(x, dim=-1)


def draw(pr: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(pr, 1, generator=gen).item())


def sample_row(logits: torch.Tensor, row: Row, gen: torch.Generator | None) -> int:
    x = process(logits, row)
    check_left(logits, x)  # (multinomial would raise, or assert on a device; an argmax would pick a banned token)
    if row.params.greedy:
        return int(x.argmax().item())
    return draw(probs(x, row.params), gen)


def argmax_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] fp32 -> argmax ids [N] (first max on ties) and their raw log-probs [N], computed where the
    logits are: the graph steps and the eager steps reduce the same way."""
    top, ids = logits.max(-1)
    return ids, top - logits.logsumexp(-1)


@dataclass
class StepLogits:
    """A step's logit rows, reduced on their device: every row's argmax and its log-prob; the full logits and
    log-probs on the host only for the rows whose sampling needs them (in row order). Moving all of them costs:
    128 prefill rows of a 248k vocabulary are 127 MB, 88 ms of device -> host copy on an H200 host."""

    ids: list[int]
    lp: list[float]
    logits: torch.Tensor | None  # [N_host, V] fp32 on the CPU
    logprobs: torch.Tensor | None  # [N_host, V] log_softmax of `logits`


def reduce_rows(logits: torch.Tensor, host: list[bool], masks: tuple[list[int], torch.Tensor] | None = None
                ) -> StepLogits:
    """logits: [N, V] fp32 on any device; host: per row, whether its full row is needed on the CPU; masks: rows
    whose argmax is taken over their allowed tokens only (bool [M, V] on the logits' device), their log-prob still
    the raw model's."""
    assert len(host) == logits.shape[0]
    ids, lp = argmax_logprob(logits)
    if masks is not None:
        idx = torch.tensor(masks[0], device=logits.device)
        sub = logits[idx]  # [M, V]
        mids = sub.masked_fill(~masks[1], float("-inf")).argmax(-1)
        ids[idx] = mids
        lp[idx] = sub.gather(1, mids[:, None]).squeeze(1) - sub.logsumexp(-1)
    both = torch.stack([ids.double(), lp.double()]).cpu()  # [2, N]: one small copy (ids < 2^53 are exact)
    sel = [i for i, h in enumerate(host) if h]
    full = (logits if len(sel) == len(host) else logits[sel]).cpu() if sel else None
    return StepLogits(both[0].long().tolist(), both[1].tolist(), full,
                      torch.log_softmax(full, dim=-1) if full is not None else None)


def top_count(n: int, vocab: int) -> int:
    """How many alternatives a request's logprobs = n asks for: -1 (vLLM's) and more than the vocabulary, all."""
    return vocab if n < 0 else min(n, vocab)


def logprob_info(lp: torch.Tensor, token: int, top_n: int | None, ids: list[int] | None = None
                 ) -> tuple[float, dict[int, float], int | None]:
    """lp: [V] raw log-probabilities (log_softmax of the logits, computed for the whole step at once) ->
    logprob of `token`, the top_n alternatives {token: logprob} (or with `ids` those tokens', in their order), and
    the token's rank in the vocabulary (1: the likeliest; vLLM's Logprob.rank) when log-probs are asked."""
    top: dict[int, float] = {}
    if ids:
        top = dict(zip(ids, lp[ids].tolist(), strict=True))
    elif top_n:
        v, i = torch.topk(lp, top_count(top_n, lp.numel()))
        top = {int(t): float(x) for t, x in zip(i.tolist(), v.tolist(), strict=False)}
    x = lp[token]
    rank = int((lp > x).sum()) + 1 if top_n is not None or ids else None
    return float(x), top, rank
