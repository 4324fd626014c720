"""Sparse MoE (softmax router, top-k, renormalised, SwiGLU experts, sigmoid-gated shared expert) and dense MLP.

A layer holds only the experts of its expert range [start, end) (EP shard). Routing is computed for all experts
(the router is replicated); the EP backend moves tokens to the ranks that own their experts and back.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mtp_ray.config.model import ModelConfig
from mtp_ray.layers.fp8 import E4M3, Fp8Block, Fp8Weight, dequantize, scale_shape
from mtp_ray.layers.linear import Linear


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2I] = [gate | up]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# (token, slot) pairs a local expert up to which per-pair GEMVs beat the grouped tiles (plan + tile GEMMs, each
# expert's weights read once): where the two cross at 256 experts on an H200 (bench/kernels.py --grouped, the MoE
# layer with its shared expert, us per-pair / grouped: bf16 160 pairs 198.5 / 204.0, 192 pairs 237.7 / 227.6; e4m3
# 224 pairs 190.2 / 189.4, 256 pairs 216.7 / 199.3; bench/results/kernels_h200_grouped_pairs.json). Up to one pair an
# expert before: a batch-8 verify of k = 3 (256 pairs) now takes 14.53 ms against 15.78 (bench/decode.py --pairs-ab).
PAIRS_PER_EXPERT = 0.6875
PAIRS_PER_EXPERT_FP8 = 0.875


class Experts(nn.Module):
    """Routed experts [start, end) in the fused checkpoint layout; FP8 after make_fp8 (both tensors e4m3, with
    `gate_up_proj_scale_inv` and `down_proj_scale_inv`)."""

    def __init__(self, hidden: int, inter: int, start: int, end: int):
        super().__init__()
        self.start, self.end = start, end
        self.gate_up_proj = nn.Parameter(torch.zeros(end - start, 2 * inter, hidden))  # [E_local, 2I, H]
        self.down_proj = nn.Parameter(torch.zeros(end - start, hidden, inter))  # [E_local, H, I]
        self.fp8_blocks: tuple[Fp8Block, Fp8Block] | None = None  # gate_up's, down's

    def make_fp8(self, block: Fp8Block) -> None:
        """Keep both expert tensors in FP8 (before they are filled). The gate and up halves of gate_up each bring
        their own scales: when I is not a multiple of the block's rows a block would straddle them, so gate_up
        then keeps one scale row per weight row."""
        inter = self.down_proj.shape[2]
        gu_block = block if inter % block.rows == 0 else Fp8Block(1, block.cols)
        for name, b in (("gate_up_proj", gu_block), ("down_proj", block)):
            w = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(w.shape, dtype=E4M3, device=w.device), requires_grad=False))
            setattr(self, name + "_scale_inv", nn.Parameter(torch.empty(scale_shape(w.shape, b), device=w.device),
                                                            requires_grad=False))
        self.fp8_blocks = (gu_block, block)

    @property
    def fp8(self) -> tuple[Fp8Weight, Fp8Weight] | None:
        if self.fp8_blocks is None:
            return None
        return (Fp8Weight(self.gate_up_proj_scale_inv, self.fp8_blocks[0]),
                Fp8Weight(self.down_proj_scale_inv, self.fp8_blocks[1]))

    def weights(self, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert i's gate_up [2I, H] and down [H, I] in dtype (CPU paths; FP8 dequantized)."""
        fp8 = self.fp8
        if fp8 is None:
            return self.gate_up_proj[i], self.down_proj[i]
        gu, dn = fp8
        return (dequantize(self.gate_up_proj[i], Fp8Weight(gu.scale[i], gu.block), dtype),
                dequantize(self.down_proj[i], Fp8Weight(dn.scale[i], dn.block), dtype))

    def pairs(self, topk_ids: torch.Tensor) -> bool:
        """GPU: few (token, slot) pairs run as GEMVs per pair, which beat sorting them into tiles (a static
        function of the shape: graph-safe). Up to PAIRS_PER_EXPERT pairs a local expert (FP8: _FP8)."""
        share = PAIRS_PER_EXPERT_FP8 if self.fp8_blocks is not None else PAIRS_PER_EXPERT
        return topk_ids.numel() <= max(int((self.end - self.start) * share), 16)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """Sum of the local experts' weighted outputs. x: [N, H]; topk_ids / topk_w: [N, k] (global ids)."""
        if x.is_cuda:
            from mtp_ray.layers.triton.moe import fused_experts
            from mtp_ray.layers.triton.moe_small import pair_experts

            if self.pairs(topk_ids):
                return pair_experts(x, topk_ids, topk_w, self.gate_up_proj, self.down_proj, self.start, fp8=self.fp8)
            return fused_experts(x, topk_ids, topk_w, self.gate_up_proj, self.down_proj, self.start, fp8=self.fp8)
        # CPU: one GEMM pair per expert that received tokens
        out = torch.zeros_like(x)
        local = (topk_ids >= self.start) & (topk_ids < self.end)
        for e in torch.unique(topk_ids[local]).tolist():
            tok, slot = torch.where(topk_ids == e)
            gu, dn = self.weights(e - self.start, x.dtype)
            y = F.linear(silu_and_mul(F.linear(x[tok], gu)), dn)
            out.index_add_(0, tok, (y * topk_w[tok, slot, None]).to(out.dtype))
        return out

    def per_slot(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """Each (token, slot)'s weighted output, unsummed: [N, k, H], zero where the slot's expert is not local.
        On the GPU forward() is this summed over the slots (the same kernel); on the CPU forward() accumulates the
        same products in expert order, which may differ from the slot-order sum in the last bits."""
        if x.is_cuda:
            from mtp_ray.layers.triton.moe import fused_experts

            return fused_experts(x, topk_ids, topk_w, self.gate_up_proj, self.down_proj, self.start, per_slot=True,
                                 fp8=self.fp8)
        n, k = topk_ids.shape
        out = x.new_zeros(n * k, x.shape[1])
        flat = topk_ids.reshape(-1)
        for e in torch.unique(flat[(flat >= self.start) & (flat < self.end)]).tolist():
            (pair,) = torch.where(flat == e)
            gu, dn = self.weights(e - self.start, x.dtype)
            y = F.linear(silu_and_mul(F.linear(x[pair // k], gu)), dn)
            out[pair] = (y * topk_w.reshape(-1)[pair, None]).to(out.dtype)
        return out.view(n, k, x.shape[1])

    def expert_major(self, x: torch.Tensor, counts: torch.Tensor, max_rows: int) -> torch.Tensor:
        """Unweighted expert outputs in the expert-major layout of a low-latency EP receive buffer (DeepEP): x:
        [E_local, M, H], rows [0, counts[e]) of expert e valid (the rest unspecified), at most max_rows valid in
        all. Returns [E_local, M, H]; rows past an expert's count are zero."""
        if x.is_cuda:
            from mtp_ray.layers.triton.moe import expert_major_experts

            return expert_major_experts(x, counts, self.gate_up_proj, self.down_proj, max_rows, fp8=self.fp8)
        out = torch.zeros_like(x)
        for e, n in enumerate(counts.tolist()):
            if n:
                gu, dn = self.weights(e, x.dtype)
                out[e, :n] = F.linear(silu_and_mul(F.linear(x[e, :n], gu)), dn)
        return out


class ExpertDispatcher(Protocol):
    """EP backend seen from a MoE layer: runs `experts` on every token's top-k, wherever the experts live."""

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Experts
                 ) -> torch.Tensor: ...


def local_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Experts) -> torch.Tensor:
    """No EP: this process holds the experts (all of them, or a shard whose partial sum the caller wants)."""
    return experts(x, topk_ids, topk_w)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_range: tuple[int, int] | None = None,
                 dispatch: ExpertDispatcher = local_dispatch):
        super().__init__()
        start, end = expert_range or (0, cfg.num_experts)
        assert 0 <= start < end <= cfg.num_experts, f"bad expert range {expert_range}"
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.hidden_size, cfg.moe_intermediate_size, start, end)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.dispatch = dispatch

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> topk ids [T, k] int64, weights [T, k] in x.dtype
        if x.is_cuda:
            from mtp_ray.layers.triton.route import route_topk

            return route_topk(self.gate(x), self.top_k, self.norm_topk, x.dtype)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        return ids, w.to(x.dtype)

    def _shared_weights(self):  # -> triton.moe_common.SharedWeights | None
        """The shared expert for the expert kernels (per-pair or grouped); None when its projections are partly FP8
        (they read one kind) or its sigmoid gate is."""
        from mtp_ray.layers.triton.moe_common import SharedWeights

        se = self.shared_expert
        lins = (se.gate_proj, se.up_proj, se.down_proj)
        fp8 = tuple(lin.fp8 for lin in lins)
        if len({f is None for f in fp8}) != 1 or self.shared_expert_gate.fp8 is not None:
            return None
        return SharedWeights(se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight,
                             self.shared_expert_gate.weight, None if fp8[0] is None else fp8)

    def _same_kind(self, sw) -> bool:
        """Routed and shared experts can share launches: both FP8 with the same blocks, or neither FP8."""
        ex = self.experts.fp8
        if ex is None or sw.fp8 is None:
            return ex is None and sw.fp8 is None
        return ex[0].block == sw.fp8[0].block == sw.fp8[1].block and ex[1].block == sw.fp8[2].block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.route(x)
        sw = self._shared_weights() if self.has_shared and x.is_cuda else None
        ex = self.experts
        if sw is not None and self.dispatch is local_dispatch and self._same_kind(sw):
            # no EP exchange in between: the shared expert runs in the routed experts' launches
            if ex.pairs(ids):
                from mtp_ray.layers.triton.moe_small import pair_experts

                return pair_experts(x, ids, w, ex.gate_up_proj, ex.down_proj, ex.start, sw, ex.fp8)
            from mtp_ray.layers.triton.moe import fused_experts

            return fused_experts(x, ids, w, ex.gate_up_proj, ex.down_proj, ex.start, fp8=ex.fp8, shared=sw)
        out = self.dispatch(x, ids, w, self.experts)
        if sw is not None:  # after the EP exchange: the shared expert alone, in its own expert launches
            from mtp_ray.layers.triton.moe_small import shared_expert_add

            return shared_expert_add(x, out, sw)
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
