"""The MoE router's softmax + top-k in Triton (GPU): per token, softmax over the router logits (fp32), top-k
(descending, lowest id first on ties), renormalised -> ids, weights in the activation dtype. One launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp_ray.layers.triton import pdl


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, E, stride_l, TOPK: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One token a program: softmax in fp32, top-k descending (lowest id first among equal probabilities),
    renormalised when NORM. One max a round, not argmax + max: the key packs a probability's bits (>= 0: ordered
    as integers) over the complement of its id."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
    key = tl.where(e < E, key, -1)
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int64)
    vals = tl.zeros([BLOCK_K], tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.max(key, 0)
        ids = tl.where(slot == j, BLOCK_E - 1 - (best & 0xFFFFFFFF), ids)
        vals = tl.where(slot == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), vals)
        key = tl.where(key == best, -1, key)
    if NORM:
        vals = vals / tl.sum(vals, 0)
    tl.store(ids_ptr + t * TOPK + slot, ids, mask=slot < TOPK)
    tl.store(w_ptr + t * TOPK + slot, vals.to(w_ptr.dtype.element_ty), mask=slot < TOPK)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] router output -> ids [T, k] int64, weights [T, k] in dtype."""
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.long, device=logits.device)
    w = torch.empty(t, top_k, dtype=dtype, device=logits.device)
    _route_kernel[(t,)](logits, ids, w, e, logits.stride(0), TOPK=top_k, NORM=renormalize,
                        BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
                        num_warps=1 if e <= 256 else 4, **pdl.launch_args(logits.device))
    return ids, w
