"""Grouped-GEMM MoE experts in Triton (GPU): no host sync, so eager steps avoid a launch per expert and CUDA graphs
can capture the MoE layer; for batches past the per-pair GEMVs of moe_small.

Four launches a layer: the plan (triton/moe_plan.py: pairs sorted by local expert, stable, cut into tiles of BM
rows), gate_up with SwiGLU in its epilogue (each program multiplies one tile's gathered token rows by the gate and
the up rows of the same output columns), down weighted per pair into fp32 partials in pair order, and the slot-order
sum per token (triton/moe_common.py; no atomics: deterministic). The shared expert, when the caller hands it over
(no EP exchange in between), is one more key of the plan: its tiles read its own weights in the same launches.
Roundings follow Experts / SparseMoE.forward: each GEMM output, SiLU, the product and the weighted output are
rounded to the activation dtype, the slot sum runs in fp32 and is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp_ray.layers.fp8 import Fp8Weight
from mtp_ray.layers.triton import pdl
from mtp_ray.layers.triton.fp8 import fp8_tile, scale_args, scaled_dot
from mtp_ray.layers.triton.moe_common import SharedWeights, gate_up_rows, slot_sum
from mtp_ray.layers.triton.moe_plan import Plan, plan, tile_table


@triton.jit
def _gate_up_kernel(x_ptr, src_ptr, w_ptr, sg_ptr, su_ptr, s_ptr, ssg_ptr, ssu_ptr, act_ptr, te_ptr, r0_ptr, r1_ptr,
                    E_LOCAL, H, INTER, INTER_SH, stride_x, stride_we, stride_wn, stride_swn, stride_a, stride_se,
                    stride_sn, stride_ssn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SUB: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, TILE_SCALE: tl.constexpr,
                    SN: tl.constexpr, SK: tl.constexpr, PDL: tl.constexpr):
    """act[r, n] = silu(x[src[r]] @ G[n]) * (x[src[r]] @ U[n]) for the rows r of tile program_id(0): G, U the
    gate and up rows of expert te (W [E, 2I, H] fused gate_up, up from row INTER), or of the shared expert (SG, SU
    [I_sh, H]) when te = E_LOCAL. FP8: e4m3 weights with (SN x SK) block scales (S: [E, 2I / SN, H / SK]; SSG,
    SSU: the shared gate's and up's)."""
    pdl.enter(PDL)
    tile = tl.program_id(0)
    r0 = tl.load(r0_ptr + tile)
    r1 = tl.load(r1_ptr + tile)
    e = tl.load(te_ptr + tile).to(tl.int64)
    g_base, u_base, inter, stride_n, gs, us, up_row, ssn = gate_up_rows(
        e >= E_LOCAL, e, w_ptr, w_ptr + INTER * stride_wn, sg_ptr, su_ptr, s_ptr, ssg_ptr, ssu_ptr, stride_we,
        stride_wn, stride_swn, stride_se, stride_sn, stride_ssn, INTER, INTER_SH)
    if (r0 < r1) & (tl.program_id(1) * BLOCK_N < inter):
        r = r0 + tl.arange(0, BLOCK_M)
        rm = r < r1
        arow = tl.load(src_ptr + r, mask=rm, other=0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < inter
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            for j in tl.static_range(SUB):  # FP8: sub-tiles of one scale block each (SUB = 1 otherwise)
                kj = k0 + j * (BLOCK_K // SUB)
                kk = kj + tl.arange(0, BLOCK_K // SUB)
                km = kk < H
                a = tl.load(x_ptr + arow[:, None] * stride_x + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
                wm = km[:, None] & nm[None, :]
                off = n[None, :].to(tl.int64) * stride_n + kk[:, None]  # [BLOCK_K / SUB, BLOCK_N]
                wg = tl.load(g_base + off, mask=wm, other=0.0)
                wu = tl.load(u_base + off, mask=wm, other=0.0)
                acc_g += scaled_dot(a, wg, gs, n, kj, kk, nm, wm, ssn, IEEE, FP8, TILE_SCALE, SN, SK)
                acc_u += scaled_dot(a, wu, us, up_row + n, kj, kk, nm, wm, ssn, IEEE, FP8, TILE_SCALE, SN, SK)
        dt = act_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        sg = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        act = (sg * acc_u.to(dt).to(tl.float32)).to(dt)
        tl.store(act_ptr + r[:, None].to(tl.int64) * stride_a + n[None, :], act, mask=rm[:, None] & nm[None, :])


@triton.jit
def _down_kernel(act_ptr, dst_ptr, w_ptr, sd_ptr, s_ptr, ssd_ptr, tw_ptr, x_ptr, gw_ptr, out_ptr, te_ptr, r0_ptr,
                 r1_ptr, E_LOCAL, H, INTER, INTER_SH, stride_a, stride_we, stride_wn, stride_swn, stride_se,
                 stride_sn, stride_ssn, stride_x, stride_o, TOPK: tl.constexpr, SH: tl.constexpr,
                 WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_H: tl.constexpr, SUB: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                 TILE_SCALE: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr, PDL: tl.constexpr):
    """y = act[r] @ D.T for the rows r of tile program_id(0) (D: expert te's down [H, I], or the shared expert's
    SD [H, I_sh] when te = E_LOCAL), stored at out[dst[r]]. WEIGHTED (dst = pair p = t * (TOPK + SH) + j):
    round(y * tw[t, j]), the shared pair's scale sigmoid(x[t] @ GW) (one dot per token); otherwise y as is."""
    pdl.enter(PDL)
    tile = tl.program_id(0)
    r0 = tl.load(r0_ptr + tile)
    r1 = tl.load(r1_ptr + tile)
    if r0 < r1:
        e = tl.load(te_ptr + tile).to(tl.int64)
        shared = e >= E_LOCAL
        if shared:
            w_base = sd_ptr
            k_in = INTER_SH
            stride_n = stride_swn
            s_base = ssd_ptr
            ssn = stride_ssn
        else:
            w_base = w_ptr + e * stride_we
            k_in = INTER
            stride_n = stride_wn
            s_base = s_ptr + e * stride_se
            ssn = stride_sn
        r = r0 + tl.arange(0, BLOCK_M)
        rm = r < r1
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < H
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            for j in tl.static_range(SUB):
                kj = k0 + j * (BLOCK_K // SUB)
                kk = kj + tl.arange(0, BLOCK_K // SUB)
                km = kk < k_in
                a = tl.load(act_ptr + r[:, None].to(tl.int64) * stride_a + kk[None, :], mask=rm[:, None] & km[None, :],
                            other=0.0)
                wm = km[:, None] & nm[None, :]
                w = tl.load(w_base + n[None, :].to(tl.int64) * stride_n + kk[:, None], mask=wm, other=0.0)
                acc += scaled_dot(a, w, s_base, n, kj, kk, nm, wm, ssn, IEEE, FP8, TILE_SCALE, SN, SK)
        dt = act_ptr.dtype.element_ty
        y = acc.to(dt).to(tl.float32)
        drow = tl.load(dst_ptr + r, mask=rm, other=0).to(tl.int64)
        if WEIGHTED:
            tok = drow // (TOPK + SH)
            if shared:
                g = tl.zeros([BLOCK_M], tl.float32)
                for h0 in range(0, H, BLOCK_H):
                    hh = h0 + tl.arange(0, BLOCK_H)
                    hm = hh < H
                    xv = tl.load(x_ptr + tok[:, None] * stride_x + hh[None, :], mask=rm[:, None] & hm[None, :],
                                 other=0.0).to(tl.float32)
                    g += tl.sum(xv * tl.load(gw_ptr + hh, mask=hm, other=0.0).to(tl.float32)[None, :], 1)
                scale = tl.sigmoid(g.to(dt).to(tl.float32)).to(dt).to(tl.float32)
            else:
                scale = tl.load(tw_ptr + tok * TOPK + drow % (TOPK + SH), mask=rm, other=0.0).to(tl.float32)
            y = (y * scale[:, None]).to(dt).to(tl.float32)
        tl.store(out_ptr + drow[:, None] * stride_o + n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=rm[:, None] & nm[None, :])


Tile = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, warps, stages)


def gemm_tiles(ieee: bool, fp8: bool) -> tuple[Tile, Tile]:
    """The gate_up and the down GEMM's tiles (gate_up: BLOCK_N columns of the gate and of the up half each), from
    `bench/kernels.py --grouped` at 64 and 256 tokens (H200, 35B-A3B shapes, shared expert included): within 1 % of
    the best swept tile at both sizes (bench/results/kernels_h200_grouped_moe.json)."""
    if ieee:
        return (32, 32, 4, 3), (64, 32, 4, 3)
    return ((32, 128, 4, 3), (64, 128, 4, 3)) if fp8 else ((64, 128, 4, 3), (64, 128, 4, 3))


def grouped_experts(x: torch.Tensor, p: Plan, gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor,
                    weighted: tuple[torch.Tensor, int, int] | None, shared: SharedWeights | None = None,
                    fp8: tuple[Fp8Weight, Fp8Weight] | None = None,
                    tiles: tuple[Tile, Tile] | None = None) -> None:
    """gate_up + SwiGLU, then down into out[dst[r]] for every planned row r. x: [*, H]; gate_up: [E, 2I, H];
    down: [E, H, I]; weighted = (topk weights [T, k], k, SH): out holds the pairs' weighted fp32 partials
    (moe_common.slot_sum), else the plain expert outputs; shared: the shared expert's weights (key E of the plan);
    fp8: gate_up's and down's scales (the shared expert's then FP8 with the same blocks)."""
    e, two_i, h = gate_up.shape
    inter = two_i // 2
    rows = p.src.shape[0]
    if shared is None:  # stand-ins of the routed tensors' types: never read (no tile has key E)
        sg, su, sd, gw = gate_up[0], gate_up[0], down[0], x
        sfp8 = (fp8[0], fp8[0], fp8[1]) if fp8 is not None else None
    else:
        sg, su, sd, gw, sfp8 = shared
        assert (fp8 is None) == (sfp8 is None), "routed and shared experts: both FP8 or neither"
    inter_sh = shared.gate.shape[0] if shared is not None else 0
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1 and sd.stride(1) == 1
    assert sg.stride() == su.stride() and sg.stride(1) == 1
    ieee = x.dtype == torch.float32
    (bn, bk, warps, stages), (bn_d, bk_d, warps_d, stages_d) = tiles or gemm_tiles(ieee, fp8 is not None)
    gu8, dn8 = fp8 if fp8 is not None else (None, None)
    s, s_e, s_n, sn, sk = scale_args(gate_up, gu8)
    ssg, _, ss_n, *_ = scale_args(sg, sfp8[0] if sfp8 else None)
    ssu, _, su_n, *_ = scale_args(su, sfp8[1] if sfp8 else None)
    assert su_n == ss_n, "shared gate and up: one scale layout"
    bk, sub, tile_scale = fp8_tile(bk, sk) if fp8 is not None else (bk, 1, False)
    act = torch.empty(rows, max(inter, inter_sh), dtype=x.dtype, device=x.device)
    nt = p.te.shape[0]
    flags = dict(BLOCK_M=p.bm, IEEE=ieee, FP8=fp8 is not None, **pdl.launch_args(x.device))
    _gate_up_kernel[(nt, triton.cdiv(max(inter, inter_sh), bn))](
        x, p.src, gate_up, sg, su, s, ssg, ssu, act, p.te, p.r0, p.r1, e, h, inter, inter_sh, x.stride(0),
        gate_up.stride(0), gate_up.stride(1), sg.stride(0), act.stride(0), s_e, s_n, ss_n, BLOCK_N=bn, BLOCK_K=bk,
        SUB=sub, TILE_SCALE=tile_scale, SN=sn, SK=sk, num_warps=warps, num_stages=stages, **flags)
    ds, ds_e, ds_n, dsn, dsk = scale_args(down, dn8)
    sds, _, sds_n, *_ = scale_args(sd, sfp8[2] if sfp8 else None)
    bk_d, sub_d, tile_scale_d = fp8_tile(bk_d, dsk) if fp8 is not None else (bk_d, 1, False)
    tw, topk, sh = weighted if weighted is not None else (x, 0, 0)
    _down_kernel[(nt, triton.cdiv(h, bn_d))](
        act, p.dst, down, sd, ds, sds, tw, x, gw, out, p.te, p.r0, p.r1, e, h, inter, inter_sh, act.stride(0),
        down.stride(0), down.stride(1), sd.stride(0), ds_e, ds_n, sds_n, x.stride(0), out.stride(0), TOPK=topk,
        SH=sh, WEIGHTED=weighted is not None, BLOCK_N=bn_d, BLOCK_K=bk_d, BLOCK_H=min(triton.next_power_of_2(h), 256),
        SUB=sub_d, TILE_SCALE=tile_scale_d, SN=dsn, SK=dsk, num_warps=warps_d, num_stages=stages_d, **flags)


def _row_tile(pairs: int, e: int) -> int:
    # decode batches spread a few pairs over each expert: a 64-row tile of two real rows multiplies 62 padding
    # rows, so 16-row tiles up to 16 pairs an expert on average (two sizes only: warmup compiles both)
    return 16 if pairs <= max(256, 16 * e) else 64


def fused_experts(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] global expert ids (ids outside [start, start + E) contribute nothing)
    topk_w: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    start: int,
    per_slot: bool = False,  # [T, k, H] unsummed (zero for foreign experts) instead
    fp8: tuple[Fp8Weight, Fp8Weight] | None = None,  # gate_up's and down's scales when they are e4m3
    tiles: tuple[Tile, Tile] | None = None,  # gate_up's and down's tiles: the sweep's override
    shared: SharedWeights | None = None,  # the shared expert too (no EP in between; not with per_slot)
) -> torch.Tensor:  # [T, H]: sum over the local experts of weight * expert(x) (+ the shared expert's output)
    t, k = topk_ids.shape
    e = gate_up.shape[0]
    sh = int(shared is not None)
    assert not (per_slot and sh), "per-slot outputs are the routed experts' only"
    ids = topk_ids.contiguous()
    p = plan(ids, start, e, sh == 1, _row_tile(t * k, e))
    part = torch.empty(t * (k + sh), x.shape[1], dtype=torch.float32, device=x.device)
    grouped_experts(x, p, gate_up, down, part, (topk_w.contiguous(), k, sh), shared, fp8, tiles)
    if per_slot:  # foreign slots were never written
        local = (ids >= start) & (ids < start + e)
        return torch.where(local[..., None], part.view(t, k, -1), 0.0).to(x.dtype)
    out = torch.empty_like(x)
    slot_sum(part, out, k, sh, (ids, start, e))
    return out


