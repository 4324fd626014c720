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
