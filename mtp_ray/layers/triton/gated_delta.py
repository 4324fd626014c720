"""Gated DeltaNet decode / verify in Triton (GPU): two launches per layer for a uniform batch of q_len tokens per
sequence, instead of ~20 + ~15 per token of PyTorch kernels.

1. `conv_decode`: the causal depthwise conv over [conv state | new tokens] + SiLU, and the conv state written
   back (after token j into spec slot j for verify rollback; after the last token into the sequence's slot).
   One program per (sequence, channel tile): it owns its channels, so reading the old state and writing the new
   one cannot race.
2. `recurrent_decode`: per (sequence, value head, dv tile): q / k L2-norm, the decay g and beta from the raw
   projections, the delta rule over the q_len tokens with the state tile [dk, BV] in registers, the output, and
   the state after every token (spec slots) and after the last (the sequence's slot).

The math and its roundings follow GatedDeltaNet._uniform (conv accumulated in fp32, rounded to the model dtype,
SiLU rounded again; the recurrence in fp32).

Prefill / mixed batches: triton/gated_delta_varlen.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtp_ray.layers.triton import pdl


@triton.jit
def _conv_kernel(mixed_ptr, state_ptr, w_ptr, slots_ptr, spec_ptr, out_ptr, C,
                 stride_m, stride_ss, stride_sc, stride_wc, stride_o,
                 QL: tl.constexpr, K: tl.constexpr, HAS_SPEC: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    row0 = b.to(tl.int64) * QL
    # full[t] = conv state column t (t < K - 1), else new token t - (K - 1)
    for j in tl.static_range(QL):
        acc = tl.zeros([BC], tl.float32)
        for i in tl.static_range(K):
            t = j + i
            if t < K - 1:
                val = tl.load(state_ptr + slot * stride_ss + c * stride_sc + t, mask=cm, other=0.0)
            else:
                val = tl.load(mixed_ptr + (row0 + t - (K - 1)) * stride_m + c, mask=cm, other=0.0)
            acc += val.to(tl.float32) * tl.load(w_ptr + c * stride_wc + i, mask=cm, other=0.0).to(tl.float32)
        conv = acc.to(dt).to(tl.float32)
        tl.store(out_ptr + (row0 + j) * stride_o + c, (conv * tl.sigmoid(conv)).to(dt), mask=cm)
        if HAS_SPEC:  # the state after token j: full[j + 1 .. j + K - 1]
            dst = tl.load(spec_ptr + b * QL + j).to(tl.int64)
            for i in tl.static_range(K - 1):
                t = j + 1 + i
                if t < K - 1:
                    val = tl.load(state_ptr + slot * stride_ss + c * stride_sc + t, mask=cm, other=0.0)
                else:
                    val = tl.load(mixed_ptr + (row0 + t - (K - 1)) * stride_m + c, mask=cm, other=0.0)
                tl.store(state_ptr + dst * stride_ss + c * stride_sc + i, val.to(state_ptr.dtype.element_ty), mask=cm)
    # the new state: full[QL .. QL + K - 2]; column i is written after column QL + i > i was read
    for i in tl.static_range(K - 1):
        t = QL + i
        if t < K - 1:
            val = tl.load(state_ptr + slot * stride_ss + c * stride_sc + t, mask=cm, other=0.0)
        else:
            val = tl.load(mixed_ptr + (row0 + t - (K - 1)) * stride_m + c, mask=cm, other=0.0)
        tl.store(state_ptr + slot * stride_ss + c * stride_sc + i, val.to(state_ptr.dtype.element_ty), mask=cm)


def conv_decode(mixed: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, state_slots: torch.Tensor,
                spec_slots: torch.Tensor | None, q_len: int) -> torch.Tensor:
    """mixed: [B * q_len, C]; conv_state: [S, C, K - 1] (updated in place); weight: [C, K]
    -> silu(conv) [B * q_len, C]."""
    bsz, c = state_slots.shape[0], mixed.shape[1]
    k = weight.shape[1]
    assert conv_state.stride(2) == 1 and weight.stride(1) == 1 and mixed.stride(1) == 1
    out = torch.empty(mixed.shape, dtype=mixed.dtype, device=mixed.device)
    bc = 256
    _conv_kernel[(bsz, triton.cdiv(c, bc))](
        mixed, conv_state, weight, state_slots, spec_slots if spec_slots is not None else state_slots, out, c,
        mixed.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), out.stride(0),
        QL=q_len, K=k, HAS_SPEC=spec_slots is not None, BC=bc, num_warps=2, **pdl.launch_args(mixed.device),
    )
    return out


@triton.jit
def state_tile(h, stride_h, stride_k, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The [dk, BV] tile of value head h's state a program owns (dv tile: program axis 2) -> the key and value
    ranges with their masks, and the tile's offsets and mask within one state slot."""
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = vv < DV
    kk = tl.arange(0, BK)
    km = kk < DK
    return kk, km, vv, vm, h * stride_h + kk[:, None] * stride_k + vv[None, :], km[:, None] & vm[None, :]


