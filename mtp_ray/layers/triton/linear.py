"""Skinny GEMM in Triton (GPU): y[M, N] = x[M, K] @ W[N, K].T for M <= 16 rows, fp32 accumulation, one rounding.

Both kernels stream the weight once with many programs in flight (the step is bound by reading it):
- `_gemv_kernel`: one program per BN output columns walks K with pipelined tensor-core dots (rows padded to 16).
- `_gemv_row_kernel`: one row (M = 1, half precision), no dot: a program owns only BN (2..16) columns, so a
  small N still spreads over enough programs to fill the GPU (tl.dot needs BN >= 16).
Tile choices come from the sweep in bench/kernels.py on an H200 (`tiles`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    nm, mm = n < N, m < M
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None], mask=km[:, None] & nm[None, :],
                    other=0.0)  # [BK, BN]
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BN: tl.constexpr, BK: tl.constexpr,
                     K_TILES: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    acc = tl.zeros([BN, BK], tl.float32)  # lane-wise partial sums, reduced once at the end
    for i in tl.static_range(K_TILES):  # unrolled: every tile's weight load in flight at once (no pipeliner here)
        kk = i * BK + tl.arange(0, BK)
        km = kk < K
        x = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0)  # [BN, BK]
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=nm)


def tiles(m: int, n: int, k: int, fp32: bool) -> tuple[str, int, int, int, int]:
    """(kernel, BN, BK, num_warps, num_stages) for an [m, k] x [n, k] product."""
    if fp32:  # tests and fp32 runs: the IEEE dot path, small tiles (shared memory)
        return "dot", 16 if n <= 4096 else 32, 128, 4, 4
    if m == 1 and n * k <= 20 * 2**20:  # up to ~40 MB of bf16 weight: two columns a program win (H200 sweep)
        return "row", 2, min(1024, triton.next_power_of_2(k)), 4, 1
    if n > 4096:
        return "dot", 32, 128, 4, 4
    return "dot", 16 if n <= 2048 else 32, 512, 4, 3


def gemv(x: torch.Tensor, weight: torch.Tensor, tile: tuple[str, int, int, int, int] | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 16); weight: [N, K] -> [M, N] in x.dtype. `tile` overrides `tiles` (the sweep)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= 16 and weight.shape[1] == k
    x = x if x.stride(1) == 1 else x.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    kind, bn, bk, warps, stages = tile or tiles(m, n, k, ieee)
    if kind == "row":
        assert m == 1 and not ieee
        _gemv_row_kernel[(triton.cdiv(n, bn),)](x, w, y, n, k, w.stride(0), BN=bn, BK=bk, K_TILES=triton.cdiv(k, bk),
                                                num_warps=warps, num_stages=stages)
    else:
        _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                            BM=16, BN=bn, BK=bk, IEEE=ieee, num_warps=warps, num_stages=stages)
    return y
