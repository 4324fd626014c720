"""The glue ops inside the CUDA graphs (CudaGraphs): at batch 1 a graph step is launch-bound on the device (~1.5 us
per kernel node), so each op here is one or two Triton kernels on a GPU (layers/triton/graph_ops.py) in place of
10-35 small torch kernels; the torch version runs elsewhere (the CPU-emulated graph tests) and is the reference the
GPU kernels are tested against (tests/test_kernels.py).

feed_in_flight (async verify, k > 0): the target graph's first act moves each row that follows a verify still in
flight by that verify's accepted count. The host wrote such a row's inputs as if that verify had accepted nothing
(start one past the previous start, GDN slots before their rotation); here they move by the accepted count a, in the
static inputs (the draft loop reads them too): tokens = the argmax of row a and the drafts the draft loop left,
positions and context + a, KV slots from the block table at those positions, and the GDN slots rotated as
OutputProcessor.commit_spec rotates them on the host one step later (state = snapshot a, whose slot takes the old
state slot).

greedy_block: the target graph's last act: per row the argmax and its log-prob, and with k the accepted drafts,
packed into the float64 block a greedy step copies to the host, and left where the draft loop and the next replay
read them (next_ids, last).

draft_rows, argmax_ids: the draft loop's glue (one launch for every step's rows, positions and KV slots; the
drafts' argmax in two launches where torch's reduction over a 248k vocabulary took ~9 us a step).
"""

from __future__ import annotations

import torch

from mtp_ray.engine.sampler import argmax_logprob


def feed_in_flight(v: dict[str, torch.Tensor], src: torch.Tensor, last: torch.Tensor, next_ids: torch.Tensor,
                   drafts: torch.Tensor, q: int, k: int, block_size: int) -> None:
    """v: the static input views of size b (ids, pos, slots [b*q]; spec [b, q]; ctx, state [b]; tables [b, W]),
    moved in place. src [b]: per row its row of the previous replay while that step is in flight (-1: exact);
    last [>= b]: that replay's accepted count per row; next_ids [>= b*q]: its argmax per verify row; drafts [>= b, k]:
    the drafts its draft loop left."""
    if src.is_cuda:
        from mtp_ray.layers.triton.graph_ops import feed_in_flight as fused

        return fused(v, src, last, next_ids, drafts, q, k, block_size)
    return feed_in_flight_torch(v, src, last, next_ids, drafts, q, k, block_size)


def feed_in_flight_torch(v: dict[str, torch.Tensor], src: torch.Tensor, last: torch.Tensor, next_ids: torch.Tensor,
                         drafts: torch.Tensor, q: int, k: int, block_size: int) -> None:
    b = src.numel()
    live = src >= 0  # [b]
    s = src.clamp(min=0)
    a = torch.where(live, last[s], 0)  # [b] accepted drafts of the row's verify in flight
    ctx = v["ctx"] + a  # [b]
    pos = ctx[:, None] + torch.arange(q, device=src.device)  # [b, q]
    slots = v["tables"].gather(1, pos // block_size) * block_size + pos % block_size  # [b, q]
    ids = torch.cat([next_ids[s * q + a][:, None], drafts[s, :k]], 1)  # [b, q]
    spec, state = v["spec"], v["state"]  # [b, q], [b]: the host's slots, before the rotation
    new_state = spec.gather(1, a[:, None])[:, 0]
    new_spec = torch.where(torch.arange(q, device=src.device)[None, :] == a[:, None], state[:, None], spec)
    m = live[:, None]
    for name, new in (("ids", ids), ("pos", pos), ("slots", slots), ("spec", new_spec)):
        old = v[name].view(b, q)
        old.copy_(torch.where(m, new, old))
    v["ctx"].copy_(torch.where(live, ctx, v["ctx"]))
    v["state"].copy_(torch.where(live, new_state, state))


def greedy_block(logits: torch.Tensor, inp_ids: torch.Tensor, q: int, k: int, last: torch.Tensor,
                 next_ids: torch.Tensor) -> torch.Tensor:
    """logits [b*q, V] fp32; inp_ids [b*q] the rows' input tokens -> block [b, 2q (+ 1 with k)] float64: per row its
    argmax (first max on ties) and log-prob, and with k the accepted drafts (a sequence accepts while draft j, its
    input j + 1, equals the argmax of row j). Writes next_ids[:b*q] (the argmaxes) and with k last[:b] (accepted)."""
    if logits.is_cuda:
        from mtp_ray.layers.triton.graph_ops import greedy_block as fused

        return fused(logits, inp_ids, q, k, last, next_ids)
    return greedy_block_torch(logits, inp_ids, q, k, last, next_ids)


def greedy_block_torch(logits: torch.Tensor, inp_ids: torch.Tensor, q: int, k: int, last: torch.Tensor,
                       next_ids: torch.Tensor) -> torch.Tensor:
    n = logits.shape[0]
    b = n // q
    ids, lp = argmax_logprob(logits)  # [n] each
    parts = [ids.view(b, q).double(), lp.view(b, q).double()]
    if k:
        match = ids.view(b, q)[:, :k] == inp_ids.view(b, q)[:, 1:]
        last[:b].copy_(match.long().cumprod(1).sum(1))
        parts.append(last[:b, None].double())
    next_ids[:n].copy_(ids)
    return torch.cat(parts, 1)


def draft_rows(ctx: torch.Tensor, last: torch.Tensor, tables: torch.Tensor, q: int, k: int, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft loop's indices for b sequences: ctx [b] context before the verify rows, last [>= b] accepted
    drafts, tables [b, W] -> rows [b]: each sequence's last committed row of the b * q verify rows (i * q + last);
    pos, slots [k - 1, b]: draft step j + 1's position (ctx + last + j + 1) and KV slot, a contiguous row per step."""
    if ctx.is_cuda:
        from mtp_ray.layers.triton.graph_ops import draft_rows as fused

        return fused(ctx, last, tables, q, k, block_size)
    return draft_rows_torch(ctx, last, tables, q, k, block_size)


def draft_rows_torch(ctx: torch.Tensor, last: torch.Tensor, tables: torch.Tensor, q: int, k: int, block_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = ctx.numel()
    a = last[:b]
    rows = torch.arange(b, device=ctx.device) * q + a
    pos = (ctx + a)[None, :] + torch.arange(1, k, device=ctx.device)[:, None]  # [k - 1, b]
    slots = tables.gather(1, (pos // block_size).T).T * block_size + pos % block_size
    return rows, pos, slots.contiguous()


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (any float dtype) -> [N] int64: the first max on ties, as torch.argmax."""
    if logits.is_cuda:
        from mtp_ray.layers.triton.graph_ops import argmax_ids as fused

        return fused(logits)
    return logits.argmax(-1)