@triton.jit
def delta_token(s, q, k, v, g, beta, q_scale):
    """One token of the gated delta rule on a state tile s [BK, BV] (fp32): q, k [BK] raw (L2-normed here, q
    scaled), v [BV], log decay g, beta -> (the new tile, the output [BV])."""
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * q_scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    s = s * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], 0)) * beta  # [BV]
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], 0)


@triton.jit
def _recurrent_kernel(x_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, slots_ptr, spec_ptr, out_ptr,
                      stride_x, stride_ab, stride_ss, stride_sh, stride_sk, stride_o, stride_oh, q_scale,
                      KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HV: tl.constexpr,
                      REP: tl.constexpr, QL: tl.constexpr, HAS_SPEC: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    kk, km, vv, vm, s_off, s_mask = state_tile(h, stride_sh, stride_sk, DK, DV, BK, BV)
    hk = h // REP  # the key head this value head reads
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s = tl.load(state_ptr + slot * stride_ss + s_off, mask=s_mask, other=0.0)  # [BK, BV] fp32
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    row0 = b.to(tl.int64) * QL
    for j in tl.static_range(QL):
        row = row0 + j
        q = tl.load(x_ptr + row * stride_x + hk * DK + kk, mask=km, other=0.0).to(tl.float32)
        k = tl.load(x_ptr + row * stride_x + KEY_DIM + hk * DK + kk, mask=km, other=0.0).to(tl.float32)
        v = tl.load(x_ptr + row * stride_x + 2 * KEY_DIM + h * DV + vv, mask=vm, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * stride_ab + h).to(tl.float32) + dt_bias
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        beta = tl.sigmoid(tl.load(b_ptr + row * stride_ab + h).to(tl.float32))
        s, o = delta_token(s, q, k, v, neg_a * softplus, beta, q_scale)
        tl.store(out_ptr + row * stride_o + h * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=vm)
        if HAS_SPEC:
            dst = tl.load(spec_ptr + b * QL + j).to(tl.int64)
            tl.store(state_ptr + dst * stride_ss + s_off, s, mask=s_mask)
    tl.store(state_ptr + slot * stride_ss + s_off, s, mask=s_mask)


def recurrent_tile(bsz: int, hv: int, dk: int, dv: int) -> tuple[int, int]:
    """(BV, warps): state tiles of dk rows x BV columns. Below 128 rows, 64 columns. For 128 rows, the H200 sweep
    at the 35B-A3B shapes (`bench/kernels.py --recurrent`, kernels_h200_recurrent.json): 32 columns win while that
    leaves few programs (batch 1-8: 2.9 / 8.9 us against 3.4 / 9.5 at 64), 64 columns once the wider grid still has
    >= 4096 programs (batch 64 / 256: 75 / 286 us against 85 / 335 at 32; a verify of 4 tokens 286 / 1142 against
    298 / 1216)."""
    wide = min(triton.next_power_of_2(dv), 64)
    if triton.next_power_of_2(dk) < 128 or bsz * hv * triton.cdiv(dv, wide) >= 4096:
        return wide, 4
    return min(triton.next_power_of_2(dv), 32), 4


def recurrent_decode(conv_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor, ssm_state: torch.Tensor, state_slots: torch.Tensor,
                     spec_slots: torch.Tensor | None, q_len: int, key_heads: int, key_dim: int, out_dtype: torch.dtype,
                     tile: tuple[int, int] | None = None) -> torch.Tensor:
    """conv_out: [B * q_len, 2 * Hk * dk + Hv * dv]; a, b: [B * q_len, Hv] raw projections; ssm_state:
    [S, Hv, dk, dv] fp32 (updated in place) -> core output [B * q_len, Hv, dv] in out_dtype. tile: (BV, warps),
    the sweep's override (bench/kernels.py --recurrent)."""
    bsz = state_slots.shape[0]
    _, hv, dk, dv = ssm_state.shape
    assert ssm_state.stride(3) == 1 and conv_out.stride(1) == 1 and a.stride(1) == 1 and a.stride(0) == b.stride(0)
    out = torch.empty(conv_out.shape[0], hv, dv, dtype=out_dtype, device=conv_out.device)
    bk = triton.next_power_of_2(dk)
    bv, warps = tile or recurrent_tile(bsz, hv, dk, dv)
    _recurrent_kernel[(bsz, hv, triton.cdiv(dv, bv))](
        conv_out, a, b, a_log, dt_bias, ssm_state, state_slots, spec_slots if spec_slots is not None else state_slots,
        out, conv_out.stride(0), a.stride(0), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        out.stride(0), out.stride(1), dk**-0.5,
        KEY_DIM=key_heads * dk, DK=dk, DV=dv, HV=hv, REP=hv // key_heads, QL=q_len,
        HAS_SPEC=spec_slots is not None, BK=bk, BV=bv, num_warps=warps, **pdl.launch_args(conv_out.device),
    )
    return out
