"""Device memory for the model's caches: paged KV per full-attention layer (target and MTP) and GDN state slots.

Block 0 and state slot 0 are reserved: dummy and padded rows point there and their writes are discarded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_ray.model.qwen3_5 import Qwen3_5MoeForCausalLM


@dataclass(frozen=True)
class CacheShape:
    num_blocks: int  # incl. the reserved dummy block 0
    block_size: int
    num_state_slots: int  # incl. the reserved null slot 0


def bind_caches(model: Qwen3_5MoeForCausalLM, shape: CacheShape, dtype: torch.dtype, device: torch.device | str
                ) -> int:
    """Allocate every cache tensor and hand it to its layer; returns the bytes allocated."""
    cfg = model.config
    total = 0
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(2, shape.num_blocks, shape.block_size, cfg.num_key_value_heads, cfg.head_dim,
                                    dtype=dtype, device=device)
        total += attn.kv_cache.numel() * attn.kv_cache.element_size()
    for gdn in model.gdn_layers():
        gdn.conv_state = torch.zeros(shape.num_state_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1,
                                     dtype=dtype, device=device)
        # the recurrence is accumulated in fp32 whatever the model dtype
        gdn.ssm_state = torch.zeros(shape.num_state_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                    cfg.linear_value_head_dim, dtype=torch.float32, device=device)
        total += sum(t.numel() * t.element_size() for t in (gdn.conv_state, gdn.ssm_state))
    return total


def free_caches(model: Qwen3_5MoeForCausalLM) -> None:
    for attn in model.attention_layers():
        attn.kv_cache = None
    for gdn in model.gdn_layers():
        gdn.conv_state = gdn.ssm_state = None
