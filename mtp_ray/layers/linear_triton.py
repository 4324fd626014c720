"""Skinny GEMM in Triton (GPU): y[M, N] = x[M, K] @ W[N, K].T for M <= 16 rows, fp32 accumulation, one rounding.

One program per BN output columns walks K with a pipelined loop of tensor-core dots (rows padded to 16): the
weight streams once from memory with enough loads in flight to approach the device bandwidth.
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


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K] (M <= 16); weight: [N, K] -> [M, N] in x.dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= 16 and weight.shape[1] == k
    x = x if x.stride(1) == 1 else x.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    bn = 16 if n <= 4096 else 32
    bk = 128 if ieee else 256
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                        BM=16, BN=bn, BK=bk, IEEE=ieee, num_warps=4, num_stages=4)
    return y
