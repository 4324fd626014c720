"""Triton paged attention for uniform decode / verify batches (GPU): one program per (sequence, KV head).

The program holds the group * q_len query rows that share one KV head (GQA), walks the sequence's keys
[0, context + q_len) through its block table with an online softmax, and masks causally inside the new tokens:
query j (absolute position context + j) sees keys 0 .. context + j. Only the keys a sequence owns are read, and
the loop bound is read on the device, so the kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, o_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    scale,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)  # row = j * GROUP + g: query token j, head kvh * GROUP + g
    j = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = rows < Q_LEN * GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (b * Q_LEN + j)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    ctx = tl.load(ctx_ptr + b)
    total = ctx + Q_LEN
    limit = ctx + j  # last key position each row may see
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, total, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < total
        blk = tl.load(bt_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        s = tl.where((pos[None, :] <= limit[:, None]) & pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + (b * Q_LEN + j)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_decode_attention(
    q: torch.Tensor,  # [B * q_len, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W]
    context_lens: torch.Tensor,  # [B]
    q_len: int,
    scale: float,
) -> torch.Tensor:  # [B * q_len, Hq, D]
    _, _, block_size, hkv, d = kv_cache.shape
    bsz = block_tables.shape[0]
    group = q.shape[1] // hkv
    k, v = kv_cache[0].view(-1, hkv, d), kv_cache[1].view(-1, hkv, d)
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(d)
    block_m = max(16, triton.next_power_of_2(group * q_len))
    block_n = 64 if block_d <= 128 else 32
    _paged_decode_kernel[(bsz, hkv)](
        q, k, v, block_tables, context_lens, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        scale,
        Q_LEN=q_len, GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, IEEE=q.dtype == torch.float32, num_warps=4,
    )
    return out
