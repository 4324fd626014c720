"""Linear layers: nn.Linear (same parameter names) with a bandwidth-bound Triton GEMV for a few rows on the GPU,
and FusedProjections, one weight buffer behind several projections of the same input.

At decode batch sizes a projection multiplies a handful of rows by a large weight: the step is bound by reading
the weight once. cuBLAS picks tile shapes for large M; the GEMV reads the weight with many programs and deep
pipelining instead. Rows <= GEMV_ROWS, no bias, same dtype: the Triton path; anything else: F.linear.
A Linear may keep an FP8 weight (layers/fp8.py, `make_fp8`): on the GPU the GEMV's kernels read it as e4m3 with
its scales at any number of rows (past 16 in M tiles); on the CPU it is dequantized before F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_ray.layers.fp8 import E4M3, Fp8Block, Fp8Weight, dequantize, scale_shape

GEMV_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fp8: Fp8Weight | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias); fp8: weight is e4m3 with these scales."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= GEMV_ROWS and bias is None and \
            (x.dtype == weight.dtype or fp8 is not None):
        from mtp_ray.layers.triton.linear import gemv

        return gemv(x, weight, fp8=fp8)
    if fp8 is not None and x.is_cuda and bias is None:  # more rows: e4m3 still read as such, in M tiles
        from mtp_ray.layers.triton.linear import gemv

        return gemv(x.reshape(-1, x.shape[-1]), weight, fp8=fp8).view(*x.shape[:-1], weight.shape[0])
    if fp8 is not None:  # the CPU: the loader's dequantized values, so outputs equal the dequantized checkpoint's
        weight = dequantize(weight, fp8, x.dtype)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameter names); after make_fp8 the weight is e4m3 with `weight_scale_inv` beside it."""

    fp8_block: Fp8Block | None = None

    def make_fp8(self, block: Fp8Block) -> None:
        """Keep the weight in FP8 (before it is filled: the loader copies a checkpoint's e4m3 tensor and scales in,
        or quantizes a bf16 / fp32 one)."""
        assert self.bias is None, "FP8 weights: bias-free projections only"
        w = self.weight
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=E4M3, device=w.device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape(w.shape, block), device=w.device),
                                             requires_grad=False)
        self.fp8_block = block

    @property
    def fp8(self) -> Fp8Weight | None:
        return Fp8Weight(self.weight_scale_inv, self.fp8_block) if self.fp8_block is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fp8)


class FusedProjections:
    """Several bias-free projections of one input as one GEMM: their weights become row ranges of one buffer
    (the parameters stay, as views, so checkpoints and weight updates still address them by name).

    `fuse()` runs after loading and after every wake_up (sleep moves or re-allocates the parameters, which
    breaks the views); `__call__` falls back to one GEMM per projection whenever the views are broken. FP8
    projections with one block fuse too, their scales stacked the same way; a projection whose rows are not a
    whole number of scale blocks is followed by zero rows up to the next block (their outputs are dropped), so
    every projection's scale rows stay its own and a GEMV program's rows share one scale row block."""

    def __init__(self, *layers: Linear):
        assert all(lin.bias is None for lin in layers)
        self.layers = layers
        self.buffer: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None  # FP8: the stacked weight_scale_inv
        self.ptrs: tuple[int, ...] = ()
        self.pads: tuple[int, ...] = ()  # FP8: zero rows after each projection (to a whole scale block)

    def _params(self) -> list[torch.Tensor]:
        return [p for lin in self.layers for p in ((lin.weight, lin.weight_scale_inv) if lin.fp8 else (lin.weight,))]

    def fuse(self) -> None:
        ws = [lin.weight for lin in self.layers]
        if any(w.numel() == 0 for w in ws) or len({(w.device, w.dtype) for w in ws}) != 1:
            return  # dropped (sleep level 2) or mixed: stay unfused
        block = self.layers[0].fp8_block
        if any(lin.fp8_block != block for lin in self.layers):
            return  # FP8 and not, or different blocks: stay unfused
        self.pads = tuple(-w.shape[0] % block.rows if block is not None else 0 for w in ws[:-1]) + (0,)
        self.buffer = self._stack(ws, self.pads)  # [sum N + pads, K]
        if block is not None:  # [sum ceil(N / rows), K / cols]: each projection starts on a block boundary
            self.scales = self._stack([lin.weight_scale_inv for lin in self.layers], (0,) * len(ws))
        self.ptrs = tuple(p.data_ptr() for p in self._params())

    @staticmethod
    def _stack(ps: list[torch.Tensor], pads: tuple[int, ...]) -> torch.Tensor:
        """One buffer of the parameters' rows, each followed by its pad of zero rows; each parameter becomes a
        view of its rows."""
        parts = [t for p, pad in zip(ps, pads) for t in (p.detach(), p.new_zeros(pad, *p.shape[1:]))]
        buf = torch.cat(parts)
        at = 0
        for p, pad in zip(ps, pads):
            p.data = buf[at : at + p.shape[0]]
            at += p.shape[0] + pad
        return buf

    @property
    def fused(self) -> bool:
        return self.buffer is not None and tuple(p.data_ptr() for p in self._params()) == self.ptrs

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: [T, K] -> one [T, N_i] output per projection (column slices of one GEMM output when fused)."""
        if not self.fused:
            return [lin(x) for lin in self.layers]
        block = self.layers[0].fp8_block
        fp8 = Fp8Weight(self.scales, block) if block is not None else None
        sizes = [n for lin, pad in zip(self.layers, self.pads) for n in (lin.weight.shape[0], pad)]
        return list(linear(x, self.buffer, fp8=fp8).split(sizes, dim=-1))[::2]  # (the pads' outputs dropped)

    def unfuse(self) -> None:
        """Let go of the buffers (sleep): the parameters keep their views of them only until sleep moves or drops
        them, so the buffers' memory goes with them instead of staying referenced here."""
        self.buffer, self.scales, self.ptrs, self.pads = None, None, (), ()


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
