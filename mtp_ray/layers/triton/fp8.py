"""FP8-resident weights inside the Triton kernels (layers/fp8.py).

Three ways to apply the block scales, cheapest first:
- GEMV kernels whose program's weight rows all lie in one scale row block (the block's rows a multiple of the
  program's, block columns a power of two): the input vector is scaled instead (one gather of
  BK scales per tile, not BN x BK), so the weight tile is read as plain e4m3.
- dot kernels with power-of-two scale blocks (`fp8_tile`): a K tile is cut into sub-tiles of one scale block
  each, whose dot products are scaled per output column (the tile keeps its width: capping it at the block's 128
  columns left an FP8 program 1/8 of the bf16 tile's bytes in flight). The one-row GEMV whose rows span several
  row blocks (blocks of fewer rows than a program's, e.g. one scale row per weight row) scales each sub-tile's
  rows likewise.
- otherwise each element's scale is gathered (`dequant`: correct for any block, slow; tests use such blocks).
Products are formed in fp32 from the exact e4m3 values, so they follow the real FP8 weights rather than a bf16
rounding of them: within rounding of the dequantized checkpoint's results, not bitwise (the CPU path is: it
dequantizes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp_ray.layers.fp8 import Fp8Weight


@triton.jit
def block_scales(s_ptr, rows, cols, mask, stride_sn, SN: tl.constexpr, SK: tl.constexpr):
    """fp32 scales of weight rows `rows` at columns `cols` (broadcast together: a row vector at one column, one
    row at a column vector, or a tile's rows x columns)."""
    return tl.load(s_ptr + (rows // SN).to(tl.int64) * stride_sn + cols // SK, mask=mask, other=0.0)


@triton.jit
def dequant(w, s_ptr, rows, cols, mask, stride_sn, SN: tl.constexpr, SK: tl.constexpr):
    """fp32 float(q) * scale[rows // SN, cols // SK] for a loaded e4m3 tile (rows, cols broadcastable to it)."""
    return w.to(tl.float32) * block_scales(s_ptr, rows, cols, mask, stride_sn, SN, SK)


@triton.jit
def scaled_dot(x, w, s_ptr, cols, k0, kk, nm, wm, stride_sn, IEEE: tl.constexpr, FP8: tl.constexpr,
               TILE_SCALE: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr):
    """fp32 x [BM, BK] @ w [BK, BN] for a dot kernel's (sub-)tile at K offset k0 (kk: its K indices; cols: the
    output columns = weight rows). FP8: w is e4m3, scaled per output column when the tile lies in one scale block
    (TILE_SCALE), else per element."""
    if FP8 and not TILE_SCALE:
        w = dequant(w, s_ptr, cols[None, :], kk[:, None], wm, stride_sn, SN, SK)
    if FP8:
        w = w.to(x.dtype)  # e4m3 is exact in bf16 / fp32
    if IEEE:
        part = tl.dot(x, w, input_precision="ieee")
    else:
        part = tl.dot(x, w)
    if TILE_SCALE:
        part = part * block_scales(s_ptr, cols, k0, nm, stride_sn, SN, SK)[None, :]
    return part


def scale_args(w: torch.Tensor, fp8: Fp8Weight | None) -> tuple[torch.Tensor, int, int, int, int]:
    """(scales, expert stride, row stride, rows, cols) for a kernel: fp32 stand-ins when not FP8 (never read).
    Scales are [..., N / rows, K / cols] with unit column stride."""
    if fp8 is None:
        return torch.empty(1, dtype=torch.float32, device=w.device), 0, 0, 1, 1
    s = fp8.scale
    assert s.dtype == torch.float32 and s.stride(-1) == 1, "FP8 scales: fp32, contiguous rows"
    return s, (s.stride(0) if s.dim() == 3 else 0), s.stride(-2), fp8.block.rows, fp8.block.cols


def fp8_tile(bk: int, cols: int) -> tuple[int, int, bool]:
    """(tile width, sub-tiles per tile, TILE_SCALE) for an FP8 weight with `cols`-wide scale blocks, given the
    wanted tile width bk (a power of two): sub-tiles of one scale block each when cols is a power of two."""
    if cols & (cols - 1) == 0:
        return bk, max(1, bk // cols), True
    return bk, 1, False


def rows_in_block(bn: int, rows: int, cols: int) -> bool:
    """Whether a GEMV program of bn weight rows can scale its input instead (see the module docstring)."""
    return rows % bn == 0 and cols & (cols - 1) == 0
