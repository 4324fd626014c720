"""Zero-centred RMSNorm (Qwen3.5 / Gemma style: weight stored as w, applied as 1 + w) and the gated RMSNorm
of the Gated DeltaNet output (weight applied as is)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from mtp_ray.layers.triton.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)[0]
        # normalise and scale in fp32, cast once at the end (matches the reference rounding in bf16)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s = x + residual (in x's dtype) -> (norm(s), s); one kernel on the GPU."""
        if x.is_cuda:
            from mtp_ray.layers.triton.norm import rms_norm

            out, s = rms_norm(x, self.weight, self.eps, residual)
            assert s is not None
            return out, s
        s = x + residual
        return self(s), s


class GatedRMSNorm(nn.Module):
    """out = w * rmsnorm(x) * silu(gate); the norm runs in fp32, the weight multiplies in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from mtp_ray.layers.triton.norm import gated_rms_norm

            return gated_rms_norm(x, gate, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)
