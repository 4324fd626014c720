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
def _argmax_lp_kernel(x_ptr, ids_ptr, lp_ptr, n_cols, stride, BLOCK: tl.constexpr):
    """One row: argmax (first max on ties) and its log-prob -log(sum exp(x - max)), in one pass over the row."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    idx = tl.zeros((), tl.int64)
    total = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + r * stride + start + c, mask=start + c < n_cols, other=float("-inf"))
        bm = tl.max(x, 0)
        bi = tl.argmax(x, 0, tie_break_left=True)
        new = tl.maximum(best, bm)
        total = total * tl.exp(best - new) + tl.sum(tl.exp(x - new), 0)
        idx = tl.where(bm > best, start + bi.to(tl.int64), idx)  # strictly greater: an earlier block keeps a tie
        best = new
    tl.store(ids_ptr + r, idx)
    tl.store(lp_ptr + r, -tl.log(total))


@triton.jit
def _greedy_block_kernel(ids_ptr, lp_ptr, inp_ptr, block_ptr, last_ptr, next_ptr, Q: tl.constexpr,
                         K: tl.constexpr, QP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, QP)
    m = j < Q
    cols = 2 * Q + (K > 0)
    ids = tl.load(ids_ptr + r * Q + j, mask=m, other=0)
    tl.store(block_ptr + r * cols + j, ids.to(tl.float64), mask=m)
    tl.store(block_ptr + r * cols + Q + j, tl.load(lp_ptr + r * Q + j, mask=m, other=0.0).to(tl.float64), mask=m)
    tl.store(next_ptr + r * Q + j, ids, mask=m)
    if K > 0:
        drafted = tl.load(inp_ptr + r * Q + j + 1, mask=j < K, other=0)  # draft j is input j + 1
        miss = (ids != drafted) & (j < K)
        a = tl.min(tl.where(miss, j, K), 0)  # drafts before the first miss are accepted
        tl.store(last_ptr + r, a.to(tl.int64))
        tl.store(block_ptr + r * cols + 2 * Q, a.to(tl.float64))


def greedy_block(logits: torch.Tensor, inp_ids: torch.Tensor, q: int, k: int, last: torch.Tensor,
                 next_ids: torch.Tensor) -> torch.Tensor:
    n, vocab = logits.shape
    b = n // q
    assert logits.stride(1) == 1 and inp_ids.is_contiguous() and logits.dtype == torch.float32
    ids = torch.empty(n, dtype=torch.long, device=logits.device)
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    block = min(triton.next_power_of_2(vocab), 4096)
    _argmax_lp_kernel[(n,)](logits, ids, lp, vocab, logits.stride(0), BLOCK=block, num_warps=8 if block >= 2048 else 4)
    out = torch.empty(b, 2 * q + int(k > 0), dtype=torch.float64, device=logits.device)
    _greedy_block_kernel[(b,)](ids, lp, inp_ids, out, last, next_ids, Q=q, K=k, QP=triton.next_power_of_2(q),
                               num_warps=1)
    return out