def shared_expert_grouped(x: torch.Tensor, routed: torch.Tensor, shared: SharedWeights) -> torch.Tensor:
    """routed + sigmoid(x @ scale.T) * down(silu(gate(x)) * up(x)) for many tokens (the EP path, where the routed
    sum arrives from the exchange): the grouped launches with the shared expert as the only key, its weights read
    once for all T tokens. x, routed: [T, H]."""
    t = x.shape[0]
    sfp8 = shared.fp8
    ids = torch.empty(t, 0, dtype=torch.long, device=x.device)  # no routed slots: every pair is the shared one
    p = plan(ids, 0, 1, True, _row_tile(t, 1))
    part = torch.empty(t, x.shape[1], dtype=torch.float32, device=x.device)
    # the shared weights stand in for a routed expert 0 that no tile has (a launch reads one kind of weight)
    stand_in = (shared.gate[None], shared.down[None])
    grouped_experts(x, p, *stand_in, part, (x, 0, 1), shared, (sfp8[0], sfp8[2]) if sfp8 is not None else None)
    out = routed.clone()
    slot_sum(part, out, 0, 1)
    return out


def expert_major_experts(
    x: torch.Tensor,  # [E, M, H]: rows [0, counts[e]) of expert e are tokens (DeepEP's low-latency receive layout)
    counts: torch.Tensor,  # [E] int
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    max_rows: int,  # static bound on sum(counts) (tokens per rank x ranks x top-k): sizes the grid, graph-safe
    fp8: tuple[Fp8Weight, Fp8Weight] | None = None,  # gate_up's and down's scales when they are e4m3
) -> torch.Tensor:  # [E, M, H] unweighted expert outputs, zero past each expert's count
    e, m, h = x.shape
    bound = min(max_rows, e * m)
    bm = 16 if bound <= 256 else 64
    counts = counts.to(torch.long)
    seg_end = counts.cumsum(0)
    seg_start = seg_end - counts
    # compact index i -> (expert, row of x): the valid rows, expert after expert
    i = torch.arange(bound, device=x.device)
    ex = torch.searchsorted(seg_end, i, right=True).clamp_max(e - 1)
    rows = torch.where(i < seg_end[-1], ex * m + i - seg_start[ex], 0).to(torch.int32)  # [bound] row of x
    p = Plan(rows, rows, *tile_table(counts, seg_start, seg_end, bound, bm), bm)
    # the down GEMM stores straight into each row's place in the expert-major layout (zeroed: padding stays zero)
    y = torch.zeros(e * m, h, dtype=x.dtype, device=x.device)
    grouped_experts(x.reshape(e * m, h), p, gate_up, down, y, None, fp8=fp8)
    return y.view(e, m, h)
