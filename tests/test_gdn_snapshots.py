"""Prefix-cache snapshots inside a prefill piece (design.md 10.1): a GDN layer asked for a sequence's state after
its first j new tokens leaves in the snapshot slot exactly what a piece ending there would have left in the
sequence's own slot, and the batch's outputs and states do not change. The per-sequence path (CPU, fp32 on the
GPU) and the varlen path's glue (its Triton conv swapped for a PyTorch one here; the real kernels run in
tests/test_gdn_prefill.py on the device)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from mtp_ray.layers.context import ForwardBatch
from mtp_ray.layers.gated_delta_ops import causal_conv1d, chunk_gated_delta_varlen
from tests.test_gdn_prefill import SLOTS, _setup

LENS, CTXS = [1, 3, 37, 64, 70], [0, 5, 0, 100, 2]
# (sequence, j, slot): j < K - 1 on a fresh and on a continued state, one 64-token chunk, mid-chunk, two per sequence
SNAPS = [(1, 2, 11), (2, 2, 13), (3, 1, 15), (3, 64 - 1, 14), (4, 64, 10), (4, 5, 0)]


def _batch(lens: list[int], ctxs: list[int], slots: list[int], snaps=None) -> ForwardBatch:
    t = sum(lens)
    return ForwardBatch(query_lens=lens, context_lens=ctxs, block_tables=torch.zeros(len(lens), 1, dtype=torch.long),
                        slot_mapping=torch.zeros(t, dtype=torch.long), state_slots=slots, snapshots=snaps)


def _gates(m, x, rows=slice(None)):
    beta = x["b"][rows].sigmoid()
    g = -m.A_log.float().exp() * F.softplus(x["a"][rows] + m.dt_bias.float())
    return g, beta


def _per_sequence(m, x, batch, rows=slice(None)):
    m.conv_state, m.ssm_state = x["conv0"].clone(), x["ssm0"].clone()
    g, beta = _gates(m, x, rows)
    with torch.no_grad():
        core = m._per_sequence(x["mixed"][rows], g, beta, m.conv1d.weight[:, 0, :], batch)
    return core, m.conv_state.clone(), m.ssm_state.clone()


def _cut(m, x, slots, b: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b alone, a piece of its first j tokens: the conv and recurrent state it leaves in its slot."""
    s = sum(LENS[:b])
    _, conv, ssm = _per_sequence(m, x, _batch([j], [CTXS[b]], [slots[b]]), slice(s, s + j))
    return conv[slots[b]], ssm[slots[b]]


def _check_snapshots(m, x, slots, got, plain, tol: float) -> None:
    core, conv, ssm = got
    p_core, p_conv, p_ssm = plain
    assert torch.allclose(core, p_core, atol=tol, rtol=0)  # the batch's own outputs and states unchanged
    for s in slots:
        assert torch.allclose(conv[s], p_conv[s], atol=tol, rtol=0) and torch.allclose(ssm[s], p_ssm[s], atol=tol)
    for b, j, dst in SNAPS:
        c_conv, c_ssm = _cut(m, x, slots, b, j)
        assert torch.allclose(conv[dst], c_conv, atol=tol, rtol=0), (b, j)
        assert torch.allclose(ssm[dst], c_ssm, atol=tol, rtol=0), (b, j)
    untouched = set(range(SLOTS)) - set(slots) - {d for _, _, d in SNAPS}
    for s in untouched:
        assert torch.equal(ssm[s], x["ssm0"][s]) and torch.equal(conv[s], x["conv0"][s])


def test_per_sequence_snapshots_equal_pieces_ending_there():
    m, x, _, slots = _setup(2, 4, 32, 32, LENS, CTXS, seed=5)
    got = _per_sequence(m, x, _batch(LENS, CTXS, slots, SNAPS))
    plain = _per_sequence(m, x, _batch(LENS, CTXS, slots))
    _check_snapshots(m, x, slots, got, plain, tol=1e-6)


def _conv_varlen_torch(mixed, conv_state, weight, cu, slots, ctx, snapshots=None):
    """conv_varlen's contract in PyTorch: silu(conv) per sequence, conv states read (ctx > 0) and updated, and each
    snapshot's slot given the conv state after its sequence's first j tokens."""
    out = torch.empty_like(mixed)
    km1 = weight.shape[1] - 1
    for b in range(slots.shape[0]):
        s, e, slot = int(cu[b]), int(cu[b + 1]), int(slots[b])
        state = conv_state[slot] if int(ctx[b]) > 0 else torch.zeros_like(conv_state[slot])
        out[s:e], full = causal_conv1d(mixed[s:e], state, weight)  # full: [C, K - 1 + n], old state then tokens
        for si in range(int(snapshots.ptr[b]), int(snapshots.ptr[b + 1])) if snapshots is not None else ():
            j = int(snapshots.offset[si])
            conv_state[int(snapshots.slots[si])] = full[:, j : j + km1]
        conv_state[slot] = full[:, -km1:]
    return out


@pytest.fixture
def torch_conv(monkeypatch):
    """The varlen path with its Triton conv replaced (Triton is not installed on the CPU machine)."""
    fake = types.ModuleType("mtp_ray.layers.triton.gated_delta_varlen")
    fake.conv_varlen = _conv_varlen_torch
    monkeypatch.setitem(sys.modules, "mtp_ray.layers.triton.gated_delta_varlen", fake)


def test_varlen_snapshots_equal_pieces_ending_there(torch_conv):
    m, x, _, slots = _setup(2, 4, 32, 32, LENS, CTXS, seed=6)
    plain = _per_sequence(m, x, _batch(LENS, CTXS, slots))
    m.conv_state, m.ssm_state = x["conv0"].clone(), x["ssm0"].clone()
    with torch.no_grad():
        core = m._varlen(x["mixed"], x["a"], x["b"], m.conv1d.weight[:, 0, :].contiguous(),
                         _batch(LENS, CTXS, slots, SNAPS), chunk_gated_delta_varlen)
    _check_snapshots(m, x, slots, (core, m.conv_state.clone(), m.ssm_state.clone()), plain, tol=1e-5)


def test_a_snapshot_outside_its_piece_is_refused():
    with pytest.raises(AssertionError, match="inside a prefill piece"):
        _batch([4, 2], [0, 0], [1, 2], [(1, 2, 3)])
