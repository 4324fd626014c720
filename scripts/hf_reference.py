"""Reference MTP head assembled from transformers' own Qwen3.5-MoE modules (used to train the bundled model and
as the reference that tests hold our MTP head to). Parameter names match `mtp.*` in Qwen3.5 checkpoints."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeTextRotaryEmbedding,
)


class HFMTPHead(nn.Module):
    """Reference MTP head from transformers' modules; names match `mtp.*` in Qwen3.5 checkpoints."""

    def __init__(self, cfg: Qwen3_5MoeTextConfig):
        super().__init__()
        lcfg = Qwen3_5MoeTextConfig(**{**cfg.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps)
        n = max(1, getattr(cfg, "mtp_num_hidden_layers", 1) or 1)  # draft step j runs layer j mod n
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(lcfg, 0) for _ in range(n)])
        self.norm = Qwen3_5MoeRMSNorm(h, eps)
        self.rotary = Qwen3_5MoeTextRotaryEmbedding(lcfg)
        for _name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=cfg.initializer_range)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, step: int = 0) -> torch.Tensor:
        # emb, hidden: [B, T, H]; positions: [B, T]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos_sin = self.rotary(x, positions[None].expand(3, -1, -1))
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)[None, None]
        x = self.layers[step % len(self.layers)](x, position_embeddings=cos_sin, attention_mask=mask)
        return self.norm(x)
