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

from mtp_ray.layers.triton import pdl


@triton.jit
def _store_out(o_ptr, g_ptr, out, tok, head, mask, d, stride_ot, stride_oh, stride_gt, stride_gh, GATE: tl.constexpr):
    """out [rows, D] fp32 -> o[tok, head] in o's dtype; GATE: times the layer's sigmoid output gate, rounded as
    `o * torch.sigmoid(gate)`. tok / head: [rows] flat token row and query head of each row."""
    dt = o_ptr.dtype.element_ty
    out = out.to(dt)
    if GATE:
        g = tl.load(g_ptr + tok[:, None] * stride_gt + head[:, None] * stride_gh + d[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        out = (out.to(tl.float32) * tl.sigmoid(g).to(dt).to(tl.float32)).to(dt)
    tl.store(o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], out, mask=mask)


@triton.jit
def _attend(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr, kvh, d, d_ok, limit, lo, hi, width, stride_ks, stride_kh,
            scale, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, CAUSAL: tl.constexpr):
    """Online softmax of a tile's rows (q [rows, D]) over keys [lo, hi) of one sequence (bt_ptr: its block table,
    `width` entries); CAUSAL: key p of row r is masked unless p <= limit[r] (and p < hi). Without CAUSAL every key
    of [lo, hi) is seen: hi - lo must then be a multiple of BLOCK_N. Shared by the decode and prefill kernels."""
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        pos_ok = pos < hi
        idx = pos // BLOCK_SIZE
        # idx < width only matters for a dummy forward (table [1, 1], any number of tokens): it reads block 0
        blk = tl.load(bt_ptr + idx, mask=pos_ok & (idx < width), other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE:  # fp32 inputs: match the fp32 torch reference (no TF32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [rows, BLOCK_N] fp32
        if CAUSAL:
            s = tl.where((pos[None, :] <= limit[:, None]) & pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see no key of a split's block
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # eager batches: the widest table changes every step
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, o_ptr, g_ptr, part_ptr, ml_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh, stride_gt, stride_gh,
    scale,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, GATE: tl.constexpr,
    SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
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
    # this program's share of the keys (flash-decoding split; one split: all of them)
    chunk = tl.cdiv(tl.cdiv(total, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, total)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + b * stride_bt, kvh, d, d_ok, limit, lo, hi,
                            stride_bt, stride_ks, stride_kh, scale, BLOCK_SIZE, BLOCK_N, IEEE, True)
    if SPLITS == 1:
        _store_out(o_ptr, g_ptr, acc / l_i[:, None], b * Q_LEN + j, head, row_ok[:, None] & d_ok[None, :], d,
                   stride_ot, stride_oh, stride_gt, stride_gh, GATE)
    else:  # partial results, merged by _combine_kernel
        base = (b * tl.num_programs(1) + kvh) * SPLITS + split
        tl.store(ml_ptr + (2 * base) * BLOCK_M + rows, m_i)
        tl.store(ml_ptr + (2 * base + 1) * BLOCK_M + rows, l_i)
        tl.store(part_ptr + base * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + d[None, :], acc)


@triton.jit
def _combine_kernel(part_ptr, ml_ptr, o_ptr, g_ptr, stride_ot, stride_oh, stride_gt, stride_gh,
                    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, GATE: tl.constexpr, SPLITS: tl.constexpr, CHUNK_D: tl.constexpr,
                    PDL: tl.constexpr):
    """One program per (sequence, KV head, CHUNK_D columns of the head dim): the splits' partial outputs merged
    with their (max, sum) statistics, all loads independent (no serial dependency across programs)."""
    pdl.enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    j = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = rows < Q_LEN * GROUP
    d = tl.program_id(2) * CHUNK_D + tl.arange(0, CHUNK_D)
    d_ok = d < HEAD_DIM
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, CHUNK_D], tl.float32)
    for s in tl.static_range(SPLITS):
        base = (b * tl.num_programs(1) + kvh) * SPLITS + s
        m_s = tl.load(ml_ptr + (2 * base) * BLOCK_M + rows)
        l_s = tl.load(ml_ptr + (2 * base + 1) * BLOCK_M + rows)
        a_s = tl.load(part_ptr + base * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + d[None, :])
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp(m - m_safe), tl.exp(m_s - m_safe)
        l_sum = l_sum * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m = m_new
    _store_out(o_ptr, g_ptr, acc / l_sum[:, None], b * Q_LEN + j, head, row_ok[:, None] & d_ok[None, :], d,
               stride_ot, stride_oh, stride_gt, stride_gh, GATE)


def paged_decode_attention(
    q: torch.Tensor,  # [B * q_len, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W]
    context_lens: torch.Tensor,  # [B]
    q_len: int,
    scale: float,
    gate: torch.Tensor | None = None,  # [B * q_len, Hq, D]: output * sigmoid(gate)
    splits: int | None = None,  # key splits per (sequence, KV head); None: enough programs to fill the GPU
) -> torch.Tensor:  # [B * q_len, Hq, D]
    _, _, block_size, hkv, d = kv_cache.shape
    bsz = block_tables.shape[0]
    group = q.shape[1] // hkv
    k, v = kv_cache[0].view(-1, hkv, d), kv_cache[1].view(-1, hkv, d)
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(d)
    block_m = max(16, triton.next_power_of_2(group * q_len))
    block_n = 64 if block_d <= 128 else 32
    if splits is None:  # a static function of the batch shape, so a CUDA graph keeps its choice; a power of two
        fill = max(1, 128 // (bsz * hkv))  # (SPLITS is compiled in: five variants, all met by the graph warmup)
        splits = min(16, 1 << (fill.bit_length() - 1))
    part = ml = out  # unused when splits == 1
    if splits > 1:
        part = torch.empty(bsz * hkv * splits * block_m * block_d, dtype=torch.float32, device=q.device)
        ml = torch.empty(bsz * hkv * splits * 2 * block_m, dtype=torch.float32, device=q.device)
    g = gate if gate is not None else q
    gs = (gate.stride(0), gate.stride(1)) if gate is not None else (0, 0)
    _paged_decode_kernel[(bsz, hkv, splits)](
        q, k, v, block_tables, context_lens, out, g, part, ml,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        *gs, scale,
        Q_LEN=q_len, GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, IEEE=q.dtype == torch.float32, GATE=gate is not None, SPLITS=splits, num_warps=4,
        **pdl.launch_args(q.device),
    )
    if splits > 1:
        chunk_d = min(block_d, 32)  # more programs: the merge is latency-bound at small batch
        _combine_kernel[(bsz, hkv, block_d // chunk_d)](
            part, ml, out, g, out.stride(0), out.stride(1), *gs,
            Q_LEN=q_len, GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=block_d, GATE=gate is not None,
            SPLITS=splits, CHUNK_D=chunk_d, num_warps=2, **pdl.launch_args(q.device),
        )
    return out


@triton.jit
def _qk_norm_rope_kernel(qg_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, qo_ptr, kc_ptr,
                         vc_ptr, stride_qt, stride_qh, stride_kt, stride_cs, stride_ot, stride_oh, stride_cache, eps,
                         HQ: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BD: tl.constexpr, TABLE: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    if TABLE:  # cos / sin rows of a per-position table
        cs_row = tl.load(pos_ptr + t).to(tl.int64)
    else:  # cos / sin rows per token
        cs_row = t
    hh = tl.program_id(1)
    d = tl.arange(0, BD)
    dm = d < D
    half: tl.constexpr = RD // 2
    rot = d < RD
    partner = tl.where(d < half, d + half, d - half)
    if hh < HQ:
        src = qg_ptr + t * stride_qt + hh * stride_qh
        w_ptr = qw_ptr
    else:
        src = k_ptr + t * stride_kt + (hh - HQ) * D
        w_ptr = kw_ptr
    dt = qo_ptr.dtype.element_ty
    x = tl.load(src + d, mask=dm, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    xn = (x * rstd * (1.0 + tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32))).to(dt).to(tl.float32)
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    xpn = (xp * rstd * (1.0 + tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32))).to(dt).to(tl.float32)
    c = tl.load(cos_ptr + cs_row * stride_cs + d, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs_row * stride_cs + d, mask=rot, other=0.0).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    # as RotaryEmbedding.apply: x * cos + rotate_half(x) * sin, every product and the sum rounded
    y = ((xn * c).to(dt).to(tl.float32) + (sign * xpn * s).to(dt).to(tl.float32)).to(dt)
    y = tl.where(rot, y, xn.to(dt))
    if hh < HQ:
        tl.store(qo_ptr + t * stride_ot + hh * stride_oh + d, y, mask=dm)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            off = slot * stride_cache + (hh - HQ) * D + d
            tl.store(kc_ptr + off, y.to(kc_ptr.dtype.element_ty), mask=dm)
            v = tl.load(v_ptr + t * stride_kt + (hh - HQ) * D + d, mask=dm, other=0.0)
            tl.store(vc_ptr + off, v.to(vc_ptr.dtype.element_ty), mask=dm)


def qk_norm_rope_store(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       slot_mapping: torch.Tensor, kv_cache: torch.Tensor, positions: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """One launch for the attention prologue. qg: [T, Hq, 2D] (q | gate per head); k, v: [T, Hkv * D];
    cos, sin: [T, rotary_dim] in the model dtype, or with `positions` [T] a per-position table [P, rotary_dim].
    Returns q [T, Hq, D] zero-centred RMS-normed and rotated; k (normed, rotated) and v go into
    kv_cache [2, blocks, block_size, Hkv, D] at slot_mapping (-1: not written)."""
    t, hq, d = qg.shape[0], qg.shape[1], qg.shape[2] // 2
    hkv = kv_cache.shape[3]
    assert qg.stride(2) == 1 and k.stride(1) == 1 and v.stride(0) == k.stride(0) and cos.stride(0) == sin.stride(0)
    flat = kv_cache.view(2, -1, hkv, d)
    q = torch.empty(t, hq, d, dtype=qg.dtype, device=qg.device)
    _qk_norm_rope_kernel[(t, hq + hkv)](
        qg, k, v, q_weight, k_weight, cos, sin, positions if positions is not None else slot_mapping, slot_mapping,
        q, flat[0], flat[1], qg.stride(0), qg.stride(1), k.stride(0), cos.stride(0), q.stride(0), q.stride(1),
        flat.stride(1), eps, HQ=hq, D=d, RD=cos.shape[1], BD=triton.next_power_of_2(d), TABLE=positions is not None,
        num_warps=1, **pdl.launch_args(qg.device),
    )
    return q
