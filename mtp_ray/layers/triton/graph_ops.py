"""Triton kernels for the CUDA graphs' glue ops (graph_ops.py has the torch reference and the semantics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _feed_kernel(ids_ptr, pos_ptr, slots_ptr, spec_ptr, ctx_ptr, state_ptr, tables_ptr, src_ptr, last_ptr,
                 next_ids_ptr, drafts_ptr, width, block_size, stride_drafts, Q: tl.constexpr, K: tl.constexpr,
                 QP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.load(src_ptr + r)
    if s >= 0:  # padded rows and rows whose inputs the host wrote exactly keep them
        a = tl.load(last_ptr + s)  # accepted drafts of the row's verify in flight
        j = tl.arange(0, QP)
        m = j < Q
        ctx = tl.load(ctx_ptr + r) + a
        pos = ctx + j  # [QP]
        blk = tl.load(tables_ptr + r * width + pos // block_size, mask=m, other=0)
        slots = blk * block_size + pos % block_size
        first = tl.load(next_ids_ptr + s * Q + a)  # the target's token after the accepted drafts
        drafts = tl.load(drafts_ptr + s * stride_drafts + j - 1, mask=m & (j >= 1) & (j <= K), other=0)
        ids = tl.where(j == 0, first, drafts)
        spec = tl.load(spec_ptr + r * Q + j, mask=m, other=0)  # snapshot slots before the rotation
        state = tl.load(state_ptr + r)
        new_state = tl.sum(tl.where(j == a, spec, 0), 0)  # snapshot a becomes the state slot...
        new_spec = tl.where(j == a, state, spec)  # ...and the old state slot takes its place
        tl.store(ids_ptr + r * Q + j, ids, mask=m)
        tl.store(pos_ptr + r * Q + j, pos, mask=m)
        tl.store(slots_ptr + r * Q + j, slots, mask=m)
        tl.store(spec_ptr + r * Q + j, new_spec, mask=m)
        tl.store(ctx_ptr + r, ctx)
        tl.store(state_ptr + r, new_state)


def feed_in_flight(v: dict[str, torch.Tensor], src: torch.Tensor, last: torch.Tensor, next_ids: torch.Tensor,
                   drafts: torch.Tensor, q: int, k: int, block_size: int) -> None:
    b, width = v["tables"].shape
    for name in ("ids", "pos", "slots", "spec", "ctx", "state", "tables"):
        assert v[name].is_contiguous() and v[name].dtype == torch.long, name
    assert drafts.stride(1) == 1 and src.numel() == b
    _feed_kernel[(b,)](v["ids"], v["pos"], v["slots"], v["spec"], v["ctx"], v["state"], v["tables"], src, last,
                       next_ids, drafts, width, block_size, drafts.stride(0), Q=q, K=k,
                       QP=triton.next_power_of_2(q), num_warps=1)


@triton.jit
def _argmax_part_kernel(x_ptr, pmax_ptr, pidx_ptr, psum_ptr, n_cols, stride, n_parts, BLOCK: tl.constexpr,
                        SUM: tl.constexpr):
    """Program (row, part): max, first argmax and (SUM) sum exp(x - max) over one BLOCK of the row's logits. Rows
    of a large vocabulary are split over many programs: one program per row would read a 248k-vocabulary row
    (1 MB) block after block from one SM at batch 1."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    c = p * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride + c, mask=c < n_cols, other=float("-inf"))
    best = tl.max(x, 0)
    tl.store(pmax_ptr + r * n_parts + p, best.to(tl.float32))
    tl.store(pidx_ptr + r * n_parts + p, p * BLOCK + tl.argmax(x, 0, tie_break_left=True).to(tl.int64))
    if SUM:
        tl.store(psum_ptr + r * n_parts + p, tl.sum(tl.exp(x - best), 0))


@triton.jit
def _argmax_ids_kernel(pmax_ptr, pidx_ptr, out_ptr, n_parts, PP: tl.constexpr):
    """Program r: the row's parts -> its argmax (the first part holding the max: first max on ties)."""
    r = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, PP)
    pm = parts < n_parts
    pmax = tl.load(pmax_ptr + r * n_parts + parts, mask=pm, other=float("-inf"))
    first = tl.min(tl.where(pmax == tl.max(pmax, 0), parts, PP), 0)
    tl.store(out_ptr + r, tl.load(pidx_ptr + r * n_parts + first))


