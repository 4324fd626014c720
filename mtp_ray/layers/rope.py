"""Partial NeoX rotary embedding: the first `rotary_dim` channels of each head rotate, the rest pass through.

Qwen3.5's text path uses interleaved M-RoPE, which for text (all three position rows equal) is exactly this.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta
        # cos / sin of every position a sequence can reach ([P, rotary_dim] each, model dtype), set by the engine
        # (shared by all layers): the GPU prologue kernel reads its rows, so no per-forward cos / sin kernels
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None
        # a plain attribute, not a buffer: models are built on the meta device and then filled from checkpoints
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu") / rotary_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, rotary_dim]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]; cos/sin: [T, rotary_dim]
        rd = cos.shape[-1]
        rot, keep = x[..., :rd], x[..., rd:]
        c, s = cos[:, None, :], sin[:, None, :]
        half = rd // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * c + rotated * s, keep], dim=-1)


def bind_rope_tables(model: nn.Module, span: int, dtype: torch.dtype, device: torch.device) -> None:
    """One cos / sin table per (rotary_dim, theta) for positions [0, span), shared by every RotaryEmbedding of the
    model (computed as cos_sin computes them, so the values are the per-forward ones)."""
    tables: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}
    for r in model.modules():
        if isinstance(r, RotaryEmbedding):
            key = (r.rotary_dim, r.theta)
            if key not in tables:
                tables[key] = r.cos_sin(torch.arange(span, device=device), dtype)
            r.table = tables[key]
