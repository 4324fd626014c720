"""Grouped-GEMM MoE experts in Triton (GPU): no host sync, so eager steps avoid a launch per expert and CUDA graphs
can capture the MoE layer.

The (token, slot) pairs are sorted by local expert; each expert's run of pairs is cut into tiles of BLOCK_M rows.
The grid has a static upper bound of tiles (ceil(pairs / BLOCK_M) + experts); a program whose tile is empty does
nothing. Two GEMMs (gate_up with gathered token rows, then down) with SwiGLU between; the down GEMM weights each
pair's output and stores it in pair order (one pass, no separate weighting / un-permute kernels), and the pairs are
summed over the top-k slots (no atomics: deterministic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mtp_ray.layers.fp8 import Fp8Weight
from mtp_ray.layers.triton.fp8 import fp8_tile, scale_args, scaled_dot


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, rows_ptr, out_rows_ptr, scale_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K, stride_am, stride_we, stride_wn, stride_wk, stride_cm, stride_se, stride_sn,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SUB: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, TILE_SCALE: tl.constexpr,
    SN: tl.constexpr, SK: tl.constexpr,
):
    t = tl.program_id(0)
    r0 = tl.load(tile_start_ptr + t)
    r1 = tl.load(tile_end_ptr + t)
    if r0 < r1:
        e = tl.load(tile_expert_ptr + t).to(tl.int64)
        r = r0 + tl.arange(0, BLOCK_M)
        rm = r < r1
        if GATHER:
            arow = tl.load(rows_ptr + r, mask=rm, other=0).to(tl.int64)
        else:
            arow = r.to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            for j in tl.static_range(SUB):  # FP8: sub-tiles of one scale block each (SUB = 1 otherwise)
                kk = k0 + j * (BLOCK_K // SUB) + tl.arange(0, BLOCK_K // SUB)
                km = kk < K
                a = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=rm[:, None] & km[None, :],
                            other=0.0)
                wm = km[:, None] & nm[None, :]
                w = tl.load(w_ptr + e * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk, mask=wm,
                            other=0.0)  # [BLOCK_K / SUB, BLOCK_N]
                acc += scaled_dot(a, w, s_ptr + e * stride_se, n, k0 + j * (BLOCK_K // SUB), kk, nm, wm, stride_sn,
                                  IEEE, FP8, TILE_SCALE, SN, SK)
        out = acc.to(c_ptr.dtype.element_ty)
        crow = r.to(tl.int64)
        if SCATTER:  # weighted, into the pair's own row: round, then weight and round, as torch's y * w would
            sc = tl.load(scale_ptr + r, mask=rm, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) * sc[:, None]).to(c_ptr.dtype.element_ty)
            crow = tl.load(out_rows_ptr + r, mask=rm, other=0).to(tl.int64)
        tl.store(c_ptr + crow[:, None] * stride_cm + n[None, :], out, mask=rm[:, None] & nm[None, :])


def _gemm(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor | None, tiles: tuple, num_rows: int, bm: int,
          scatter: tuple[torch.Tensor, torch.Tensor] | None = None, fp8: Fp8Weight | None = None,
          tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """c[r] = a[rows[r] or r] @ w[expert(r)].T for every row r covered by a tile. a: [*, K]; w: [E, N, K] (e4m3
    with `fp8`'s scales [E, N / rows, K / cols]); tile: (BLOCK_N, BLOCK_K, warps, stages), default `gemm_tile`.
    scatter = (out_rows, scale): c[out_rows[r]] = round(round(a @ w.T) * scale[r]) instead, into a zeroed c (rows
    no tile covers stay zero)."""
    tile_expert, r0, r1 = tiles
    n_out, k_in = w.shape[1], w.shape[2]
    alloc = torch.zeros if scatter is not None else torch.empty
    c = alloc(num_rows, n_out, dtype=a.dtype, device=a.device)
    ieee = a.dtype == torch.float32
    bn, bk, warps, stages = tile or gemm_tile(ieee, fp8 is not None)
    grid = (tile_expert.numel(), triton.cdiv(n_out, bn))
    out_rows, scale = scatter if scatter is not None else (r0, r0)
    s, s_e, s_n, sn, sk = scale_args(w, fp8)
    bk, sub, tile_scale = fp8_tile(bk, sk) if fp8 is not None else (bk, 1, False)
    _grouped_gemm_kernel[grid](
        a, w, s, c, rows if rows is not None else r0, out_rows, scale, tile_expert, r0, r1,
        n_out, k_in, a.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0), s_e, s_n,
        GATHER=rows is not None, SCATTER=scatter is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SUB=sub,
        IEEE=ieee, FP8=fp8 is not None, TILE_SCALE=tile_scale, SN=sn, SK=sk, num_warps=warps, num_stages=stages,
    )
    return c


def gemm_tile(ieee: bool, fp8: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of the grouped GEMM: an FP8 weight takes a tile twice as wide in K, the
    same bytes a stage as bf16's, and 128 columns (bench/kernels.py --fp8: 506 vs 605 us at 64 tokens)."""
    if ieee:
        return 64, 32, 4, 3
    return (128, 128, 4, 3) if fp8 else (64, 64, 4, 3)


def _tiles(counts: torch.Tensor, seg_start: torch.Tensor, seg_end: torch.Tensor, num_rows: int, bm: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiles of up to bm rows over each expert's run [seg_start[e], seg_end[e]) of rows grouped by expert
    (counts: [E]), as (expert, first row, end row) per tile. Their number is a static bound, ceil(num_rows / bm) + E
    (graph-safe: no host sync); tiles past the last live one are empty (0, 0)."""
    e = counts.shape[0]
    ntiles = (counts + bm - 1) // bm
    tile_cum = ntiles.cumsum(0)
    i = torch.arange(triton.cdiv(num_rows, bm) + e, device=counts.device)
    tile_expert = torch.searchsorted(tile_cum, i, right=True).clamp_max(e - 1)
    r0 = seg_start[tile_expert] + (i - (tile_cum[tile_expert] - ntiles[tile_expert])) * bm
    r1 = torch.minimum(r0 + bm, seg_end[tile_expert])
    live = i < tile_cum[-1]
    return tile_expert, torch.where(live, r0, 0), torch.where(live, r1, 0)


def fused_experts(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] global expert ids (ids outside [start, start + E) contribute nothing)
    topk_w: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    start: int,
    per_slot: bool = False,  # [T, k, H] unsummed (zero for foreign experts) instead
    fp8: tuple[Fp8Weight, Fp8Weight] | None = None,  # gate_up's and down's scales when they are e4m3
    tile: tuple[int, int, int, int] | None = None,  # (BLOCK_N, BLOCK_K, warps, stages): the sweep's override
) -> torch.Tensor:  # [T, H]: sum over the local experts of weight * expert(x)
    t, topk = topk_ids.shape
    e = gate_up.shape[0]
    pairs = t * topk
    # decode batches spread a few pairs over each expert: a 64-row tile of two real rows multiplies 62 padding
    # rows, so 16-row tiles up to 16 pairs an expert on average (two sizes only: warmup compiles both)
    bm = 16 if pairs <= max(256, 16 * e) else 64
    local = topk_ids.reshape(-1) - start
    valid = (local >= 0) & (local < e)
    key = torch.where(valid, local, e)  # foreign experts sort last and get no tile
    order = torch.argsort(key, stable=True)  # [P] pair ids, grouped by expert
    counts = torch.zeros(e + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    seg_end = counts.cumsum(0)
    seg_start = seg_end - counts
    tiles = _tiles(counts[:e], seg_start, seg_end, pairs, bm)
    gu8, dn8 = fp8 if fp8 is not None else (None, None)
    h = _gemm(x, gate_up, order // topk, tiles, pairs, bm, fp8=gu8, tile=tile)  # [P, 2I] in sorted order
    gate, up = h.chunk(2, dim=-1)
    w_sorted = topk_w.reshape(-1)[order].to(x.dtype)  # [P] weight of each sorted pair
    # down GEMM weighted and written back in pair order; pairs of foreign experts get no tile and stay zero
    y = _gemm((F.silu(gate) * up).contiguous(), down, None, tiles, pairs, bm, (order, w_sorted), dn8,
              tile)  # [P, H]
    y = y.view(t, topk, y.shape[-1])
    return y if per_slot else y.sum(1)


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
    rows = torch.where(i < seg_end[-1], ex * m + i - seg_start[ex], 0)  # [bound] row of x.view(E*M, H)
    tiles = _tiles(counts, seg_start, seg_end, bound, bm)
    flat = x.reshape(e * m, h)
    gu8, dn8 = fp8 if fp8 is not None else (None, None)
    hid = _gemm(flat, gate_up, rows, tiles, bound, bm, fp8=gu8)  # [bound, 2I] in compact order
    gate, up = hid.chunk(2, dim=-1)
    ones = torch.ones(bound, dtype=x.dtype, device=x.device)
    # down GEMM stored straight into each row's place in the expert-major layout (zeroed: padding rows stay zero)
    y = _gemm((F.silu(gate) * up).contiguous(), down, None, tiles, e * m, bm, (rows, ones), dn8)  # [E*M, H]
    return y.view(e, m, h)
