"""Small-batch MoE in Triton (GPU): the router's softmax + top-k in one launch, and the experts of a few tokens as
two GEMV launches with no sorting, for decode steps where the sorted grouped GEMM (moe_triton.py) spends more
time planning tiles than multiplying.

- `route_topk`: per token, softmax over the router logits (fp32), top-k by repeated argmax (descending, lowest
  id first on ties), renormalised -> ids, weights in the activation dtype.
- `pair_experts`: gate_up + SwiGLU per (token, slot) pair (one program per pair and output tile), then down +
  weighting + sum over the slots in slot order per token (no atomics: deterministic). Roundings follow
  Experts / fused_experts: each GEMM output, SiLU, the product and the weighted output are rounded to the
  activation dtype; the slot sum runs in fp32 and is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, E, stride_l, TOPK: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(e < E, p, -1.0)
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int64)
    vals = tl.zeros([BLOCK_K], tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.argmax(p, 0, tie_break_left=True)
        ids = tl.where(slot == j, best.to(tl.int64), ids)
        vals = tl.where(slot == j, tl.max(p, 0), vals)
        p = tl.where(e == best, -1.0, p)
    if NORM:
        vals = vals / tl.sum(vals, 0)
    tl.store(ids_ptr + t * TOPK + slot, ids, mask=slot < TOPK)
    tl.store(w_ptr + t * TOPK + slot, vals.to(w_ptr.dtype.element_ty), mask=slot < TOPK)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] router output -> ids [T, k] int64, weights [T, k] in dtype."""
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.long, device=logits.device)
    w = torch.empty(t, top_k, dtype=dtype, device=logits.device)
    _route_kernel[(t,)](logits, ids, w, e, logits.stride(0), TOPK=top_k, NORM=renormalize,
                        BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
                        num_warps=1 if e <= 256 else 4)
    return ids, w


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, g_ptr, u_ptr, act_ptr, start, E_LOCAL, H, INTER,
                    stride_x, stride_we, stride_wn, stride_a,
                    TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SINGLE: tl.constexpr):
    """act[p] = silu(x[p // TOPK] @ G[e].T) * (x @ U[e].T) for pair p's local expert e (G, U: [E, I, H] views).
    SINGLE: one expert for every token (the shared expert), no ids."""
    p = tl.program_id(0).to(tl.int64)
    if SINGLE:
        e = p * 0
    else:
        e = tl.load(ids_ptr + p) - start
    if (e >= 0) & (e < E_LOCAL):
        t = p // TOPK
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < INTER
        acc_g = tl.zeros([BN], tl.float32)
        acc_u = tl.zeros([BN], tl.float32)
        off = e * stride_we + n[:, None] * stride_wn
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            x = tl.load(x_ptr + t * stride_x + kk, mask=km, other=0.0).to(tl.float32)
            m2 = nm[:, None] & km[None, :]
            wg = tl.load(g_ptr + off + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            wu = tl.load(u_ptr + off + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            acc_g += tl.sum(wg * x[None, :], 1)
            acc_u += tl.sum(wu * x[None, :], 1)
        dt = act_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        sg = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(act_ptr + p * stride_a + n, (sg * acc_u.to(dt).to(tl.float32)).to(dt), mask=nm)


@triton.jit
def _down_kernel(act_ptr, ids_ptr, tw_ptr, w_ptr, out_ptr, start, E_LOCAL, H, INTER,
                 stride_a, stride_we, stride_wn, stride_o,
                 TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < H
    dt = out_ptr.dtype.element_ty
    total = tl.zeros([BN], tl.float32)
    # straight-line over the slots (foreign experts masked, not branched): all TOPK tiles can be in flight
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        e = tl.load(ids_ptr + p) - start
        valid = (e >= 0) & (e < E_LOCAL)
        e = tl.where(valid, e, 0)
        lim = tl.where(valid, INTER, 0)  # a foreign expert's loads are all masked off
        acc = tl.zeros([BN], tl.float32)
        for k0 in range(0, INTER, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < lim
            a = tl.load(act_ptr + p * stride_a + kk, mask=km, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + e * stride_we + n[:, None] * stride_wn + kk[None, :],
                        mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], 1)
        weight = tl.load(tw_ptr + p).to(tl.float32)
        total += tl.where(valid, (acc.to(dt).to(tl.float32) * weight).to(dt).to(tl.float32), 0.0)
    tl.store(out_ptr + t * stride_o + n, total.to(dt), mask=nm)


def _gate_up(x: torch.Tensor, ids: torch.Tensor | None, g: torch.Tensor, u: torch.Tensor, start: int, topk: int
             ) -> torch.Tensor:
    """x: [T, H]; ids: [T * topk] (None: expert 0 for every token, topk 1); g, u: [E, I, H] (same strides)
    -> SwiGLU activations [T * topk, I]."""
    e, inter, h = g.shape
    assert g.stride() == u.stride() and g.stride(2) == 1 and x.stride(1) == 1
    rows = ids.numel() if ids is not None else x.shape[0]
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    # GEMV tiles: a few weight rows over the whole hidden dim per program, many programs (bandwidth-bound)
    bk = min(triton.next_power_of_2(h), 2048)
    _gate_up_kernel[(rows, triton.cdiv(inter, 4))](
        x, ids if ids is not None else x, g, u, act, start, e, h, inter, x.stride(0), g.stride(0), g.stride(1),
        act.stride(0), TOPK=topk, BN=4, BK=bk, SINGLE=ids is None, num_warps=4,
    )
    return act


def pair_experts(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] global expert ids (ids outside [start, start + E) contribute nothing)
    topk_w: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    start: int,
) -> torch.Tensor:  # [T, H]
    t, topk = topk_ids.shape
    e, two_i, h = gate_up.shape
    inter = two_i // 2
    assert down.stride(2) == 1
    ids = topk_ids.contiguous()
    act = _gate_up(x, ids, gate_up[:, :inter], gate_up[:, inter:], start, topk)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    bk = min(triton.next_power_of_2(inter), 1024)
    _down_kernel[(t, triton.cdiv(h, 4))](
        act, ids, topk_w.contiguous(), down, out, start, e, h, inter, act.stride(0), down.stride(0), down.stride(1),
        out.stride(0), TOPK=topk, BN=4, BK=bk, num_warps=4,
    )
    return out


@triton.jit
def _shared_down_kernel(act_ptr, w_ptr, x_ptr, gw_ptr, r_ptr, out_ptr, H, INTER,
                        stride_a, stride_wn, stride_x, stride_r, stride_o,
                        BN: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr):
    """out = routed + sigmoid(x @ gw) * (act @ W.T), each step rounded as SparseMoE.forward rounds it."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < H
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(0, INTER, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < INTER
        a = tl.load(act_ptr + t * stride_a + kk, mask=km, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * stride_wn + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], 1)
    gacc = tl.zeros([BH], tl.float32)
    for h0 in range(0, H, BH):  # the shared-expert gate: one dot product per token
        hh = h0 + tl.arange(0, BH)
        hm = hh < H
        gacc += tl.load(x_ptr + t * stride_x + hh, mask=hm, other=0.0).to(tl.float32) * \
            tl.load(gw_ptr + hh, mask=hm, other=0.0).to(tl.float32)
    gate = tl.sigmoid(tl.sum(gacc, 0).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    shared = (acc.to(dt).to(tl.float32) * gate).to(dt).to(tl.float32)
    routed = tl.load(r_ptr + t * stride_r + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + n, (routed + shared).to(dt), mask=nm)


def shared_expert_add(x: torch.Tensor, routed: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor,
                      down_w: torch.Tensor, shared_gate_w: torch.Tensor) -> torch.Tensor:
    """routed + sigmoid(x @ shared_gate_w.T) * down(silu(gate(x)) * up(x)) in two launches (few tokens).
    x, routed: [T, H]; gate_w, up_w: [I, H]; down_w: [H, I]; shared_gate_w: [1, H]."""
    t, h = x.shape
    inter = gate_w.shape[0]
    assert down_w.stride(1) == 1 and routed.stride(1) == 1
    act = _gate_up(x, None, gate_w[None], up_w[None], 0, 1)  # [T, I]
    out = torch.empty_like(routed)
    _shared_down_kernel[(t, triton.cdiv(h, 8))](
        act, down_w, x, shared_gate_w, routed, out, h, inter, act.stride(0), down_w.stride(0), x.stride(0),
        routed.stride(0), out.stride(0), BN=8, BK=min(triton.next_power_of_2(inter), 1024),
        BH=min(triton.next_power_of_2(h), 2048), num_warps=4,
    )
    return out
