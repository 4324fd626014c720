"""Roofline arithmetic for bench/decode.py: the device's copy bandwidth, and the bytes a decode / verify step and the
MTP draft loop must move at least (every weight they read once, the routed experts actually hit, KV, GDN state,
logits)."""

from __future__ import annotations

import torch

from mtp_ray.config.model import ModelConfig
from mtp_ray.layers.moe import Experts
from mtp_ray.model.qwen3_5 import Qwen3_5MoeForCausalLM


def bandwidth(device: torch.device) -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write), median of 10."""
    a = torch.empty(1 << 30, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() * 4 / sorted(times[2:])[len(times[2:]) // 2]


def _expert_bytes(model: Qwen3_5MoeForCausalLM) -> int:
    """One routed expert's weight bytes (gate, up, down; FP8: with its scales)."""
    ex = next(m for m in model.modules() if isinstance(m, Experts))
    return sum(p[0].numel() * p.element_size() for p in ex.parameters())


def step_bytes(model: Qwen3_5MoeForCausalLM, cfg: ModelConfig, bsz: int, context: int, experts_hit: list[int],
               q: int = 1) -> dict:
    """A target step of bsz x q tokens (q > 1: a verify, which reads each GDN state once and writes q snapshots)."""
    expert_bytes = _expert_bytes(model)
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()  # the target reads no MTP weight
                if "experts." not in n and "embed_tokens" not in n and not n.startswith("mtp."))
    n_attn, n_gdn = len(cfg.full_attention_layers), cfg.num_hidden_layers - len(cfg.full_attention_layers)
    kv = n_attn * bsz * (context + q) * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    state = n_gdn * bsz * (1 + q) * (cfg.linear_num_value_heads * cfg.linear_key_head_dim
                                     * cfg.linear_value_head_dim * 4
                                     + cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * 2)
    parts = {"dense_weights": dense, "routed_experts": sum(experts_hit) * expert_bytes,
             "embedding_rows": bsz * q * cfg.hidden_size * 2, "kv_read": kv, "gdn_state_rw": state,
             "logits_written": bsz * q * cfg.vocab_size * 4}
    parts["total"] = sum(parts.values())
    return parts


def draft_bytes(model: Qwen3_5MoeForCausalLM, cfg: ModelConfig, bsz: int, context: int, k: int,
                experts_hit: list[int], vocab: int) -> dict:
    """The k-step draft loop: per step the MTP layer's dense weights, the lm_head rows of the draft vocabulary
    (shared, bf16 logits of the last row per sequence), the MTP KV; the routed experts its k MoE calls hit."""
    expert_bytes = _expert_bytes(model)
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n.startswith("mtp.") and "experts." not in n)
    kv = bsz * (context + 2 * k) * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    parts = {"mtp_dense_weights": k * dense, "lm_head": k * vocab * cfg.hidden_size * 2,
             "routed_experts": sum(experts_hit) * expert_bytes, "kv_read": k * kv,
             "logits_written": k * bsz * vocab * 2}
    parts["total"] = sum(parts.values())
    return parts
