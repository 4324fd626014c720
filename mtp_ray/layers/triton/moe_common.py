"""What the two MoE paths share (GPU): the shared expert's weights, which weight rows a gate_up program reads, and
the per-token sum of the (token, slot) pairs' fp32 partials in slot order (no atomics: deterministic, whichever
program finished first).

Both paths (moe_small: a GEMV per pair; moe: grouped GEMMs over pairs sorted by expert) write each pair's weighted
output, rounded to the activation dtype as `y * w` rounds it, into fp32 partials [T * (k + SH), H] at row
t * (k + SH) + j (slot k: the shared expert, when SH = 1); `slot_sum` adds them up as SparseMoE.forward does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mtp_ray.layers.fp8 import Fp8Weight
from mtp_ray.layers.triton import pdl


class SharedWeights(NamedTuple):
    """The shared expert of a MoE layer: gate, up [I_sh, H]; down [H, I_sh]; gate (the sigmoid scale) [1, H];
    fp8: gate's, up's and down's scales when those three are e4m3 (the sigmoid gate never is)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    scale: torch.Tensor
    fp8: tuple[Fp8Weight, Fp8Weight, Fp8Weight] | None = None


@triton.jit
def gate_up_rows(shared, e, g_ptr, u_ptr, sg_ptr, su_ptr, gs_ptr, sgs_ptr, sus_ptr, stride_we, stride_wn, stride_swn,
                 stride_gse, stride_gsn, stride_ssn, INTER, INTER_SH):
    """-> what a gate_up program of either path reads (the shared expert's, or local expert e's): gate and up
    weight rows, their count and row stride; FP8: their scales (up's scale rows start at row INTER of the fused
    gate_up's) and the scale row stride."""
    if shared:
        wg_ptr = sg_ptr
        wu_ptr = su_ptr
        inter = INTER_SH
        stride_n = stride_swn
        gs = sgs_ptr
        us = sus_ptr
        up_row = 0
        stride_sn = stride_ssn
    else:
        wg_ptr = g_ptr + e * stride_we
        wu_ptr = u_ptr + e * stride_we
        inter = INTER
        stride_n = stride_wn
        gs = gs_ptr + e * stride_gse
        us = gs_ptr + e * stride_gse
        up_row = INTER
        stride_sn = stride_gsn
    return wg_ptr, wu_ptr, inter, stride_n, gs, us, up_row, stride_sn


@triton.jit
def _slot_sum_kernel(part_ptr, out_ptr, ids_ptr, start, E_LOCAL, H, stride_o, TOPK: tl.constexpr,
                     SH: tl.constexpr, MASKED: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    """out[t] = the routed slots' sum in slot order (fp32, one rounding), then + the shared expert's output (SH),
    as SparseMoE.forward adds them; TOPK = 0: out holds the routed sum already (the EP path). MASKED: a slot whose
    expert is not in [start, start + E_LOCAL) was never written and counts as zero."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < H
    dt = out_ptr.dtype.element_ty
    base = part_ptr + t * (TOPK + SH) * H + n
    total = tl.zeros([BN], tl.float32)
    for j in tl.static_range(TOPK):
        lim = H
        if MASKED:
            e = tl.load(ids_ptr + t * TOPK + j) - start
            lim = tl.where((e >= 0) & (e < E_LOCAL), H, 0)
        total += tl.load(base + j * H, mask=n < lim, other=0.0)
    if SH:
        if TOPK > 0:
            total = total.to(dt).to(tl.float32)  # the routed sum, rounded once, then the shared expert added
        else:
            total = tl.load(out_ptr + t * stride_o + n, mask=nm, other=0.0).to(tl.float32)  # routed input
        total += tl.load(base + TOPK * H, mask=nm, other=0.0)
    tl.store(out_ptr + t * stride_o + n, total.to(dt), mask=nm)


def slot_sum(part: torch.Tensor, out: torch.Tensor, topk: int, sh: int,
             masked: tuple[torch.Tensor, int, int] | None = None) -> None:
    """out[t] = the fp32 partials [T * (topk + sh), H] of t's slots summed in slot order (+ the shared expert's).
    masked = (ids [T, topk], start, local experts): slots of other experts were not written and count as zero."""
    t, h = out.shape
    bs = min(triton.next_power_of_2(h), 1024)
    ids, start, e_local = masked if masked is not None else (part, 0, 0)
    _slot_sum_kernel[(t, triton.cdiv(h, bs))](part, out, ids, start, e_local, h, out.stride(0), TOPK=topk, SH=sh,
                                              MASKED=masked is not None, BN=bs, num_warps=4,
                                              **pdl.launch_args(out.device))
