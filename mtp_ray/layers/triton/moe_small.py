"""Small-batch MoE in Triton (GPU): the experts of a few tokens as two GEMV launches with no sorting, for decode
steps whose pairs would leave the grouped GEMM's tiles (triton/moe.py) one or two rows each and cost it a planning
launch (the router: triton/route.py).

- `pair_experts`: gate_up + SwiGLU per (token, slot) pair (one program per pair and output tile), down +
  weighting per pair the same way (into fp32 partials), then the sum over the slots in slot order per token (no
  atomics: deterministic). Roundings follow Experts / fused_experts: each GEMM output, SiLU, the product and the
  weighted output are rounded to the activation dtype; the slot sum runs in fp32 and is rounded once. With
  `shared` (no EP exchange between the routed and the shared expert) the shared expert is one more pair per token
  in the same launches: a MoE layer of a decode step is router GEMV + top-k + 3 launches (the slot sum:
  triton/moe_common.py).
- `shared_expert_add`: the shared expert alone in the same kernels (the EP path: routed sum from the exchange).
FP8-resident experts (layers/fp8.py): e4m3 weights and block scales read in the same launches (triton/fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp_ray.layers.fp8 import Fp8Weight
from mtp_ray.layers.triton import pdl
from mtp_ray.layers.triton.fp8 import block_scales, dequant, rows_in_block, scale_args
from mtp_ray.layers.triton.moe_common import SharedWeights, gate_up_rows, slot_sum


@triton.jit
def _row_dot(w, x, s_ptr, rows, cols, km, m2, stride_sn, FP8: tl.constexpr, TILE_SCALE: tl.constexpr,
             SN: tl.constexpr, SK: tl.constexpr):
    """fp32 [BN]: a loaded [BN, BK] weight tile (rows, cols: its weight rows and columns) times x [BK] (fp32),
    FP8 scales applied (TILE_SCALE: every row in one scale row block, so x is scaled instead)."""
    if TILE_SCALE:
        x = x * block_scales(s_ptr, tl.min(rows, 0), cols, km, stride_sn, SN, SK)
        w = w.to(tl.float32)
    elif FP8:
        w = dequant(w, s_ptr, rows[:, None], cols[None, :], m2, stride_sn, SN, SK)
    else:
        w = w.to(tl.float32)
    return tl.sum(w * x[None, :], 1)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, g_ptr, u_ptr, sg_ptr, su_ptr, gs_ptr, sgs_ptr, sus_ptr, act_ptr, start, E_LOCAL,
                    H, INTER, INTER_SH, stride_x, stride_we, stride_wn, stride_swn, stride_a, stride_gse, stride_gsn,
                    stride_ssn, TOPK: tl.constexpr, SH: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    H_TILES: tl.constexpr, FP8: tl.constexpr, TILE_SCALE: tl.constexpr, SN: tl.constexpr,
                    SK: tl.constexpr, PDL: tl.constexpr):
    """act[p] = silu(x[t] @ G.T) * (x[t] @ U.T) for pair p = t * (TOPK + SH) + j: slot j < TOPK is the token's
    local routed expert ids[t, j] (G, U: [E, I, H] views; a foreign expert's row is skipped), slot TOPK (SH = 1)
    the shared expert (SG, SU: [I_sh, H]). TOPK = 0, SH = 1: the shared expert alone. FP8: every weight is e4m3
    with (SN x SK) block scales (GS: the fused gate_up's [E, 2I / SN, H / SK]; SGS, SUS: the shared gate's and
    up's)."""
    pdl.enter(PDL)
    p = tl.program_id(0).to(tl.int64)
    t = p // (TOPK + SH)
    j = p % (TOPK + SH)
    shared = j >= TOPK  # the shared expert (only when SH = 1)
    e = tl.load(ids_ptr + t * TOPK + j, mask=j < TOPK, other=0) - start
    ok = shared | ((e >= 0) & (e < E_LOCAL))
    wg_ptr, wu_ptr, inter, stride_n, gs, us, up_row, stride_sn = gate_up_rows(
        shared, tl.where(ok, e, 0), g_ptr, u_ptr, sg_ptr, su_ptr, gs_ptr, sgs_ptr, sus_ptr, stride_we, stride_wn,
        stride_swn, stride_gse, stride_gsn, stride_ssn, INTER, INTER_SH)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < inter
    if ok & (tl.program_id(1) * BN < inter):
        dt = act_ptr.dtype.element_ty
        acc_g = tl.zeros([BN], tl.float32)
        acc_u = tl.zeros([BN], tl.float32)
        off = n[:, None].to(tl.int64) * stride_n
        for i in tl.static_range(H_TILES):  # unrolled (a static tile count): every tile's loads in flight at once
            kk = i * BK + tl.arange(0, BK)
            km = kk < H
            x = tl.load(x_ptr + t * stride_x + kk, mask=km, other=0.0).to(tl.float32)
            m2 = nm[:, None] & km[None, :]
            acc_g += _row_dot(tl.load(wg_ptr + off + kk[None, :], mask=m2, other=0.0), x, gs, n, kk, km, m2,
                              stride_sn, FP8, TILE_SCALE, SN, SK)
            acc_u += _row_dot(tl.load(wu_ptr + off + kk[None, :], mask=m2, other=0.0), x, us, up_row + n, kk, km,
                              m2, stride_sn, FP8, TILE_SCALE, SN, SK)
        g = acc_g.to(dt).to(tl.float32)
        sg = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(act_ptr + p * stride_a + n, (sg * acc_u.to(dt).to(tl.float32)).to(dt), mask=nm)


@triton.jit
def _down_kernel(act_ptr, ids_ptr, tw_ptr, w_ptr, x_ptr, sw_ptr, gw_ptr, ds_ptr, sds_ptr, part_ptr, start, E_LOCAL,
                 H, INTER, INTER_SH, stride_a, stride_we, stride_wn, stride_x, stride_swn, stride_dse, stride_dsn,
                 stride_sdsn, TOPK: tl.constexpr, SH: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 BH: tl.constexpr, I_TILES: tl.constexpr, H_TILES: tl.constexpr, FP8: tl.constexpr,
                 TILE_SCALE: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr, PDL: tl.constexpr):
    """part[p] = w[t, j] * (act[p] @ D[e].T) for pair p = t * (TOPK + SH) + j (zero for a foreign expert); the
    shared pair: sigmoid(x[t] @ gw) * (act[p] @ SD.T); each step rounded as SparseMoE.forward rounds it, kept in
    fp32 for _slot_sum_kernel. One pair per program: a program waits on one weight tile's round trip to memory,
    not on one per slot in turn. FP8: D, SD e4m3 with (SN x SK) block scales DS [E, H / SN, I / SK], SDS (the
    gate GW is never quantized)."""
    pdl.enter(PDL)
    p = tl.program_id(0).to(tl.int64)
    t = p // (TOPK + SH)
    j = p % (TOPK + SH)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < H
    dt = act_ptr.dtype.element_ty
    if j >= TOPK:  # the shared expert (only when SH = 1)
        wd_ptr = sw_ptr
        lim = INTER_SH
        stride_n = stride_swn
        valid = t >= 0
        s_ptr = sds_ptr
        stride_sn = stride_sdsn
        gacc = tl.zeros([BH], tl.float32)
        for i in tl.static_range(H_TILES):  # its gate: one dot product per token
            hh = i * BH + tl.arange(0, BH)
            hm = hh < H
            gacc += tl.load(x_ptr + t * stride_x + hh, mask=hm, other=0.0).to(tl.float32) * \
                tl.load(gw_ptr + hh, mask=hm, other=0.0).to(tl.float32)
        scale = tl.sigmoid(tl.sum(gacc, 0).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    else:
        e = tl.load(ids_ptr + t * TOPK + j) - start
        valid = (e >= 0) & (e < E_LOCAL)
        wd_ptr = w_ptr + tl.where(valid, e, 0) * stride_we
        lim = tl.where(valid, INTER, 0)  # a foreign expert's loads are all masked off
        stride_n = stride_wn
        s_ptr = ds_ptr + tl.where(valid, e, 0) * stride_dse
        stride_sn = stride_dsn
        scale = tl.load(tw_ptr + t * TOPK + j).to(tl.float32)
    acc = tl.zeros([BN], tl.float32)
    for i in tl.static_range(I_TILES):
        kk = i * BK + tl.arange(0, BK)
        km = kk < lim
        a = tl.load(act_ptr + p * stride_a + kk, mask=km, other=0.0).to(tl.float32)
        m2 = nm[:, None] & km[None, :]
        w = tl.load(wd_ptr + n[:, None].to(tl.int64) * stride_n + kk[None, :], mask=m2, other=0.0)
        acc += _row_dot(w, a, s_ptr, n, kk, km, m2, stride_sn, FP8, TILE_SCALE, SN, SK)
    val = tl.where(valid, (acc.to(dt).to(tl.float32) * scale).to(dt).to(tl.float32), 0.0)
    tl.store(part_ptr + p * H + n, val, mask=nm)


def _experts(x: torch.Tensor, ids: torch.Tensor | None, tw: torch.Tensor | None, gate_up: torch.Tensor | None,
             down: torch.Tensor | None, start: int, shared: SharedWeights | None, out: torch.Tensor,
             fp8: tuple[Fp8Weight, Fp8Weight] | None = None, tile: tuple[int, int, int] | None = None
             ) -> torch.Tensor:
    """Both launches. x: [T, H]; ids, tw: [T, k] or None (shared expert alone, added to `out`'s routed input);
    gate_up: [E, 2I, H]; down: [E, H, I]; out: [T, H] (written in place); fp8: gate_up's and down's scales when
    they are e4m3 (then the shared expert's must be too, with the same blocks: one launch reads one kind); tile:
    (gate_up BN, gate_up BK, down BN), default `expert_tiles`."""
    t, h = x.shape
    topk, sh = (ids.shape[1] if ids is not None else 0), int(shared is not None)
    assert topk + sh > 0 and x.stride(1) == 1 and out.stride(1) == 1
    sfp8 = shared.fp8 if shared is not None else None
    if topk and sh:
        assert (fp8 is None) == (sfp8 is None), "routed and shared experts: both FP8 or neither"
        assert fp8 is None or fp8[0].block == sfp8[0].block == sfp8[1].block and fp8[1].block == sfp8[2].block
    # the unused side's pointers: stand-ins of the same types (a program's branches must agree on them)
    if not topk:
        gate_up, down, tw = shared.gate[None], shared.down[None], x
        ids = torch.zeros(1, dtype=torch.long, device=x.device)
        fp8 = (sfp8[0], sfp8[2]) if sfp8 is not None else None
    if shared is None:  # the routed weights and scales in the shared expert's place
        sg, su, sd, gw = gate_up[0], gate_up[0], down[0], x
        sfp8 = (fp8[0], fp8[0], fp8[1]) if fp8 is not None else None
    else:
        sg, su, sd, gw = shared[:4]
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    inter_sh = shared.gate.shape[0] if shared is not None else 0
    assert gate_up.stride(2) == 1 and down.stride(2) == 1 and sd.stride(-1) == 1
    assert sg.stride() == su.stride() and sg.stride(-1) == 1
    gu8, dn8 = fp8 if fp8 is not None else (None, None)
    gs, gs_e, gs_n, sn, sk = scale_args(gate_up, gu8)
    sgs, _, ss_n, *_ = scale_args(sg, sfp8[0] if sfp8 else None)
    sus, _, su_n, *_ = scale_args(su, sfp8[1] if sfp8 else None)
    assert su_n == ss_n, "shared gate and up: one scale layout"
    width = max(inter if topk else 0, inter_sh)
    pairs = t * (topk + sh)
    act = torch.empty(pairs, width, dtype=x.dtype, device=x.device)
    bn_up, bk_up, bn_down = tile or expert_tiles(h, fp8 is not None)
    # FP8: the input scaled per program when its rows (gate's and up's alike) stay in one scale row block
    tile_scale = fp8 is not None and rows_in_block(bn_up, sn, sk) and (topk == 0 or inter % sn == 0)
    _gate_up_kernel[(pairs, triton.cdiv(width, bn_up))](
        x, ids, gate_up[:, :inter], gate_up[:, inter:], sg, su, gs, sgs, sus, act, start, e, h, inter, inter_sh,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), sg.stride(0), act.stride(0), gs_e, gs_n, ss_n,
        TOPK=topk, SH=sh, BN=bn_up, BK=bk_up, H_TILES=triton.cdiv(h, bk_up), FP8=fp8 is not None,
        TILE_SCALE=tile_scale, SN=sn, SK=sk, num_warps=4, **pdl.launch_args(x.device),
    )
    down_sum(act, ids, tw, down, start, x, (sd, gw), out, topk, sh, inter, inter_sh, bn_down,
             (dn8, sfp8[2]) if fp8 is not None else None)
    return out


def expert_tiles(h: int, fp8: bool) -> tuple[int, int, int]:
    """(gate_up BN, gate_up BK, down BN). bf16 (bench/kernels.py sweep, H200, 1 and 4 tokens): gate_up 4 weight
    rows a program, 1024 inputs a load; down 16 output rows a program (9.3 / 23.6 us against 10.1 / 27.3 with 4).
    FP8 (1 / 4 tokens, e4m3 + shared expert): gate_up twice the rows, the same bytes a program; down as bf16
    (16.3 / 37.5 us against bf16's 21.8 / 63.0)."""
    bk = min(triton.next_power_of_2(h), 1024)
    return (8 if fp8 else 4), bk, 16


def down_sum(act: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, down: torch.Tensor, start: int,
             x: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor, topk: int, sh: int,
             inter: int, inter_sh: int, bn: int = 4, fp8: tuple[Fp8Weight, Fp8Weight] | None = None) -> None:
    """The down launches: one program per (pair, BN outputs) into fp32 partials [pairs, H], then their sum per
    token in slot order into out [T, H]. shared: (down [H, I_sh], gate [1, H]), stand-ins of the routed down's
    type when sh = 0; fp8: the routed and the shared down's scales (one block; stand-ins likewise)."""
    t, h = out.shape
    sd, gw = shared
    width = act.shape[1]
    pairs = t * (topk + sh)
    part = torch.empty(pairs, h, dtype=torch.float32, device=out.device)
    bk, bh = min(triton.next_power_of_2(max(width, 16)), 512), min(triton.next_power_of_2(h), 2048)
    ds, ds_e, ds_n, sn, sk = scale_args(down, fp8[0] if fp8 else None)
    sds, _, sds_n, *_ = scale_args(sd, fp8[1] if fp8 else None)
    tile_scale = False
    if fp8 is not None:
        assert fp8[0].block == fp8[1].block, "routed and shared down: one scale block"
        tile_scale = rows_in_block(bn, sn, sk)
    _down_kernel[(pairs, triton.cdiv(h, bn))](
        act, ids, tw, down, x, sd, gw, ds, sds, part, start, down.shape[0], h, inter, inter_sh,
        act.stride(0), down.stride(0), down.stride(1), x.stride(0), sd.stride(0), ds_e, ds_n, sds_n,
        TOPK=topk, SH=sh, BN=bn, BK=bk, BH=bh, I_TILES=triton.cdiv(width, bk), H_TILES=triton.cdiv(h, bh),
        FP8=fp8 is not None, TILE_SCALE=tile_scale, SN=sn, SK=sk, num_warps=4, **pdl.launch_args(out.device),
    )
    slot_sum(part, out, topk, sh)


def pair_experts(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] global expert ids (ids outside [start, start + E) contribute nothing)
    topk_w: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    start: int,
    shared: SharedWeights | None = None,  # the shared expert too, in the same two launches (no EP in between)
    fp8: tuple[Fp8Weight, Fp8Weight] | None = None,  # gate_up's and down's scales when they are e4m3
    tile: tuple[int, int, int] | None = None,  # (gate_up BN, gate_up BK, down BN): the sweep's override
) -> torch.Tensor:  # [T, H]
    out = torch.empty_like(x)
    return _experts(x, topk_ids.contiguous(), topk_w.contiguous(), gate_up, down, start, shared, out, fp8, tile)


SHARED_PAIR_TOKENS = 8  # up to this many tokens the shared expert runs as per-token GEMVs, past it grouped


def shared_expert_add(x: torch.Tensor, routed: torch.Tensor, shared: SharedWeights) -> torch.Tensor:
    """routed + sigmoid(x @ scale.T) * down(silu(gate(x)) * up(x)) (the EP path, where the routed sum arrives from
    the exchange): two GEMV launches for a few tokens, past SHARED_PAIR_TOKENS the grouped launches (triton/moe.py:
    the weights read once, not once a token). x, routed: [T, H]."""
    if x.shape[0] > SHARED_PAIR_TOKENS:
        from mtp_ray.layers.triton.moe import shared_expert_grouped

        return shared_expert_grouped(x, routed, shared)
    return _experts(x, None, None, None, None, 0, shared, routed.clone())