def _argmax_parts(logits: torch.Tensor, with_sum: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """The first launch of argmax_ids and greedy_block: per (row, block of up to 4096 logits) its max, first argmax
    and (with_sum) sum exp(x - max) -> (pmax, pidx [N, parts], psum or None, parts)."""
    n, vocab = logits.shape
    assert logits.stride(1) == 1
    block = min(triton.next_power_of_2(vocab), 4096)
    parts = triton.cdiv(vocab, block)
    pmax = torch.empty(n, parts, dtype=torch.float32, device=logits.device)
    pidx = torch.empty(n, parts, dtype=torch.long, device=logits.device)
    psum = torch.empty_like(pmax) if with_sum else None
    _argmax_part_kernel[(n, parts)](logits, pmax, pidx, psum if with_sum else pmax, vocab, logits.stride(0), parts,
                                    BLOCK=block, SUM=with_sum, num_warps=8 if block >= 2048 else 4)
    return pmax, pidx, psum, parts


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] int64 (engine/graph_ops.py: argmax_ids)."""
    pmax, pidx, _, parts = _argmax_parts(logits, with_sum=False)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    _argmax_ids_kernel[(logits.shape[0],)](pmax, pidx, out, parts, PP=triton.next_power_of_2(parts), num_warps=1)
    return out


@triton.jit
def _draft_rows_kernel(ctx_ptr, last_ptr, tables_ptr, rows_ptr, pos_ptr, slots_ptr, b, width, block_size,
                       Q: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    a = tl.load(last_ptr + r)
    tl.store(rows_ptr + r, r * Q + a)
    j = tl.arange(0, KP) + 1  # draft steps 1 .. K - 1 (step 0 runs on the verify rows)
    m = j < K
    pos = tl.load(ctx_ptr + r) + a + j
    blk = tl.load(tables_ptr + r * width + pos // block_size, mask=m, other=0)
    tl.store(pos_ptr + (j - 1) * b + r, pos, mask=m)
    tl.store(slots_ptr + (j - 1) * b + r, blk * block_size + pos % block_size, mask=m)


def draft_rows(ctx: torch.Tensor, last: torch.Tensor, tables: torch.Tensor, q: int, k: int, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, width = tables.shape
    assert ctx.is_contiguous() and tables.is_contiguous() and ctx.dtype == last.dtype == tables.dtype == torch.long
    rows = torch.empty(b, dtype=torch.long, device=ctx.device)
    pos, slots = (torch.empty(max(k - 1, 0), b, dtype=torch.long, device=ctx.device) for _ in range(2))
    _draft_rows_kernel[(b,)](ctx, last, tables, rows, pos, slots, b, width, block_size, Q=q, K=k,
                             KP=triton.next_power_of_2(max(k - 1, 1)), num_warps=1)
    return rows, pos, slots


@triton.jit
def _greedy_block_kernel(pmax_ptr, pidx_ptr, psum_ptr, n_parts, inp_ptr, block_ptr, last_ptr, next_ptr,
                         Q: tl.constexpr, K: tl.constexpr, QP: tl.constexpr, PP: tl.constexpr):
    """Program r (a sequence): its q rows' parts -> argmax (the first part holding the row's max: first max on
    ties) and log-prob -log(sum exp(x - max)); with k the accepted drafts; written as the greedy block row."""
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, QP)
    m = j < Q
    parts = tl.arange(0, PP)
    at = (r * Q + j)[:, None] * n_parts + parts[None, :]  # [QP, PP]
    pm2 = m[:, None] & (parts[None, :] < n_parts)
    pmax = tl.load(pmax_ptr + at, mask=pm2, other=float("-inf"))
    best = tl.where(m, tl.max(pmax, 1), 0.0)  # [QP] (padded rows 0: no inf - inf)
    first = tl.min(tl.where(pmax == best[:, None], parts[None, :], PP), 1)  # [QP] the first part at the max
    ids = tl.sum(tl.where(parts[None, :] == first[:, None], tl.load(pidx_ptr + at, mask=pm2, other=0), 0), 1)
    scale = tl.where(pm2, tl.exp(pmax - best[:, None]), 0.0)
    total = tl.where(m, tl.sum(tl.load(psum_ptr + at, mask=pm2, other=0.0) * scale, 1), 1.0)  # [QP]
    cols = 2 * Q + (K > 0)
    tl.store(block_ptr + r * cols + j, ids.to(tl.float64), mask=m)
    tl.store(block_ptr + r * cols + Q + j, (-tl.log(total)).to(tl.float64), mask=m)
    tl.store(next_ptr + r * Q + j, ids, mask=m)
    if K > 0:
        drafted = tl.load(inp_ptr + r * Q + j + 1, mask=j < K, other=0)  # draft j is input j + 1
        miss = (ids != drafted) & (j < K)
        a = tl.min(tl.where(miss, j, K), 0)  # drafts before the first miss are accepted
        tl.store(last_ptr + r, a.to(tl.int64))
        tl.store(block_ptr + r * cols + 2 * Q, a.to(tl.float64))


def greedy_block(logits: torch.Tensor, inp_ids: torch.Tensor, q: int, k: int, last: torch.Tensor,
                 next_ids: torch.Tensor) -> torch.Tensor:
    b = logits.shape[0] // q
    assert inp_ids.is_contiguous() and logits.dtype == torch.float32
    pmax, pidx, psum, parts = _argmax_parts(logits, with_sum=True)
    out = torch.empty(b, 2 * q + int(k > 0), dtype=torch.float64, device=logits.device)
    _greedy_block_kernel[(b,)](pmax, pidx, psum, parts, inp_ids, out, last, next_ids, Q=q, K=k,
                               QP=triton.next_power_of_2(q), PP=triton.next_power_of_2(parts), num_warps=1)
    return out
