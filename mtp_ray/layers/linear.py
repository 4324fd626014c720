"""Linear layers: nn.Linear (same parameter names) with a bandwidth-bound Triton GEMV for a few rows on the GPU,
and FusedProjections, one weight buffer behind several projections of the same input.

At decode batch sizes a projection multiplies a handful of rows by a large weight: the step is bound by reading
the weight once. cuBLAS picks tile shapes for large M; the GEMV reads the weight with many programs and deep
pipelining instead. Rows <= GEMV_ROWS, no bias, same dtype: the Triton path; anything else: F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GEMV_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= GEMV_ROWS and bias is None and x.dtype == weight.dtype:
        from mtp_ray.layers.triton.linear import gemv

        return gemv(x, weight)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class FusedProjections:
    """Several bias-free projections of one input as one GEMM: their weights become row ranges of one buffer
    (the parameters stay, as views, so checkpoints and weight updates still address them by name).

    `fuse()` runs after loading and after every wake_up (sleep moves or re-allocates the parameters, which
    breaks the views); `__call__` falls back to one GEMM per projection whenever the views are broken."""

    def __init__(self, *layers: nn.Linear):
        assert all(lin.bias is None for lin in layers)
        self.layers = layers
        self.buffer: torch.Tensor | None = None
        self.ptrs: tuple[int, ...] = ()

    def fuse(self) -> None:
        ws = [lin.weight for lin in self.layers]
        if any(w.numel() == 0 for w in ws) or len({(w.device, w.dtype) for w in ws}) != 1:
            return  # dropped (sleep level 2) or mixed: stay unfused
        self.buffer = torch.cat([w.detach() for w in ws])  # [sum N, K]
        at = 0
        for w in ws:
            w.data = self.buffer[at : at + w.shape[0]]
            at += w.shape[0]
        self.ptrs = tuple(w.data_ptr() for w in ws)

    @property
    def fused(self) -> bool:
        return self.buffer is not None and tuple(lin.weight.data_ptr() for lin in self.layers) == self.ptrs

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: [T, K] -> one [T, N_i] output per projection (column slices of one GEMM output when fused)."""
        if not self.fused:
            return [lin(x) for lin in self.layers]
        return list(linear(x, self.buffer).split([lin.weight.shape[0] for lin in self.layers], dim=-1))

    def unfuse(self) -> None:
        """Let go of the buffer (sleep): the parameters keep their views of it only until sleep moves or drops them,
        so the buffer's memory goes with them instead of staying referenced here."""
        self.buffer, self.ptrs = None, ()


def _fused(model: nn.Module) -> list[FusedProjections]:
    return [f for m in model.modules() for f in vars(m).values() if isinstance(f, FusedProjections)]


def fuse_projections(model: nn.Module) -> None:
    """Fuse every FusedProjections of the model (GDN in_proj_*, attention q/k/v): after loading, after wake_up."""
    for f in _fused(model):
        f.fuse()


def unfuse_projections(model: nn.Module) -> None:
    """Every FusedProjections lets go of its buffer: before sleep moves (level 1) or drops (level 2) the weights,
    or the fused copies would stay on the device (~1.9 GB per rank at the Qwen3.5-35B-A3B shapes)."""
    for f in _fused(model):
        f.unfuse()
