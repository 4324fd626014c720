"""Fused RMSNorm kernels in Triton (GPU): one launch per norm instead of ~8 elementwise kernels.

Each program normalises one row. The roundings follow the PyTorch modules in norm.py (fp32 math, one cast at
the end; the residual sum rounded to the input dtype before it is normalised, as `x + h` does), so the fused
path differs from the eager one only in the order of the fp32 reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp_ray.layers.triton import pdl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, stride_x, stride_r, stride_o, stride_s, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n_cols
    x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0)
    if HAS_RES:  # s = x + res, rounded to the input dtype, is both the new residual stream and the norm's input
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + c, mask=m, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + c, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (xf * rstd * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zero-centred RMSNorm over the last dim. x: [..., D]. With residual: s = x + residual, returns (norm(s), s);
    without: (norm(x), None)."""
    shape, d = x.shape, x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    s = None
    if residual is not None:
        r2 = residual.reshape(-1, d)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        s = torch.empty_like(out)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2 if s is not None else x2, weight, out, s if s is not None else out, d,
        x2.stride(0), r2.stride(0) if s is not None else 0, out.stride(0), out.stride(0), eps,
        HAS_RES=s is not None, BLOCK=triton.next_power_of_2(d), num_warps=4 if d >= 1024 else 1,
        **pdl.launch_args(x.device),
    )
    return out.view(shape), (s.view(shape) if s is not None else None)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_gt, stride_gh, heads, stride_o,
                           eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g_row = (row // heads) * stride_gt + (row % heads) * stride_gh  # the gate may be a strided [T, heads, D] view
    c = tl.arange(0, BLOCK)
    m = c < n_cols
    xf = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    dt = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + c, mask=m, other=0.0)
    # as GatedRMSNorm: the weight multiplies in the input dtype, the gate in fp32
    y = (w.to(tl.float32) * (xf * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    g = tl.load(g_ptr + g_row + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (y * g * tl.sigmoid(g)).to(dt), mask=m)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * rmsnorm(x) * silu(gate) over the last dim; x, gate: [..., D] (same shape) -> x.dtype."""
    shape, d = x.shape, x.shape[-1]
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    g3 = gate.reshape(-1, 1, d) if gate.dim() != 3 else gate  # [T, heads, D], possibly a strided view
    if g3.stride(-1) != 1:
        g3 = g3.contiguous()
    assert g3.shape[0] * g3.shape[1] == x2.shape[0]
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _gated_rms_norm_kernel[(x2.shape[0],)](x2, g3, weight, out, d, x2.stride(0), g3.stride(0), g3.stride(1),
                                           g3.shape[1], out.stride(0), eps, BLOCK=triton.next_power_of_2(d),
                                           num_warps=1, **pdl.launch_args(x.device))
    return out.view(shape)
