"""GDN prefill / mixed batches on the GPU path (GatedDeltaNet._varlen: the varlen conv kernel + a varlen chunked
delta rule) against the per-sequence PyTorch path: outputs, conv and recurrent states, fresh and continued
sequences. Runs on the device machine (`pytest -m gpu`); locally `TRITON_INTERPRET=1 KERNEL_DEVICE=cpu` checks the
conv kernel and the glue with the reference delta rule (fla needs a GPU)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from mtp_ray.config.engine import BUNDLED_MODEL
from mtp_ray.config.model import ModelConfig
from mtp_ray.layers.context import ForwardBatch
from mtp_ray.layers.gated_delta import GatedDeltaNet
from mtp_ray.layers.gated_delta_ops import chunk_gated_delta_varlen

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("KERNEL_DEVICE", "cuda")
needs_device = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                  reason="needs a CUDA GPU (runs on the device machine)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need a CUDA GPU")

SLOTS = 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _setup(hk: int, hv: int, dk: int, dv: int, lens: list[int], ctxs: list[int], seed: int):
    cfg = dataclasses.replace(ModelConfig.from_pretrained(BUNDLED_MODEL), linear_num_key_heads=hk,
                              linear_num_value_heads=hv, linear_key_head_dim=dk, linear_value_head_dim=dv)
    g = torch.Generator().manual_seed(seed)
    m = GatedDeltaNet(cfg)
    with torch.no_grad():
        m.conv1d.weight.copy_(torch.randn(m.conv_dim, 1, m.kernel, generator=g) * 0.5)
        m.A_log.copy_(torch.randn(hv, generator=g) * 0.5)
        m.dt_bias.copy_(torch.randn(hv, generator=g))
    t = sum(lens)
    inputs = {"mixed": torch.randn(t, m.conv_dim, generator=g), "a": torch.randn(t, hv, generator=g),
              "b": torch.randn(t, hv, generator=g),
              "conv0": torch.randn(SLOTS, m.conv_dim, m.kernel - 1, generator=g),
              "ssm0": torch.randn(SLOTS, hv, dk, dv, generator=g) * 0.1}
    slots = [3, 7, 1, 12, 9, 5][: len(lens)]
    batch = ForwardBatch(query_lens=lens, context_lens=ctxs, block_tables=torch.zeros(len(lens), 1, dtype=torch.long),
                         slot_mapping=torch.zeros(t, dtype=torch.long), state_slots=slots)
    return m, inputs, batch, slots


def _reference(m: GatedDeltaNet, x: dict, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-sequence PyTorch path in fp32 on the CPU: core output, conv states, recurrent states."""
    import torch.nn.functional as F

    m.conv_state, m.ssm_state = x["conv0"].clone(), x["ssm0"].clone()
    beta = x["b"].sigmoid()
    g = -m.A_log.float().exp() * F.softplus(x["a"] + m.dt_bias.float())
    with torch.no_grad():
        core = m._per_sequence(x["mixed"], g, beta, m.conv1d.weight[:, 0, :], batch)
    return core, m.conv_state.clone(), m.ssm_state.clone()


CASES = [((2, 4, 32, 32), [1, 3, 37, 64, 70], [0, 5, 0, 100, 2]),
         ((1, 3, 64, 48), [130, 2], [0, 9]),
         ((4, 8, 128, 128), [17, 1, 65, 1], [1, 0, 40, 7])]  # a decode row: 1 token on a warm state


def _run(m, x, batch, slots, dtype, chunk_fn):
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    m.conv_state, m.ssm_state = dev(x["conv0"].to(dtype)), dev(x["ssm0"])
    w = dev(m.conv1d.weight.detach()[:, 0, :].to(dtype).contiguous())
    mm = m.to(DEVICE)
    with torch.no_grad():
        core = mm._varlen(dev(x["mixed"].to(dtype)), dev(x["a"].to(dtype)), dev(x["b"].to(dtype)), w, batch, chunk_fn,
                          snapshots_in_kernel=chunk_fn.__name__ == "recurrent_varlen")  # as the layer runs it
    return core.cpu().float(), m.conv_state.cpu().float(), m.ssm_state.cpu()


