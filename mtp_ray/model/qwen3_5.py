"""Qwen3.5-MoE text model over flat token batches: hybrid Gated DeltaNet / gated attention layers, sparse MoE,
zero-centred norms, an optional MTP head (model/mtp.py) that shares the embedding and lm_head."""

from __future__ import annotations

import torch
from torch import nn

from mtp_ray.config.model import ModelConfig
from mtp_ray.layers.attention import GatedAttention
from mtp_ray.layers.context import ForwardBatch
from mtp_ray.layers.gated_delta import GatedDeltaNet
from mtp_ray.layers.moe import ExpertDispatcher, local_dispatch
from mtp_ray.layers.norm import RMSNorm
from mtp_ray.model.decoder import DecoderLayer
from mtp_ray.model.mtp import MTPHead


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_range: tuple[int, int] | None, dispatch: ExpertDispatcher):
        super().__init__()
        # an empty weight: the checkpoint or init_dummy_weights fills it. Embedding's own N(0, 1) draw on the meta
        # device (the loader builds there) goes through torch._refs, whose import of torch._dynamo cost every rank
        # process 1.4-1.6 CPU-s at start, for values that are never used.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))  # [V, H]
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, t, i in cfg.dense_layers, expert_range, dispatch) for i, t in enumerate(cfg.layer_types)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, H]
        for layer in self.layers:
            x, residual = layer(x, positions, batch, residual)
        return self.norm.add_forward(x, residual)[0]  # [T, H], the hidden state the MTP head consumes


class Qwen3_5MoeForCausalLM(nn.Module):
    """Target model (+ MTP head when with_mtp). Parameter names equal the HF checkpoint names."""

    def __init__(self, cfg: ModelConfig, expert_range: tuple[int, int] | None = None, with_mtp: bool = True,
                 dispatch: ExpertDispatcher = local_dispatch):
        super().__init__()
        self.config = cfg
        self.expert_range = expert_range or (0, cfg.num_experts)
        self.model = TextModel(cfg, expert_range, dispatch)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = MTPHead(cfg, expert_range, dispatch) if with_mtp and cfg.mtp_num_hidden_layers > 0 else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, H]."""
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] fp32 (into out when given: an exact cast either way)
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    def draft_logits(self, hidden: torch.Tensor, vocab: int = 0) -> torch.Tensor:
        """hidden: [N, H] MTP hidden -> [N, vocab or V] logits in the model dtype over token ids [0, vocab): a
        prefix of the lm_head, a view (weight updates and sleep need nothing more)."""
        w = self.lm_head.weight
        return torch.nn.functional.linear(hidden, w[:vocab] if vocab else w)

    def mtp_forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    batch: ForwardBatch, step: int = 0) -> torch.Tensor:
        """One MTP draft forward. next_ids: [T] token after each position; hidden: [T, H] target (or previous MTP)
        hidden at that position -> MTP hidden [T, H] (final-normed; logits via compute_logits)."""
        assert self.mtp is not None, "model was built without its MTP head"
        return self.mtp(self.model.embed_tokens(next_ids), hidden, positions, batch, step)

    def attention_layers(self) -> list[GatedAttention]:
        layers = [m for m in self.model.modules() if isinstance(m, GatedAttention)]
        return layers + (self.mtp.attention_layers() if self.mtp is not None else [])

    def gdn_layers(self) -> list[GatedDeltaNet]:
        """Found once (a prefill step that takes or restores a prefix-cache snapshot copies every layer's states:
        walking the module tree each time cost ~0.2 ms a step at 4 layers)."""
        found = self.__dict__.get("_gdn_layers")
        if found is None:
            found = self.__dict__["_gdn_layers"] = [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]
        return found
