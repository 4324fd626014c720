"""Gated full attention (Qwen3.5): q and an output gate from q_proj, per-head zero-centred q/k norm, partial NeoX
RoPE, GQA, sigmoid output gate; KV in a paged cache."""

from __future__ import annotations

import torch
from torch import nn

from mtp_ray.config.model import ModelConfig
from mtp_ray.layers.context import ForwardBatch, UniformDecode
from mtp_ray.layers.linear import FusedProjections, Linear
from mtp_ray.layers.norm import RMSNorm
from mtp_ray.layers.rope import RotaryEmbedding


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new tokens over its whole cached context (pure PyTorch)."""
    _, _, block_size, hkv, d = kv_cache.shape
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    for b in range(batch.num_seqs):
        s, e = batch.seq_range(b)
        ctx, n = batch.context_lens[b], e - s
        total = ctx + n
        blocks = batch.block_tables[b, : (total + block_size - 1) // block_size]
        k = kv_cache[0, blocks].reshape(-1, hkv, d)[:total]  # [L, Hkv, D]
        v = kv_cache[1, blocks].reshape(-1, hkv, d)[:total]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [Hq, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
        qs = q[s:e].transpose(0, 1).float()  # [Hq, n, D]
        scores = (qs @ k.transpose(1, 2)) * scale  # [Hq, n, L]
        # query j sits at absolute position ctx + j and sees keys 0..ctx + j
        pos = torch.arange(total, device=q.device)
        mask = pos[None, :] > (ctx + pos[:n])[:, None]
        scores.masked_fill_(mask, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def attn_meta(batch: ForwardBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The general batch's cu_seqlens [B + 1], context_lens [B] and block_tables on `device` (the lists copied
    once per forward: ForwardBatch.device_lists)."""
    cu, ctx, _ = batch.device_lists(device)
    tables = batch.block_tables  # the runner moves it to the device; a CPU table (direct model calls) is copied
    return cu, ctx, tables if tables.device == device else tables.to(device)


def decode_attention(
    q: torch.Tensor,  # [B * q_len, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W]
    u: UniformDecode,
    scale: float,
    gate: torch.Tensor | None = None,  # [B * q_len, Hq, D]: the output is multiplied by sigmoid(gate)
) -> torch.Tensor:  # [B * q_len, Hq, D]
    """Uniform decode / verify batch: batched kernels only (no host sync), so CUDA graphs can capture it."""
    if q.is_cuda:
        from mtp_ray.layers.triton.attention import paged_decode_attention

        return paged_decode_attention(q, kv_cache, block_tables, u.context_lens, u.q_len, scale, gate)
    # CPU: gather every block of the table (width W) and mask
    hkv, d = kv_cache.shape[3:]
    bsz, ql, hq = block_tables.shape[0], u.q_len, q.shape[1]
    g = hq // hkv
    k = kv_cache[0][block_tables].reshape(bsz, -1, hkv, d).permute(0, 2, 1, 3).float()  # [B, Hkv, L, D]
    v = kv_cache[1][block_tables].reshape(bsz, -1, hkv, d).permute(0, 2, 1, 3).float()
    # rows ordered (j, g): query token j, head kvh * g + g_i
    qh = q.view(bsz, ql, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(bsz, hkv, ql * g, d).float()
    scores = (qh @ k.transpose(-1, -2)) * scale  # [B, Hkv, ql * g, L]
    j = torch.arange(ql, device=q.device).repeat_interleave(g)  # [ql * g]
    limit = u.context_lens[:, None] + j[None, :]  # [B, ql * g] last visible key
    pos = torch.arange(k.shape[2], device=q.device)
    scores = scores.masked_fill((pos[None, None, :] > limit[:, :, None])[:, None], float("-inf"))
    o = scores.softmax(-1) @ v  # [B, Hkv, ql * g, D]
    o = o.view(bsz, hkv, ql, g, d).permute(0, 2, 1, 3, 4).reshape(bsz * ql, hq, d).to(q.dtype)
    return o * torch.sigmoid(gate) if gate is not None else o


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        bias = cfg.attention_bias
        self.q_proj = Linear(h, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.qkv_proj = None if bias else FusedProjections(self.q_proj, self.k_proj, self.v_proj)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        self.scale = self.head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, Hkv, D], bound by the engine

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, H]
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x) if self.qkv_proj is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        qg = qg.view(t, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]  # [T, Hq, D] each
        table = self.rope.table if self.rope.table is not None and x.is_cuda else None
        if table is None:
            key = (self.rope.rotary_dim, self.rope.theta, x.dtype, positions.data_ptr())
            if key not in batch.rope_cache:  # once per forward, shared by every attention layer
                batch.rope_cache[key] = self.rope.cos_sin(positions, x.dtype)
            cos, sin = batch.rope_cache[key]  # [T, rotary_dim] each
        else:
            cos, sin = table  # [P, rotary_dim] each, rows read by position inside the kernel
        assert self.kv_cache is not None, "KV cache not bound: allocate caches before the first forward"
        if x.is_cuda:  # q/k norms, RoPE and the KV write in one kernel
            from mtp_ray.layers.triton.attention import qk_norm_rope_store

            q = qk_norm_rope_store(qg, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin,
                                   batch.slot_mapping, self.kv_cache, positions if table is not None else None)
        else:
            q = RotaryEmbedding.apply(self.q_norm(q), cos, sin)
            k = RotaryEmbedding.apply(self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)), cos, sin)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            flat = self.kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
            write = batch.slot_mapping >= 0 if batch.uniform is None else slice(None)  # uniform: every row writes
            flat[0, batch.slot_mapping[write]] = k[write].to(flat.dtype)
            flat[1, batch.slot_mapping[write]] = v[write].to(flat.dtype)
        if batch.uniform is not None:  # batched kernels only (no host sync): CUDA graphs capture this
            o = decode_attention(q, self.kv_cache, batch.block_tables, batch.uniform, self.scale, gate)
        elif x.is_cuda:  # one Triton launch for every sequence, the output gate fused
            from mtp_ray.layers.triton.attention_prefill import paged_prefill_attention

            cu, ctx, tables = attn_meta(batch, q.device)
            o = paged_prefill_attention(q, self.kv_cache, tables, cu, ctx, self.scale, gate,  # [T, Hq, D]
                                        zero_rows=batch.padded_rows)
        else:
            o = paged_attention(q, self.kv_cache, batch, self.scale) * torch.sigmoid(gate)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, -1))