def _check(core, conv, ssm, ref, slots, x, tol):
    ref_core, ref_conv, ref_ssm = ref
    assert _rel(core, ref_core) < tol
    for s in slots:
        assert _rel(conv[s], ref_conv[s]) < tol, s
        assert _rel(ssm[s], ref_ssm[s]) < tol, s
    for s in range(SLOTS):  # slots outside the batch keep their states
        if s not in slots:
            assert torch.equal(ssm[s], x["ssm0"][s]), s


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,lens,ctxs", CASES)
def test_varlen_conv_and_glue(dtype, tol, heads, lens, ctxs):
    """conv_varlen (Triton) + the state glue, with the reference varlen delta rule."""
    m, x, batch, slots = _setup(*heads, lens, ctxs, seed=sum(lens) + heads[3])
    ref = _reference(m, x, batch)
    _check(*_run(m, x, batch, slots, dtype, chunk_gated_delta_varlen), ref, slots, x, tol)


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,lens,ctxs", CASES)
def test_varlen_fla(dtype, tol, heads, lens, ctxs):
    """The GPU path as the layer runs it: conv_varlen + fla's chunked delta rule over cu_seqlens (fp32 tolerance
    covers fla's TF32 dots; bf16 models are the ones that take this path)."""
    from mtp_ray.layers.triton.gated_delta_varlen import chunk_varlen_fla, fla_chunk

    assert fla_chunk() is not None, "fla-core is part of the GPU install (tools/wheelhouse.sh)"
    m, x, batch, slots = _setup(*heads, lens, ctxs, seed=sum(lens) + heads[3])
    ref = _reference(m, x, batch)
    _check(*_run(m, x, batch, slots, dtype, chunk_varlen_fla), ref, slots, x, tol)


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,lens,ctxs", CASES)
def test_varlen_recurrent(dtype, tol, heads, lens, ctxs):
    """The short-piece GPU path: conv_varlen + the token-serial recurrent kernel over cu_seqlens (any length here;
    the layer sends it pieces of up to SHORT_PIECE tokens), fp32 to the reference's rounding."""
    from mtp_ray.layers.triton.gated_delta_varlen import recurrent_varlen

    m, x, batch, slots = _setup(*heads, lens, ctxs, seed=sum(lens) + heads[3])
    ref = _reference(m, x, batch)
    _check(*_run(m, x, batch, slots, dtype, recurrent_varlen), ref, slots, x, tol)


@pytest.mark.parametrize("kernel,tols", [
    pytest.param("recurrent_varlen", (1e-5, 2e-2), marks=needs_device, id="recurrent"),
    pytest.param("chunk_varlen_fla", (5e-3, 3e-2), marks=needs_cuda, id="fla")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_snapshots_equal_pieces_ending_there(kernel, tols, dtype):
    """Prefix-cache snapshots inside prefill pieces on the GPU's delta-rule kernels (the short-piece recurrence, fla's
    chunks): each snapshot slot holds the state a piece ending there leaves (tests/test_gdn_snapshots.py checks the
    same exactly on the CPU)."""
    from mtp_ray.layers.triton import gated_delta_varlen
    from tests.test_gdn_snapshots import CTXS, LENS, SNAPS, _batch, _cut

    tol = tols[dtype is torch.bfloat16]
    m, x, _, slots = _setup(2, 4, 32, 32, LENS, CTXS, seed=7)
    ref = _reference(m, x, _batch(LENS, CTXS, slots))
    cuts = {(b, j): _cut(m, x, slots, b, j) for b, j, _ in SNAPS}
    core, conv, ssm = _run(m, x, _batch(LENS, CTXS, slots, SNAPS), slots, dtype, getattr(gated_delta_varlen, kernel))
    assert _rel(core, ref[0]) < tol
    for s in slots:
        assert _rel(conv[s], ref[1][s]) < tol and _rel(ssm[s], ref[2][s]) < tol, s
    for b, j, dst in SNAPS:
        assert _rel(conv[dst], cuts[b, j][0]) < tol and _rel(ssm[dst], cuts[b, j][1]) < tol, (b, j)
