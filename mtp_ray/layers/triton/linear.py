"""Skinny GEMM in Triton (GPU): y[M, N] = x[M, K] @ W[N, K].T for M <= 16 rows (any M for an FP8 weight), fp32
accumulation, one rounding.

Both kernels stream the weight once with many programs in flight (the step is bound by reading it):
- `_gemv_kernel`: one program per BN output columns (and BM rows) walks K with pipelined tensor-core dots (rows
  padded to 16). Past 16 rows only FP8 weights come here (bf16 ones take cuBLAS): the M tiles of one N tile are
  neighbours in the grid, so the weight tile they share is read from memory once and from L2 after. A narrow
  weight splits K over SPLIT programs a tile (more loads in flight); their fp32 partials are summed by the tile's
  last program to arrive, always in split order, so results do not depend on timing (no float atomics).
- `_gemv_row_kernel`: one row (M = 1, half precision), no dot: a program owns only BN (2..16) columns, so a
  small N still spreads over enough programs to fill the GPU (tl.dot needs BN >= 16).
Tile choices come from the sweep in bench/kernels.py on an H200 (`tiles`). An FP8-resident weight (e4m3 + block
scales) is read as e4m3 and scaled as triton/fp8.py describes (the one-row kernel scales its input).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp_ray.layers.fp8 import Fp8Weight
from mtp_ray.layers.triton import pdl
from mtp_ray.layers.triton.fp8 import block_scales, dequant, fp8_tile, rows_in_block, scale_args, scaled_dot


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 stride_sn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr,
                 IEEE: tl.constexpr, FP8: tl.constexpr, TILE_SCALE: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                 KP: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    nm, mm = n < N, m < M
    k_lo, span = 0, K
    if SPLIT > 1:  # split-K: this program's K range, whole BK tiles (the loop below keeps its 0 start)
        span = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
        k_lo = tl.program_id(2) * span
    if PDL:  # this program's weight columns into L2 while the kernel before ends (the first M tile's only)
        if tl.program_id(0) == 0:
            pdl.prefetch_rows(w_ptr + k_lo, n, nm, stride_wn, tl.minimum(span, K - k_lo), KP)
    pdl.enter(PDL)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, span, BK):
        for j in tl.static_range(SUB):  # FP8: sub-tiles of one scale block each (SUB = 1 otherwise)
            kk = k_lo + k0 + j * (BK // SUB) + tl.arange(0, BK // SUB)
            km = kk < K
            x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + kk[None, :], mask=mm[:, None] & km[None, :],
                        other=0.0)
            wm = km[:, None] & nm[None, :]
            w = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None], mask=wm, other=0.0)  # [BK/SUB, BN]
            acc += scaled_dot(x, w, s_ptr, n, k_lo + k0 + j * (BK // SUB), kk, nm, wm, stride_sn, IEEE, FP8,
                              TILE_SCALE, SN, SK)
    ym = mm[:, None] & nm[None, :]
    if SPLIT > 1:  # fp32 partial out; the tile's last program to arrive sums all SPLIT in split order
        tile_ofs = m[:, None] * N + n[None, :]  # partials: [SPLIT, M, N]
        tl.store(part_ptr + tl.program_id(2) * M * N + tile_ofs, acc, mask=ym)
        count = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(count, 1, sem="acq_rel") == SPLIT - 1:  # the others' partials are visible now
            acc = tl.zeros([BM, BN], tl.float32)
            for s in range(SPLIT):  # the same order whoever arrives last: deterministic
                acc += tl.load(part_ptr + s * M * N + tile_ofs, mask=ym, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=ym)
            tl.store(count, 0)  # ready for the next launch (every launch leaves its counters at zero)
    else:
        tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ym)


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn, BN: tl.constexpr, BK: tl.constexpr,
                     K_TILES: tl.constexpr, SUB: tl.constexpr, FP8: tl.constexpr, TILE_SCALE: tl.constexpr,
                     ROW_SCALE: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr, KP: tl.constexpr,
                     PDL: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    if PDL:  # this program's weight rows into L2 while the kernel before ends
        pdl.prefetch_rows(w_ptr, n, nm, stride_wn, K, KP)
    pdl.enter(PDL)
    acc = tl.zeros([BN, BK // SUB], tl.float32)  # lane-wise partial sums, reduced once at the end
    for i in tl.static_range(K_TILES):  # unrolled: every tile's weight load in flight at once (no pipeliner here)
        for j in tl.static_range(SUB):  # ROW_SCALE: sub-tiles of one scale block each (SUB = 1 otherwise)
            k0 = i * BK + j * (BK // SUB)
            kk = k0 + tl.arange(0, BK // SUB)
            km = kk < K
            x = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
            if TILE_SCALE:  # every row of this program in one scale row block: scale the input
                x = x * block_scales(s_ptr, tl.program_id(0) * BN, kk, km, stride_sn, SN, SK)
            wm = nm[:, None] & km[None, :]
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=wm, other=0.0)  # [BN, BK/SUB]
            if ROW_SCALE:  # rows in several scale row blocks: one scale per row for the sub-tile
                w = w.to(tl.float32) * block_scales(s_ptr, n, k0, nm, stride_sn, SN, SK)[:, None]
            elif FP8 and not TILE_SCALE:
                w = dequant(w, s_ptr, n[:, None], kk[None, :], wm, stride_sn, SN, SK)
            acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=nm)


Tile = tuple[str, int, int, int, int, int]  # (kernel, BN, BK, num_warps, num_stages, split-K)


def tiles(m: int, n: int, k: int, fp32: bool, fp8: bool = False) -> Tile:
    """(kernel, BN, BK, num_warps, num_stages, SPLIT) for an [m, k] x [n, k] product (bench/kernels.py sweeps on
    an H200). FP8 weights (one byte an element): the one-row kernel takes twice the bf16 rows a program (the same
    bytes in flight), also past 40 MB of bf16 weight; past 16 rows dot tiles of up to 64 rows (bench/kernels.py
    --fp8). Split-K (`bench/kernels.py --split`): 2-16 rows of a narrow bf16 weight (the router, 256 x 2048) ran
    16 programs (16 columns each); 8 tiles of 32 columns x 8 K parts take 3.0-3.4 us instead of 4.1-4.6 (with /
    without PDL). No wider shape's split or tile gained both ways (kernels_h200_split*.json)."""
    if fp32:  # tests and fp32 runs: the IEEE dot path, small tiles (shared memory)
        return "dot", 16 if n <= 4096 else 32, 128, 4, 4, 1
    if fp8 and m == 1:  # larger weights: 8 x 2048 (the fused GDN input: 9.1 us against 12.5 on the dot kernel)
        big = n * k > 20 * 2**20
        return "row", 8 if big else 4, min(2048 if big else 1024, triton.next_power_of_2(k)), 4, 1, 1
    if fp8 and m > 16:  # 12352 x 2048 at 64 / 256 rows: 20.6 / 63.5 us (cuBLAS on bf16: 16.1 / 20.6)
        return "dot", 32 if m <= 64 else 64, 128, 4, 3, 1
    if m == 1 and n * k <= 20 * 2**20:  # up to ~40 MB of bf16 weight: two columns a program win (H200 sweep)
        return "row", 2, min(1024, triton.next_power_of_2(k)), 4, 1, 1
    if n <= 512 and k >= 1024 and not fp8:  # a narrow weight (the router): 8 programs a tile, K / 8 each
        return "dot", 32, 128, 4, 3, 8
    return ("dot", 32, 128, 4, 4, 1) if n > 4096 else ("dot", 16 if n <= 2048 else 32, 512, 4, 3, 1)


