"""Verification of k drafted tokens against the target's k + 1 distributions.

Greedy rows accept while the draft equals the target's argmax, then append the target's own token. Random rows
accept draft d with probability min(1, p(d) / q(d)) and on rejection resample from normalize(max(p - q, 0)):
the emitted tokens are distributed exactly as the target's (Leviathan et al. / Chen et al.).
"""

from __future__ import annotations

import torch

from mtp_ray.engine.sampler import Row, check_left, draw, probs, process


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, d: int, gen: torch.Generator | None) -> tuple[bool, int]:
    """p, q: [V] target / draft distributions; d ~ q. Returns (accepted, token)."""
    u = torch.rand((), generator=gen).item()
    if u * float(q[d]) <= float(p[d]) and float(q[d]) > 0 and float(p[d]) > 0:  # p(d) = 0: masked, never taken
        return True, d
    residual = (p - q).clamp_min(0.0)
    total = float(residual.sum())
    return False, draw(residual / total if total > 0 else p, gen)


def verify(
    logits: torch.Tensor,  # [k+1, V] target logits at [last token, d1..dk]
    drafts: list[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, V] distributions the drafts were drawn from (random rows)
    rows: list[Row],  # k + 1 rows: row i's history includes drafts[:i]
    gen: torch.Generator | None,
) -> list[int]:
    """Returns the emitted tokens: the accepted drafts followed by one target token (1..k+1 tokens)."""
    k = len(drafts)
    assert logits.shape[0] == k + 1 == len(rows)
    greedy = rows[0].params.greedy
    for i, d in enumerate(drafts):
        x = process(logits[i], rows[i])
        check_left(logits[i], x)
        if greedy:
            t = int(x.argmax().item())
            if t != d:
                return drafts[:i] + [t]
            continue
        assert draft_probs is not None
        ok, t = accept_or_resample(probs(x, rows[i].params), draft_probs[i], d, gen)
        if not ok:
            return drafts[:i] + [t]
    x = process(logits[k], rows[k])
    check_left(logits[k], x)
    bonus = int(x.argmax().item()) if greedy else draw(probs(x, rows[k].params), gen)
    return drafts + [bonus]
