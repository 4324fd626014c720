"""One decoder layer: token mixer (Gated DeltaNet or gated attention) + MoE (or dense MLP), pre-norm residuals."""

from __future__ import annotations

import torch
from torch import nn

from mtp_ray.config.model import ModelConfig
from mtp_ray.layers.attention import GatedAttention
from mtp_ray.layers.context import ForwardBatch
from mtp_ray.layers.gated_delta import GatedDeltaNet
from mtp_ray.layers.moe import MLP, ExpertDispatcher, SparseMoE
from mtp_ray.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, dense: bool, expert_range: tuple[int, int] | None,
                 dispatch: ExpertDispatcher):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if dense else SparseMoE(cfg, expert_range, dispatch)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried as (x, residual) with the stream = x + residual, so every residual add
        fuses into the norm after it (one kernel on the GPU). residual None: x is the stream itself.
        Returns (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, batch)
        else:
            h = self.self_attn(h, positions, batch)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual
