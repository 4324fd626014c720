"""Test helpers: random tiny HF checkpoints (trunk from transformers, MTP from transformers' modules) and a
minimal paged layout for driving the model directly."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeForCausalLM as HFQwen
from transformers import Qwen3_5MoeTextConfig

from mtp_ray.engine.cache import CacheShape, bind_caches
from mtp_ray.layers.context import ForwardBatch
from scripts.hf_reference import HFMTPHead

# Tiny random architectures: GQA ratios, full-attention intervals, H_v > H_k, expert counts / top-k differ.
CONFIGS = {
    "gqa2_int2": dict(hidden_size=32, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "gqa6_int3": dict(hidden_size=48, num_hidden_layers=3, full_attention_interval=3, num_attention_heads=6,
                      num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=3,
                      linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts=6,
                      num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=8,
                      partial_rotary_factor=0.5, tie_word_embeddings=True),
    "mha_types": dict(hidden_size=64, num_hidden_layers=5,
                      layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                   "linear_attention"], num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                      linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                      linear_value_head_dim=32, num_experts=8, num_experts_per_tok=1, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, rope_theta=1000.0),
    # shapes no power of two covers: head dims of 12, full rotary, H_v = 3 H_k, a 2-tap conv, 5 experts (top 3),
    # two MTP layers (draft step j runs layer j mod 2)
    "odd_mtp2": dict(hidden_size=40, num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                                       "linear_attention"],
                     num_attention_heads=3, num_key_value_heads=1, head_dim=12, linear_num_key_heads=1,
                     linear_num_value_heads=3, linear_key_head_dim=12, linear_value_head_dim=4,
                     linear_conv_kernel_dim=2, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=12,
                     shared_expert_intermediate_size=20, partial_rotary_factor=1.0, mtp_num_hidden_layers=2),
}


def hf_config(name: str, vocab: int = 97) -> Qwen3_5MoeTextConfig:
    kw = dict(CONFIGS[name])
    theta = kw.pop("rope_theta", 10000.0)
    partial = kw.pop("partial_rotary_factor", 0.25)
    return Qwen3_5MoeTextConfig(vocab_size=vocab, rms_norm_eps=1e-6, initializer_range=0.1,
                                rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                 "partial_rotary_factor": partial}, **kw)


def randomise(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere, norms included (so 1 + w and the gated norm's w are exercised)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 2.5, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)


def make_checkpoint(out: Path, name: str, seed: int = 0, mtp: bool = True, fused_experts: bool = False
                    ) -> tuple[HFQwen, HFMTPHead | None]:
    """Save a random transformers model (+ reference MTP head under mtp.*) as an HF checkpoint directory."""
    torch.manual_seed(seed)
    cfg = hf_config(name)
    model = HFQwen(cfg).eval()
    randomise(model, seed)
    model.save_pretrained(out)
    head = None
    if mtp:
        head = HFMTPHead(cfg).eval()
        randomise(head, seed + 1)
        sd = load_file(out / "model.safetensors")
        sd.update({f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()})
        save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    if fused_experts:
        fuse_experts(out)
    return model, head


def edit_checkpoint(src: Path, out: Path, tensors=None, config=None) -> Path:
    """A copy of a one-file checkpoint with `tensors(state_dict)` / `config(config_dict)` applied in place."""
    import json
    import shutil

    shutil.copytree(src, out)
    if tensors:
        sd = load_file(out / "model.safetensors")
        tensors(sd)
        save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def fuse_experts(ckpt: Path) -> None:
    """Rewrite per-expert tensors as fused experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I]."""
    sd = load_file(ckpt / "model.safetensors")
    prefixes = {k.split(".experts.")[0] for k in sd if ".experts." in k and k.split(".experts.")[1][0].isdigit()}
    for p in prefixes:
        ids = sorted({int(k.split(".experts.")[1].split(".")[0]) for k in sd if k.startswith(p + ".experts.")
                      and k.split(".experts.")[1][0].isdigit()})
        sd[f"{p}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd.pop(f"{p}.experts.{e}.gate_proj.weight"), sd.pop(f"{p}.experts.{e}.up_proj.weight")])
             for e in ids])
        sd[f"{p}.experts.down_proj"] = torch.stack([sd.pop(f"{p}.experts.{e}.down_proj.weight") for e in ids])
    save_file(sd, ckpt / "model.safetensors", metadata={"format": "pt"})


class PagedSeqs:
    """Gives each of n sequences its own contiguous KV blocks and state slot (0 stays reserved)."""

    def __init__(self, model, n: int, max_len: int, block_size: int = 4, dtype=torch.float32):
        self.bs = block_size
        self.per = (max_len + block_size - 1) // block_size
        bind_caches(model, CacheShape(1 + n * self.per, block_size, 1 + n), dtype, "cpu")
        self.tables = torch.tensor([[1 + b * self.per + j for j in range(self.per)] for b in range(n)])

    def batch(self, parts: list[tuple[int, int, int]]) -> ForwardBatch:
        """parts: (seq, context_len, new_tokens) in batch order."""
        slots = [int(self.tables[b, p // self.bs]) * self.bs + p % self.bs
                 for b, ctx, n in parts for p in range(ctx, ctx + n)]
        return ForwardBatch(
            query_lens=[n for _, _, n in parts], context_lens=[c for _, c, _ in parts],
            block_tables=self.tables[[b for b, _, _ in parts]], slot_mapping=torch.tensor(slots),
            state_slots=[b + 1 for b, _, _ in parts])


def positions_for(parts: list[tuple[int, int, int]]) -> torch.Tensor:
    return torch.tensor([p for _, ctx, n in parts for p in range(ctx, ctx + n)])


def settled_stats(handle, timeout: float = 10.0) -> dict:
    """A group's stats (actor handle) once every rank reports the same EP collective count. The ranks finish a
    step's last collective at slightly different times and a request's result can arrive first: a read in that
    window shows counts one apart. A real divergence persists (and fails the next DPMeta gather's check), so it
    still shows here after the timeout."""
    import time

    import ray

    deadline = time.monotonic() + timeout
    while True:
        st = ray.get(handle.get_stats.remote())
        if len({r["collectives"] for r in st["ranks"]}) == 1 or time.monotonic() > deadline:
            return st
        time.sleep(0.1)
