"""GPU kernels (Triton) against the pure-PyTorch layers they replace: fresh random inputs, several shapes.
Runs on the device machine (`pytest -m gpu`); locally `TRITON_INTERPRET=1 KERNEL_DEVICE=cpu` runs it on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from mtp_ray.layers.attention import decode_attention, paged_attention
from mtp_ray.layers.context import ForwardBatch, UniformDecode

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("KERNEL_DEVICE", "cuda")
needs_device = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                  reason="needs a CUDA GPU (runs on the device machine)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hkv,d,q_len", [(4, 2, 32, 1), (4, 2, 32, 4), (16, 2, 256, 4), (8, 8, 64, 2)])
def test_paged_decode_attention(dtype, tol, hq, hkv, d, q_len):
    from mtp_ray.layers.attention_triton import paged_decode_attention

    g = torch.Generator().manual_seed(hq * 1000 + d + q_len)
    bs, nblocks, b = 16, 64, 5
    ctx = [0, 3, 17, 40, 95][:b]
    kv = torch.randn(2, nblocks, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(nblocks - 1, generator=g) + 1
    width = 8
    tables = torch.zeros(b, width, dtype=torch.long)
    for i in range(b):
        tables[i] = perm[i * width : (i + 1) * width]
    q = torch.randn(b * q_len, hq, d, generator=g).to(dtype)
    kv, tables, q = kv.to(DEVICE), tables.to(DEVICE), q.to(DEVICE)
    ctx_t = torch.tensor(ctx, device=DEVICE)
    out = paged_decode_attention(q, kv, tables, ctx_t, q_len, d**-0.5)
    ref = paged_attention(q.float(), kv.float(), ForwardBatch([q_len] * b, ctx, tables, torch.zeros(b * q_len),
                                                             [0] * b), d**-0.5)
    assert _rel(out, ref) < tol
    cpu = decode_attention(q.cpu(), kv.cpu(), tables.cpu(), UniformDecode(q_len, ctx_t.cpu(), ctx_t.cpu()), d**-0.5)
    assert _rel(cpu, ref.cpu()) < tol


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t,e,topk,h,inter,start", [(1, 8, 2, 128, 128, 0), (7, 16, 4, 64, 96, 0),
                                                    (300, 16, 4, 64, 96, 8), (33, 64, 8, 256, 128, 0)])
def test_fused_experts(dtype, tol, t, e, topk, h, inter, start):
    from mtp_ray.layers.moe import Experts
    from mtp_ray.layers.moe_triton import fused_experts

    g = torch.Generator().manual_seed(t * 7 + e)
    n_local = e - start if start else e
    ex = Experts(h, inter, start, start + n_local)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(n_local, 2 * inter, h, generator=g) * h**-0.5)
        ex.down_proj.copy_(torch.randn(n_local, h, inter, generator=g) * inter**-0.5)
    total = start + n_local
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(total, generator=g)[:topk] for _ in range(t)])
    ids[0, 0] = -1  # an EP padding row's id: contributes nothing
    w = torch.rand(t, topk, generator=g)
    with torch.no_grad():
        ref = ex.float()(x, ids, w)
    ex = ex.to(DEVICE, dtype)
    with torch.no_grad():
        out = fused_experts(x.to(DEVICE, dtype), ids.to(DEVICE), w.to(DEVICE, dtype), ex.gate_up_proj, ex.down_proj,
                            start)
    assert torch.isfinite(out).all()
    assert _rel(out.cpu(), ref) < tol
