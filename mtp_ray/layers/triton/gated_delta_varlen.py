"""Gated DeltaNet prefill / mixed batches in Triton (GPU): `conv_varlen` (the conv over every sequence of a flat
batch in one launch), then the delta rule over cu_seqlens: for short pieces (layers/context.py: SHORT_PIECE)
`recurrent_varlen`, the decode kernel's recurrence (triton/gated_delta.py) looping over each sequence's tokens in one
launch; else fla-core's chunked form (`chunk_varlen_fla`, bf16 / fp16 models), whose launches through Triton's and
fla's Python launchers cost 0.75-1.5 ms of host time a layer, 20-60x a short piece's device time
(bench/gdn_prefill.py). An eager step prefilling one new 32-token prompt at the 35B-A3B shapes cut to 4 layers: 0.79x
the time on fla (bench/prefill_steps.py). conv_varlen and recurrent_varlen write prefix-cache snapshots
(SnapshotMeta) in their own launch; with fla each snapshot's rows run as a sequence of their own
(layers/gated_delta.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mtp_ray.layers.context import FLA_CHUNK, SnapshotMeta
from mtp_ray.layers.triton.gated_delta import delta_token, recurrent_tile, state_tile

log = logging.getLogger(__name__)


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
    kk, km, vv, vm, s_off, s_mask = state_tile(h, stride_hh, stride_hk, DK, DV, BK, BV)
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
        s, o = delta_token(s, q, k, v, g, beta, scale)
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
                     states: torch.Tensor | None = None, zero_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of gated_delta_ops.chunk_gated_delta_varlen (q, k [T, Hk, dk] raw; v [T, Hv, dv]; g, beta
    [T, Hv]; initial_state [N, Hv, dk, dv] fp32 -> o [T, Hv, dv] in v's dtype, final states fp32) in one launch,
    token-serial within each sequence (chunk_indices unused). snapshots (with `states`, the layer's state slots
    [S, Hv, dk, dv]): each snapshot's slot gets the state after its sequence's first j tokens, in the same launch.
    zero_rows: rows past cu_seqlens[-1] (a padded static batch) come out zero rather than unwritten."""
    n, hv, dk, dv = initial_state.shape
    hk = q.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and g.stride(1) == beta.stride(1) == 1
    assert initial_state.is_contiguous() and cu_seqlens.numel() == n + 1
    assert snapshots is None or states is not None and states.is_contiguous() and states.shape[1:] == (hv, dk, dv)
    out = (torch.zeros if zero_rows else torch.empty)(v.shape, dtype=v.dtype, device=v.device)
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
