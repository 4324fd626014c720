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

Prefill / mixed batches: `conv_varlen` (the conv over every sequence of a flat batch in one launch), then the
delta rule over cu_seqlens: for short pieces (layers/context.py: SHORT_PIECE) `recurrent_varlen`, the decode
kernel's recurrence looping over each sequence's tokens in one launch; else fla-core's chunked form
(`chunk_varlen_fla`, bf16 / fp16 models), whose launches through Triton's and fla's Python launchers cost 0.75-1.5
ms of host time a layer, 20-60x a short piece's device time (bench/gdn_prefill.py). An eager step prefilling one
new 32-token prompt at the 35B-A3B shapes cut to 4 layers: 0.79x the time on fla (bench/prefill_steps.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mtp_ray.layers.context import FLA_CHUNK, SnapshotMeta
from mtp_ray.layers.triton import pdl

log = logging.getLogger(__name__)


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
def _state_tile(h, stride_h, stride_k, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The [dk, BV] tile of value head h's state a program owns (dv tile: program axis 2) -> the key and value
    ranges with their masks, and the tile's offsets and mask within one state slot."""
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = vv < DV
    kk = tl.arange(0, BK)
    km = kk < DK
    return kk, km, vv, vm, h * stride_h + kk[:, None] * stride_k + vv[None, :], km[:, None] & vm[None, :]


@triton.jit
def _delta_token(s, q, k, v, g, beta, q_scale):
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
    kk, km, vv, vm, s_off, s_mask = _state_tile(h, stride_sh, stride_sk, DK, DV, BK, BV)
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
        s, o = _delta_token(s, q, k, v, neg_a * softplus, beta, q_scale)
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


@triton.jit
def _conv_window(mixed_ptr, state_ptr, s0, slot, dst, f0, p_min, c, cm, stride_m, stride_ss, stride_sc,
                 K: tl.constexpr, BC: tl.constexpr):
    """Conv state slot dst := the K - 1 inputs of [old state (K - 1) | the sequence's tokens] from index f0 on:
    column i reads old state column f0 + i (short prefixes; zeros where p_min says the state is fresh) or token
    f0 + i - (K - 1)."""
    for i in tl.static_range(K - 1):
        f = f0 + i + tl.zeros([BC], tl.int64)
        x = tl.load(mixed_ptr + (s0 + f - (K - 1)) * stride_m + c, mask=(f >= K - 1) & cm, other=0.0)
        old = tl.load(state_ptr + slot * stride_ss + c * stride_sc + tl.minimum(f, K - 2),
                      mask=(f < K - 1) & (f - (K - 1) >= p_min) & cm, other=0.0)
        tl.store(state_ptr + dst * stride_ss + c * stride_sc + i, tl.where(f >= K - 1, x, old.to(x.dtype))
                 .to(state_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _conv_varlen_kernel(mixed_ptr, state_ptr, w_ptr, cu_ptr, slots_ptr, ctx_ptr, out_ptr, snap_ptr, snap_j,
                        snap_slot, C, stride_m, stride_ss, stride_sc, stride_wc, stride_o,
                        K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_SNAP: tl.constexpr):
    """One program per (sequence, channel tile), looping over the sequence's tokens BT at a time: it owns its
    channels of that sequence's conv state, so reading the old state and writing the new one cannot race. With
    prefix-cache snapshots (HAS_SNAP: the sequence's snapshots are snap_ptr[b] .. snap_ptr[b + 1], each j tokens
    in, into slot snap_slot): the conv state after its first j tokens, written before the old state is replaced."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    s0 = tl.load(cu_ptr + b).to(tl.int64)
    n = tl.load(cu_ptr + b + 1).to(tl.int64) - s0
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # a sequence with cached context continues its conv state (state columns -(K - 1) .. -1 readable); else zeros
    p_min = -(K - 1) * (tl.load(ctx_ptr + b) != 0).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    st = state_ptr + slot * stride_ss + c[None, :] * stride_sc  # [1, BC] column 0 of this sequence's state
    for t0 in range(0, n, BT):
        tt = t0 + tl.arange(0, BT)  # [BT] token positions in the sequence
        acc = tl.zeros([BT, BC], tl.float32)
        for i in tl.static_range(K):
            p = tt - (K - 1) + i  # input position read by tap i; < 0: the conv state column K - 1 + p
            x = tl.load(mixed_ptr + (s0 + p)[:, None] * stride_m + c[None, :],
                        mask=((p >= 0) & (tt < n))[:, None] & cm[None, :], other=0.0).to(tl.float32)
            old = tl.load(st + (K - 1 + p)[:, None], mask=((p < 0) & (p >= p_min) & (tt < n))[:, None] & cm[None, :],
                          other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c * stride_wc + i, mask=cm, other=0.0).to(tl.float32)
            acc += (x + old) * w[None, :]
        conv = acc.to(dt).to(tl.float32)
        tl.store(out_ptr + (s0 + tt)[:, None] * stride_o + c[None, :], (conv * tl.sigmoid(conv)).to(dt),
                 mask=(tt < n)[:, None] & cm[None, :])
    if HAS_SNAP:  # each snapshot's window (another slot) from the old state, before it is replaced
        for si in range(tl.load(snap_ptr + b), tl.load(snap_ptr + b + 1)):
            _conv_window(mixed_ptr, state_ptr, s0, slot, tl.load(snap_slot + si).to(tl.int64),
                         tl.load(snap_j + si).to(tl.int64), p_min, c, cm, stride_m, stride_ss, stride_sc, K, BC)
    tl.debug_barrier()  # every read of the old state above happens before the new state is written
    # the new state: the last K - 1 inputs of [old state | tokens]; column j reads column n + j > j of the old
    # state (short sequences) or token n + j - (K - 1), so no column is read after it was overwritten
    _conv_window(mixed_ptr, state_ptr, s0, slot, slot, n, p_min, c, cm, stride_m, stride_ss, stride_sc, K, BC)


def conv_varlen(mixed: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                state_slots: torch.Tensor, context_lens: torch.Tensor,
                snapshots: SnapshotMeta | None = None) -> torch.Tensor:
    """Prefill / mixed batch: mixed [T, C] (sequence b owns rows cu_seqlens[b] .. cu_seqlens[b + 1]);
    conv_state [S, C, K - 1] read where context_lens[b] > 0 (else zeros) and updated in place -> silu(conv) [T, C].
    snapshots: each one's slot gets the conv state after its sequence's first j tokens."""
    bsz, c = state_slots.shape[0], mixed.shape[1]
    assert conv_state.stride(2) == 1 and weight.stride(1) == 1 and mixed.stride(1) == 1
    out = torch.empty(mixed.shape, dtype=mixed.dtype, device=mixed.device)
    snap = (snapshots.ptr, snapshots.offset, snapshots.slots) if snapshots is not None else (cu_seqlens,) * 3
    bc = 64
    _conv_varlen_kernel[(bsz, triton.cdiv(c, bc))](
        mixed, conv_state, weight, cu_seqlens, state_slots, context_lens, out, *snap, c,
        mixed.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), out.stride(0),
        K=weight.shape[1], BT=32, BC=bc, HAS_SNAP=snapshots is not None, num_warps=4,
    )
    return out


@triton.jit
def _recurrent_varlen_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, cu_ptr, out_ptr, final_ptr,
                             snap_ptr, snap_j, snap_slot, states_ptr,
                             stride_q, stride_qh, stride_k, stride_kh, stride_v, stride_vh, stride_g, stride_b,
                             stride_hn, stride_hh, stride_hk, stride_o, stride_oh, scale,
                             DK: tl.constexpr, DV: tl.constexpr, REP: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr, HAS_SNAP: tl.constexpr):
    """One program per (sequence, value head, dv tile): the state tile [dk, BV] from h0 in registers, the delta
    rule over the sequence's rows cu[n] .. cu[n + 1] one token at a time (q / k L2-normed here, as fla does), the
    final tile to `final`. The math of `_recurrent_kernel`, with g and beta given. HAS_SNAP: after the first j
    tokens of each of the sequence's snapshots (snap_ptr[n] .. snap_ptr[n + 1], in order of j) the tile also goes
    to state slot snap_slot of `states` (laid out as h0)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    kk, km, vv, vm, s_off, s_mask = _state_tile(h, stride_hh, stride_hk, DK, DV, BK, BV)
    hk = h // REP  # the key head this value head reads
    s = tl.load(h0_ptr + n.to(tl.int64) * stride_hn + s_off, mask=s_mask, other=0.0)  # [BK, BV] fp32
    t0 = tl.load(cu_ptr + n).to(tl.int64)
    t1 = tl.load(cu_ptr + n + 1).to(tl.int64)
    if HAS_SNAP:  # the next snapshot and the row it ends after (t0 + j; none left: past t1)
        si = tl.load(snap_ptr + n).to(tl.int64)
        s_end = tl.load(snap_ptr + n + 1).to(tl.int64)
        at = t0 + tl.load(snap_j + si, mask=si < s_end, other=0).to(tl.int64) + (si >= s_end).to(tl.int64) * (t1 + 1)
    for t in range(t0, t1):
        q = tl.load(q_ptr + t * stride_q + hk * stride_qh + kk, mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_k + hk * stride_kh + kk, mask=km, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_v + h * stride_vh + vv, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_g + h).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_b + h).to(tl.float32)
        s, o = _delta_token(s, q, k, v, g, beta, scale)
        tl.store(out_ptr + t * stride_o + h * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=vm)
        if HAS_SNAP:
            if t + 1 == at:
                dst = tl.load(snap_slot + si).to(tl.int64)
                tl.store(states_ptr + dst * stride_hn + s_off, s, mask=s_mask)
                si += 1
                at = t0 + tl.load(snap_j + si, mask=si < s_end, other=0).to(tl.int64) + \
                    (si >= s_end).to(tl.int64) * (t1 + 1)
    tl.store(final_ptr + n.to(tl.int64) * stride_hn + s_off, s, mask=s_mask)


def recurrent_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                     chunk_indices: torch.Tensor | None = None, snapshots: SnapshotMeta | None = None,
                     states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of gated_delta_ops.chunk_gated_delta_varlen (q, k [T, Hk, dk] raw; v [T, Hv, dv]; g, beta
    [T, Hv]; initial_state [N, Hv, dk, dv] fp32 -> o [T, Hv, dv] in v's dtype, final states fp32) in one launch,
    token-serial within each sequence (chunk_indices unused). snapshots (with `states`, the layer's state slots
    [S, Hv, dk, dv]): each snapshot's slot gets the state after its sequence's first j tokens, in the same launch."""
    n, hv, dk, dv = initial_state.shape
    hk = q.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and g.stride(1) == beta.stride(1) == 1
    assert initial_state.is_contiguous() and cu_seqlens.numel() == n + 1
    assert snapshots is None or states is not None and states.is_contiguous() and states.shape[1:] == (hv, dk, dv)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    final = torch.empty_like(initial_state)
    snap = (snapshots.ptr, snapshots.offset, snapshots.slots, states) if snapshots is not None \
        else (cu_seqlens, cu_seqlens, cu_seqlens, final)  # not read
    bv, warps = recurrent_tile(1, hv, dk, dv)  # one tile whatever the batch: a burst compiles nothing new
    _recurrent_varlen_kernel[(n, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, initial_state, cu_seqlens, out, final, *snap,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        initial_state.stride(0), initial_state.stride(1), initial_state.stride(2), out.stride(0), out.stride(1),
        scale, DK=dk, DV=dv, REP=hv // hk, BK=triton.next_power_of_2(dk), BV=bv, HAS_SNAP=snapshots is not None,
        num_warps=warps,
    )
    return out, final


@functools.cache
def fla_chunk() -> Callable | None:
    """fla-core's chunked gated delta rule (Triton, varlen), or None when fla is not installed (the per-sequence
    PyTorch path then runs prefill; slow but exact)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        log.warning("fla-core not importable (%s): GDN prefill falls back to the per-sequence PyTorch path", e)
        return None
    return chunk_gated_delta_rule


def chunk_varlen_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                     chunk_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as gated_delta_ops.chunk_gated_delta_varlen, on fla's kernels (q / k L2-norm inside); the
    host-built chunk indices spare fla a device sync per call."""
    fn = fla_chunk()
    assert fn is not None
    o, final = fn(q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=initial_state,
                  output_final_state=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                  chunk_size=FLA_CHUNK, use_qk_l2norm_in_kernel=True)
    return o[0], final
