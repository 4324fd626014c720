"""Small-batch MoE in Triton (GPU), each expert's weights read once for all the tokens routed to it: a verify of
k + 1 tokens per sequence sends several of them to the same experts, and every token to the shared expert, where
`moe_small.pair_experts` reads an expert's weights once per (token, slot) pair.

The routed (token, slot) pairs are sorted by expert id (torch.sort, graph-safe); the first pair of each expert in
that order leads a group: its programs load each weight tile once and compute every member pair's dot products
with it, in the same order and roundings as `pair_experts` (results are bitwise equal; tests/test_kernels.py). The
shared expert is one group of all tokens. Outputs go to the same per-pair rows (`act`, fp32 down partials), and
`moe_small`'s slot-sum launch adds them per token in slot order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp_ray.layers.triton.moe_small import SharedWeights, _gate_up_rows, slot_sum


@triton.jit
def _group(sorted_ptr, order_ptr, i, start, E_LOCAL, T, TOPK: tl.constexpr, SH: tl.constexpr, G: tl.constexpr):
    """Program row i -> (lead, valid, local expert, member mask [G], member pair rows [G], tokens [G], slots [G]).
    Rows < T * TOPK: position i of the expert-sorted routed pairs; it leads the group of its expert's pairs (at most
    one a token) when it is the first of them; a padding id (< 0, possibly several a token) is a group of its own
    pair. Row T * TOPK: the shared expert, every token."""
    m = tl.arange(0, G)
    r = T * TOPK
    routed = i < r
    e_raw = tl.load(sorted_ptr + i, mask=routed, other=0)
    prev = tl.load(sorted_ptr + tl.maximum(i - 1, 0), mask=routed, other=0)
    neg = routed & (e_raw < 0)
    lead = (i >= r) | neg | (i == 0) | (prev != e_raw)
    e = e_raw - start
    valid = (i >= r) | ((e >= 0) & (e < E_LOCAL))
    idx = i + m
    same = (idx < r) & (tl.load(sorted_ptr + idx, mask=routed & (idx < r), other=-1) == e_raw)
    mok = tl.where(routed, tl.where(neg, m == 0, same), m < T)
    if TOPK > 0:
        flat = tl.load(order_ptr + idx, mask=routed & mok, other=0)
        tok = tl.where(routed, flat // TOPK, m.to(tl.int64))
        slot = tl.where(routed, flat % TOPK, TOPK)
    else:  # the shared expert alone
        tok = m.to(tl.int64)
        slot = tok * 0
    return lead, valid, tl.where(routed & valid, e, 0), mok, tok * (TOPK + SH) + slot, tok, slot


@triton.jit
def _grouped_gate_up_kernel(x_ptr, sorted_ptr, order_ptr, g_ptr, u_ptr, sg_ptr, su_ptr, act_ptr, start, E_LOCAL, T,
                            H, INTER, INTER_SH, stride_x, stride_we, stride_wn, stride_swn, stride_a,
                            TOPK: tl.constexpr, SH: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, H_TILES: tl.constexpr):
    """act[p] = silu(x[t] @ G.T) * (x[t] @ U.T) for every member pair p of the group this program leads."""
    i = tl.program_id(0).to(tl.int64)
    lead, valid, e, mok, pair, tok, slot = _group(sorted_ptr, order_ptr, i, start, E_LOCAL, T, TOPK, SH, G)
    wg_ptr, wu_ptr, inter, stride_n = _gate_up_rows(i >= T * TOPK, e, g_ptr, u_ptr, sg_ptr, su_ptr, stride_we,
                                                    stride_wn, stride_swn, INTER, INTER_SH)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < inter
    if lead & valid & (tl.program_id(1) * BN < inter):
        members = tl.arange(0, G)
        count = tl.sum(mok.to(tl.int32), 0)
        acc_g = tl.zeros([G, BN], tl.float32)
        acc_u = tl.zeros([G, BN], tl.float32)
        off = n[:, None].to(tl.int64) * stride_n
        for h in tl.static_range(H_TILES):
            kk = h * BK + tl.arange(0, BK)
            km = kk < H
            m2 = nm[:, None] & km[None, :]
            wg = tl.load(wg_ptr + off + kk[None, :], mask=m2, other=0.0).to(tl.float32)  # once for the group
            wu = tl.load(wu_ptr + off + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            for k in range(count):
                t = tl.sum(tl.where(members == k, tok, 0), 0)
                x = tl.load(x_ptr + t * stride_x + kk, mask=km, other=0.0).to(tl.float32)
                hit = (members == k)[:, None]
                acc_g += tl.where(hit, tl.sum(wg * x[None, :], 1)[None, :], 0.0)
                acc_u += tl.where(hit, tl.sum(wu * x[None, :], 1)[None, :], 0.0)
        dt = act_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        sg = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(act_ptr + pair[:, None] * stride_a + n[None, :], (sg * acc_u.to(dt).to(tl.float32)).to(dt),
                 mask=mok[:, None] & nm[None, :])


@triton.jit
def _grouped_down_kernel(act_ptr, sorted_ptr, order_ptr, tw_ptr, w_ptr, x_ptr, sw_ptr, gw_ptr, part_ptr, start,
                         E_LOCAL, T, H, INTER, INTER_SH, stride_a, stride_we, stride_wn, stride_x, stride_swn,
                         TOPK: tl.constexpr, SH: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, BH: tl.constexpr, I_TILES: tl.constexpr, H_TILES: tl.constexpr):
    """part[p] = scale * (act[p] @ D.T) for every member pair p of the group (scale: the routing weight, or the
    shared expert's gate), rounded as moe_small._down_kernel rounds it; zeros for a foreign expert's pairs."""
    i = tl.program_id(0).to(tl.int64)
    lead, valid, e, mok, pair, tok, slot = _group(sorted_ptr, order_ptr, i, start, E_LOCAL, T, TOPK, SH, G)
    shared = i >= T * TOPK
    if shared:
        wd_ptr = sw_ptr
        lim = INTER_SH
        stride_n = stride_swn
    else:
        wd_ptr = w_ptr + e * stride_we
        lim = tl.where(valid, INTER, 0)  # a foreign expert's loads are all masked off
        stride_n = stride_wn
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < H
    if lead:
        dt = act_ptr.dtype.element_ty
        members = tl.arange(0, G)
        count = tl.sum(mok.to(tl.int32), 0)
        acc = tl.zeros([G, BN], tl.float32)
        for c in tl.static_range(I_TILES):
            kk = c * BK + tl.arange(0, BK)
            km = kk < lim
            w = tl.load(wd_ptr + n[:, None].to(tl.int64) * stride_n + kk[None, :], mask=nm[:, None] & km[None, :],
                        other=0.0).to(tl.float32)  # once for the group
            for k in range(count):
                p = tl.sum(tl.where(members == k, pair, 0), 0)
                a = tl.load(act_ptr + p * stride_a + kk, mask=km, other=0.0).to(tl.float32)
                acc += tl.where((members == k)[:, None], tl.sum(w * a[None, :], 1)[None, :], 0.0)
        scale = tl.zeros([G], tl.float32)
        if shared:
            for k in range(count):
                gacc = tl.zeros([BH], tl.float32)
                for h in tl.static_range(H_TILES):  # each token's gate: one dot product
                    hh = h * BH + tl.arange(0, BH)
                    hm = hh < H
                    gacc += tl.load(x_ptr + k * stride_x + hh, mask=hm, other=0.0).to(tl.float32) * \
                        tl.load(gw_ptr + hh, mask=hm, other=0.0).to(tl.float32)
                gate = tl.sigmoid(tl.sum(gacc, 0).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                scale = tl.where(members == k, gate, scale)
        else:
            scale = tl.load(tw_ptr + tok * TOPK + slot, mask=mok, other=0.0).to(tl.float32)
        val = tl.where(valid, (acc.to(dt).to(tl.float32) * scale[:, None]).to(dt).to(tl.float32), 0.0)
        tl.store(part_ptr + pair[:, None] * H + n[None, :], val, mask=mok[:, None] & nm[None, :])


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor | None,  # [T, k] global expert ids (outside [start, start + E): nothing); None: shared only
    topk_w: torch.Tensor | None,  # [T, k]
    gate_up: torch.Tensor | None,  # [E, 2I, H]
    down: torch.Tensor | None,  # [E, H, I]
    start: int,
    shared: SharedWeights | None = None,
    out: torch.Tensor | None = None,  # [T, H]; with topk_ids None it holds the routed sum the shared expert adds to
    bn_up: int = 4,
    bn_down: int = 16,  # as _experts: the same tile shape keeps the reduction order, so bitwise equal
) -> torch.Tensor:  # [T, H]
    """pair_experts' result (bitwise), each expert's weight tiles read once per group of its tokens."""
    t, h = x.shape
    topk, sh = (topk_ids.shape[1] if topk_ids is not None else 0), int(shared is not None)
    assert topk + sh > 0 and x.stride(1) == 1
    out = torch.empty_like(x) if out is None else out
    if topk_ids is None:  # shared expert alone: stand-ins of the right types for the unused pointers
        gate_up, down, topk_w = x[None], x[None], x
        flat = torch.zeros(1, dtype=torch.long, device=x.device)
        order = flat
    else:
        flat, order = torch.sort(topk_ids.reshape(-1), stable=True)  # [T * k] expert ids ascending, pair order
        topk_w = topk_w.contiguous()
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    inter_sh = shared.gate.shape[0] if shared is not None else 0
    sg, su, sd, gw = shared if shared is not None else (x, x, x, x)
    width = max(inter if topk else 0, inter_sh)
    rows = t * topk + sh  # programs along dim 0: sorted routed pairs, then the shared group
    g = triton.next_power_of_2(t)  # members of a group: at most one pair per token
    act = torch.empty(t * (topk + sh), width, dtype=x.dtype, device=x.device)
    bk_up = min(triton.next_power_of_2(h), 1024)
    _grouped_gate_up_kernel[(rows, triton.cdiv(width, bn_up))](
        x, flat, order, gate_up[:, :inter], gate_up[:, inter:], sg, su, act, start, e, t, h, inter, inter_sh,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), sg.stride(0), act.stride(0),
        TOPK=topk, SH=sh, G=g, BN=bn_up, BK=bk_up, H_TILES=triton.cdiv(h, bk_up), num_warps=4,
    )
    part = torch.empty(t * (topk + sh), h, dtype=torch.float32, device=x.device)
    bk, bh = min(triton.next_power_of_2(max(width, 16)), 512), min(triton.next_power_of_2(h), 2048)
    _grouped_down_kernel[(rows, triton.cdiv(h, bn_down))](
        act, flat, order, topk_w, down, x, sd, gw, part, start, e, t, h, inter, inter_sh,
        act.stride(0), down.stride(0), down.stride(1), x.stride(0), sd.stride(0),
        TOPK=topk, SH=sh, G=g, BN=bn_down, BK=bk, BH=bh, I_TILES=triton.cdiv(width, bk), H_TILES=triton.cdiv(h, bh),
        num_warps=4,
    )
    slot_sum(part, out, topk, sh)
    return out
