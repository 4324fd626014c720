"""FP8-resident weights (weight-only, W8A16): a weight kept as float8_e4m3fn [..., N, K] with fp32 scales, one per
(rows x cols) block [..., ceil(N / rows), ceil(K / cols)] (Qwen's published block format: the weight is q * scale),
dequantized where it is read. Half the bytes of bf16 for every step that reads it.

Exactness: the CPU path (`dequantize`) forms the weight as (float(q) * scale).to(dtype), the value the dequantizing
loader stores, so a model that keeps its FP8 weights computes exactly what the dequantized checkpoint computes;
the GPU kernels multiply the e4m3 values and scales in fp32 (layers/triton/fp8.py), within rounding of that.
Activations are not quantized.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3 value


class Fp8Block(NamedTuple):
    """Rows x cols of weight one scale covers (rows = 1: a scale row per weight row)."""

    rows: int
    cols: int


class Fp8Weight(NamedTuple):
    """What a kernel needs besides the e4m3 weight: its scales [..., ceil(N / rows), ceil(K / cols)] and block."""

    scale: torch.Tensor
    block: Fp8Block


def scale_shape(shape: tuple[int, ...] | list[int], block: Fp8Block) -> list[int]:
    """The scale tensor's shape for a weight of `shape` ([..., N, K])."""
    return [*shape[:-2], -(-shape[-2] // block.rows), -(-shape[-1] // block.cols)]


def expand(scale: torch.Tensor, shape: tuple[int, ...] | torch.Size, block: Fp8Block) -> torch.Tensor:
    """Block scales -> fp32 [..., N, K], one per weight element."""
    n, k = shape[-2:]
    s = scale.float().repeat_interleave(block.rows, -2)[..., :n, :]
    return s.repeat_interleave(block.cols, -1)[..., :k]


def dequantize(q: torch.Tensor, w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """q [..., N, K] e4m3 -> the weight in dtype, rounded once from fp32 (as the loader's dequantization)."""
    return (q.float() * expand(w.scale, q.shape, w.block)).to(dtype)


def quantize(w: torch.Tensor, block: Fp8Block) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q e4m3, scale fp32 [..., ceil(N / rows), ceil(K / cols)]): each block scaled so that its
    largest magnitude maps to e4m3's largest finite value (an RL update or random weights in bf16, kept in FP8)."""
    n, k = w.shape[-2:]
    rb, cb = -(-n // block.rows), -(-k // block.cols)
    padded = torch.zeros(*w.shape[:-2], rb * block.rows, cb * block.cols, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w
    blocks = padded.view(*w.shape[:-2], rb, block.rows, cb, block.cols)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / E4M3_MAX  # [..., rb, cb]
    q = (padded / expand(scale, padded.shape, block)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q[..., :n, :k].contiguous(), scale


def row_scales(scale: torch.Tensor, n: int, rows: int) -> torch.Tensor:
    """Scales of `rows`-row blocks [..., ceil(N / rows), C] -> one per weight row [..., N, C] (block (1, cols))."""
    return scale.repeat_interleave(rows, -2)[..., :n, :]
