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
from mtp_ray.layers.triton.norm import rms_row


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
    dt: tl.constexpr = out_ptr.dtype.element_ty
    base = part_ptr + t * (TOPK + SH) * H + n
    if TOPK > 0:
        total = _row_sum(base, n, nm, ids_ptr + t * TOPK, start, E_LOCAL, H, dt, TOPK, SH, MASKED)
    else:  # the routed sum is out's input (the EP path): + the shared expert's
        total = tl.load(out_ptr + t * stride_o + n, mask=nm, other=0.0).to(tl.float32)
        total += tl.load(base, mask=nm, other=0.0)
    tl.store(out_ptr + t * stride_o + n, total.to(dt), mask=nm)


@triton.jit
def _row_sum(base, n, nm, ids_ptr, start, E_LOCAL, H, dt: tl.constexpr, TOPK: tl.constexpr, SH: tl.constexpr,
             MASKED: tl.constexpr):
    """One token's partials (base: its first slot's row + n) summed in slot order in fp32, rounded to dt once,
    then + the shared expert's (SH), as SparseMoE.forward adds them. MASKED: a slot whose expert (ids_ptr: the
    token's ids) is not in [start, start + E_LOCAL) was never written and counts as zero."""
    total = tl.zeros(n.shape, tl.float32)
    for j in tl.static_range(TOPK):
        lim = H
        if MASKED:
            e = tl.load(ids_ptr + j) - start
            lim = tl.where((e >= 0) & (e < E_LOCAL), H, 0)
        total += tl.load(base + j * H, mask=n < lim, other=0.0)
    if SH:
        total = total.to(dt).to(tl.float32) + tl.load(base + TOPK * H, mask=nm, other=0.0)
    return total


# SparseMoE without EP leaves its slot sum to the norm after the layer (`SlotPartials`: one launch fewer a layer).
# Off until the device A/B (`bench/decode.py --ab defer`, gpu_run.sh stage ab) shows it faster
DEFER_SLOT_SUM = False


class SlotPartials(NamedTuple):
    """A MoE layer's output before its slot sum: the (token, slot) pairs' fp32 partials [T * (topk + sh), H] as the
    expert launches wrote them. The RMSNorm after the layer adds them up with its residual add (`add_norm`);
    `total()` is the plain sum for any other consumer. masked: as slot_sum's."""

    part: torch.Tensor
    topk: int
    sh: int
    dtype: torch.dtype
    masked: tuple[torch.Tensor, int, int] | None = None

    def total(self) -> torch.Tensor:
        out = torch.empty(self.part.shape[0] // (self.topk + self.sh), self.part.shape[1], dtype=self.dtype,
                          device=self.part.device)
        slot_sum(self.part, out, self.topk, self.sh, self.masked)
        return out

    def add_norm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(s) * (1 + weight), s) for s = total() + residual, in one launch: slot_sum then triton/norm.py's
        rms_norm, the same roundings (s equal; the norm's fp32 reduction may run in another order). Twice rms_norm's
        warps: one program reads the row's k + 1 fp32 partials, more loads in flight."""
        t, h = residual.shape
        assert residual.stride(1) == 1 and self.part.shape == (t * (self.topk + self.sh), h)
        out = torch.empty(t, h, dtype=self.dtype, device=residual.device)
        s = torch.empty_like(out)
        ids, start, e_local = self.masked if self.masked is not None else (self.part, 0, 0)
        _slot_sum_norm_kernel[(t,)](self.part, residual, weight, s, out, ids, start, e_local, h, residual.stride(0),
                                    eps, TOPK=self.topk, SH=self.sh, MASKED=self.masked is not None,
                                    BLOCK=triton.next_power_of_2(h), num_warps=8 if h >= 1024 else 1,
                                    **pdl.launch_args(residual.device))
        return out, s


@triton.jit
def _slot_sum_norm_kernel(part_ptr, res_ptr, w_ptr, sum_ptr, out_ptr, ids_ptr, start, E_LOCAL, H, stride_r, eps,
                          TOPK: tl.constexpr, SH: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    """_slot_sum_kernel's sum of row t (rounded as it stores it), + res (rounded), then _rms_norm_kernel's norm."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK)
    nm = n < H
    dt: tl.constexpr = out_ptr.dtype.element_ty
    total = _row_sum(part_ptr + t * (TOPK + SH) * H + n, n, nm, ids_ptr + t * TOPK, start, E_LOCAL, H, dt, TOPK, SH,
                     MASKED)
    x = (total.to(dt).to(tl.float32) + tl.load(res_ptr + t * stride_r + n, mask=nm, other=0.0).to(tl.float32))
    x = x.to(dt)
    tl.store(sum_ptr + t * H + n, x, mask=nm)
    w = tl.load(w_ptr + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + n, rms_row(x.to(tl.float32), w, H, eps).to(dt), mask=nm)


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