_COUNTS = 8192  # split-K tile counters per device (12352 columns / 16 a tile = 772 tiles at most, M <= 16)
_counter_bufs: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K kernels' arrival counters on `device`: zero between launches (each launch's last programs
    reset theirs), so one buffer serves every launch on the stream. Made once, zeroed (a capture that makes it
    records the zeroing too: harmless, the counters are zero there anyway)."""
    assert tiles <= _COUNTS, f"{tiles} split-K tiles > {_COUNTS}"
    buf = _counter_bufs.get(device)
    if buf is None:
        buf = _counter_bufs[device] = torch.zeros(_COUNTS, dtype=torch.int32, device=device)
    return buf


def gemv(x: torch.Tensor, weight: torch.Tensor, tile: Tile | None = None,
         fp8: Fp8Weight | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 16, or any M with `fp8`); weight: [N, K] (x's dtype, or e4m3 with `fp8`) -> [M, N] in
    x.dtype. `tile` overrides `tiles` (the sweep)."""
    m, k = x.shape
    n = weight.shape[0]
    assert (m <= 16 or fp8 is not None) and weight.shape[1] == k
    x = x if x.stride(1) == 1 else x.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert (fp8 is not None) == (w.dtype != x.dtype), "an FP8 weight needs its scales; others x's dtype"
    s, _, s_n, sn, sk = scale_args(w, fp8)
    ieee = x.dtype == torch.float32
    kind, bn, bk, warps, stages, split = tile or tiles(m, n, k, ieee, fp8 is not None)
    assert split == 1 or (kind == "dot" and m <= 16), "split-K: the dot kernel, one M tile"
    tile_scale, row_scale, sub = False, False, 1
    if fp8 is not None and kind == "row":
        tile_scale = rows_in_block(bn, sn, sk)
        if not tile_scale:  # rows of several scale row blocks: each sub-tile's rows scaled (power-of-two columns)
            _, sub, row_scale = fp8_tile(bk, sk)
    elif fp8 is not None:
        bk, sub, tile_scale = fp8_tile(bk, sk)
    # PDL prefetch: a program's rows, 2048 lines of 128 bytes at most (BN x KP; more would only cost registers, and
    # the 35B shapes need 32-64 lines a row)
    kw = dict(FP8=fp8 is not None, TILE_SCALE=tile_scale, SN=sn, SK=sk, num_warps=warps, num_stages=stages,
              KP=min(pdl.lines(k, w.dtype), max(1, 2048 // bn)), **pdl.launch_args(x.device))
    if kind == "row":
        assert m == 1 and not ieee
        _gemv_row_kernel[(triton.cdiv(n, bn),)](x, w, s, y, n, k, w.stride(0), s_n, BN=bn, BK=bk,
                                                K_TILES=triton.cdiv(k, bk), SUB=sub, ROW_SCALE=row_scale, **kw)
    else:
        bm = 16 if m <= 16 else min(64, triton.next_power_of_2(m))
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
        part, count = y, y  # never read without split
        if split > 1:
            part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)  # [SPLIT, M, N] fp32 partials
            count = _counters(x.device, grid[0] * grid[1])
        _gemv_kernel[grid](x, w, s, y, part, count, m, n, k, x.stride(0), w.stride(0), y.stride(0), s_n, BM=bm,
                           BN=bn, BK=bk, SUB=sub, IEEE=ieee, SPLIT=split, **kw)
    return y
