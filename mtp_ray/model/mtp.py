"""Qwen3.5 MTP head: x = fc([norm_e(embed(next token)), norm_h(hidden)]) -> one full-attention MoE decoder layer
(its own KV cache) -> norm. Logits come from the target's shared lm_head. Checkpoint names live under `mtp.`."""

from __future__ import annotations

import torch
from torch import nn

from mtp_ray.config.model import ModelConfig
from mtp_ray.layers.attention import GatedAttention
from mtp_ray.layers.context import ForwardBatch
from mtp_ray.layers.linear import Linear
from mtp_ray.layers.moe import ExpertDispatcher
from mtp_ray.layers.norm import RMSNorm
from mtp_ray.model.decoder import DecoderLayer


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_range: tuple[int, int] | None, dispatch: ExpertDispatcher):
        super().__init__()
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, "full_attention", False, expert_range, dispatch) for _ in range(cfg.mtp_num_hidden_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                step: int = 0) -> torch.Tensor:
        # emb, hidden: [T, H]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        # with several MTP layers, draft step j uses layer j mod n (one layer: every step reuses it)
        x, residual = self.layers[step % len(self.layers)](x, positions, batch)
        return self.norm.add_forward(x, residual)[0]

    def attention_layers(self) -> list[GatedAttention]:
        return [layer.self_attn for layer in self.layers]
