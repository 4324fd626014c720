"""Triton paged attention for general (prefill / mixed) batches (GPU): variable query lengths per sequence.

Sequence b owns query rows [cu[b], cu[b+1]); its query j sits at absolute position ctx[b] + j and sees keys
0 .. ctx[b] + j, read from the paged cache through block_tables[b] (token p: block table[p // block_size], offset
p % block_size). The new tokens' K/V are in the cache already.

One program per (query tile, KV head). A tile is TOK_M consecutive query tokens of one sequence times the GROUP
query heads that share the KV head (GQA, as in the decode kernel): each K/V block loaded serves every head of the
group, and a decode-like sequence (1 token) still fills GROUP rows. The keys are walked in two phases: blocks
wholly before the tile's first query need no causal mask; the rest, up to the tile's last query, are masked.

Tiles are numbered without a host sync (as vLLM's unified attention does): sequence b gets the virtual tiles
[cu[b] // TOK_M + b, cu[b+1] // TOK_M + b + 1), at least cdiv(len_b, TOK_M) of them, so T // TOK_M + B programs
cover any batch of T tokens and B sequences; a program finds its sequence by binary search over cu, and one whose
tile starts past its sequence's end exits at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp_ray.layers.triton.attention import _attend, _store_out


@triton.jit
def _find_seq(cu_ptr, pid, num_seqs, TOK_M: tl.constexpr):
    """The sequence b with cu[b] // TOK_M + b <= pid < cu[b+1] // TOK_M + b + 1 (last such b)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = (tl.load(cu_ptr + mid).to(tl.int32) // TOK_M + mid).to(tl.int32)
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["stride_bt", "num_seqs", "width"])  # they change every step: no recompiles
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr, o_ptr, g_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh, stride_gt, stride_gh,
    scale, num_seqs, width,
    GROUP: tl.constexpr, TOK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, GATE: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = _find_seq(cu_ptr, pid, num_seqs, TOK_M)
    q_start = tl.load(cu_ptr + b).to(tl.int32)
    n = tl.load(cu_ptr + b + 1).to(tl.int32) - q_start  # this sequence's query tokens
    j0 = (pid - (q_start // TOK_M + b)) * TOK_M  # the tile's first query token (within the sequence)
    if j0 >= n:  # a spare virtual tile
        return
    rows = tl.arange(0, BLOCK_M)  # row = jj * GROUP + g: query token j0 + jj, head kvh * GROUP + g
    j = j0 + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < TOK_M * GROUP) & (j < n)
    tok = (q_start + j).to(tl.int64)  # flat token row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=mask, other=0.0)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    limit = ctx + j  # [BLOCK_M] last key position each row may see
    hi = ctx + tl.minimum(j0 + TOK_M, n)  # one past the tile's last query's last key
    full = (ctx + j0) // BLOCK_N * BLOCK_N  # keys before this are seen by every row of the tile
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt = bt_ptr + b.to(tl.int64) * stride_bt
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, k_ptr, v_ptr, bt, kvh, d, d_ok, limit, 0, full, width, stride_ks,
                            stride_kh, scale, BLOCK_SIZE, BLOCK_N, IEEE, False)
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, k_ptr, v_ptr, bt, kvh, d, d_ok, limit, full, hi, width, stride_ks,
                            stride_kh, scale, BLOCK_SIZE, BLOCK_N, IEEE, True)
    _store_out(o_ptr, g_ptr, acc / l_i[:, None], tok, head, mask, d, stride_ot, stride_oh, stride_gt, stride_gh,
               GATE)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int (device)
    cu_seqlens: torch.Tensor,  # [B + 1] int32 / int64 (device): sequence b owns query rows [cu[b], cu[b+1])
    context_lens: torch.Tensor,  # [B] int32 / int64 (device): tokens cached before this forward
    scale: float,
    gate: torch.Tensor | None = None,  # [T, Hq, D]: the output is multiplied by sigmoid(gate)
    zero_rows: bool = False,  # rows past cu_seqlens[-1] (a padded static batch) come out zero, not unwritten
) -> torch.Tensor:  # [T, Hq, D] in q's dtype
    """Causal paged attention of each sequence's new tokens over its whole context; no host sync."""
    _, _, block_size, hkv, d = kv_cache.shape
    t, hq = q.shape[0], q.shape[1]
    bsz, width = block_tables.shape
    group = hq // hkv
    assert q.stride(2) == 1 and block_tables.stride(1) == 1 and (gate is None or gate.stride(2) == 1)
    k, v = kv_cache[0].view(-1, hkv, d), kv_cache[1].view(-1, hkv, d)  # [num_blocks * block_size, Hkv, D]
    out = torch.zeros_like(q) if zero_rows else torch.empty_like(q)
    if t == 0:
        return out
    block_d = triton.next_power_of_2(d)
    block_m = max(64, triton.next_power_of_2(group))
    tok_m = block_m // group  # query tokens per tile
    block_n = 64 if block_d <= 128 else 32
    g = gate if gate is not None else q
    gs = (gate.stride(0), gate.stride(1)) if gate is not None else (0, 0)
    _paged_prefill_kernel[(t // tok_m + bsz, hkv)](
        q, k, v, block_tables, cu_seqlens, context_lens, out, g,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        *gs, scale, bsz, width,
        GROUP=group, TOK_M=tok_m, BLOCK_SIZE=block_size, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, IEEE=q.dtype == torch.float32, GATE=gate is not None,
        num_warps=8 if block_d > 128 else 4,
    )
    return out
