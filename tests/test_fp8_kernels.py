"""FP8-resident weights on the GPU (layers/fp8.py): every kernel that reads an e4m3 weight with its block scales
gives what it gives for the dequantized weight, within rounding (it multiplies the exact e4m3 values and scales,
where the dequantized weight is rounded to the model's dtype), and a served FP8 checkpoint gives the dequantized
checkpoint's tokens up to near-ties, with CUDA graphs on."""

from __future__ import annotations

import os

import pytest
import torch

from mtp_ray.layers.fp8 import Fp8Block, Fp8Weight, dequantize, quantize

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("KERNEL_DEVICE", "cuda")
needs_device = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                  reason="needs a CUDA GPU (runs on the device machine)")


def _fp8(w: torch.Tensor, block: Fp8Block, dtype: torch.dtype) -> tuple[torch.Tensor, Fp8Weight, torch.Tensor]:
    """(q, its scales, the dequantized weight in dtype), on the device."""
    q, s = quantize(w, block)
    f = Fp8Weight(s.to(DEVICE), block)
    q = q.to(DEVICE)
    return q, f, dequantize(q, f, dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal within the rounding of the dequantized weight to a's dtype (fp32: the summation order only)."""
    tol = 1e-5 if a.dtype == torch.float32 else 2e-2
    return a.dtype == b.dtype and bool(((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-6)) < tol)


@needs_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (1, 1000, 600), (4, 2048, 1024), (3, 100, 96), (16, 300, 256)])
@pytest.mark.parametrize("block", [Fp8Block(128, 128), Fp8Block(16, 12), Fp8Block(1, 128)])
def test_gemv_fp8_equals_dequantized(dtype, m, n, k, block):
    from mtp_ray.layers.linear import Linear, linear
    from mtp_ray.layers.triton.linear import gemv

    if dtype == torch.float32 and m == 1 and n > 512:
        pytest.skip("one fp32 one-row case is enough")
    g = torch.Generator().manual_seed(m * n + k + block.rows)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    q, f, deq = _fp8(torch.randn(n, k, generator=g) * k**-0.5, block, dtype)
    assert _same(gemv(x, q, fp8=f), gemv(x, deq))
    if m == 1 and dtype == torch.bfloat16:
        for tile in [("row", 2, 256, 2, 1, 1), ("row", 4, 1024, 4, 1, 1), ("dot", 16, 128, 4, 3, 1),
                     ("dot", 32, 512, 4, 3, 1), ("dot", 16, 128, 4, 3, 4), ("dot", 32, 256, 4, 3, 2)]:
            assert _same(gemv(x, q, tile, fp8=f), gemv(x, deq, tile))
    lin = Linear(k, n, bias=False)
    lin.make_fp8(block)
    lin = lin.to(DEVICE)
    with torch.no_grad():
        lin.weight.copy_(q)
        lin.weight_scale_inv.copy_(f.scale)
        assert _same(lin(x), linear(x, deq))  # the GEMV on the GPU
        x_big = torch.randn(100, k, generator=g).to(DEVICE, dtype)  # past the GEMV rows: two 64-row M tiles
        assert _same(lin(x_big), torch.nn.functional.linear(x_big, deq))
        if DEVICE != "cuda":  # the Triton interpreter: the kernel itself (lin() takes the CPU path there)
            assert _same(gemv(x_big, q, fp8=f), torch.nn.functional.linear(x_big, deq))


@needs_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes,block", [((256, 128, 4, 4), Fp8Block(32, 64)), ((256, 64, 64), Fp8Block(32, 64)),
                                         ((8192, 4096, 32, 32), Fp8Block(128, 128))])
def test_fused_fp8_projections_through_the_kernel(dtype, sizes, block):
    """FusedProjections padded to whole scale blocks (a GDN input: qkv, z, b, a; an attention qkv), one GEMV on
    the stacked e4m3 buffer: each projection's output equals its dequantized weight's, pads dropped."""
    from mtp_ray.layers.linear import FusedProjections, Linear
    from mtp_ray.layers.triton.linear import gemv

    if DEVICE != "cuda" and sizes[0] > 1024:
        pytest.skip("the 35B-sized GDN input: on the GPU only (interpreter time)")
    g = torch.Generator().manual_seed(len(sizes) + block.rows)
    k = 2048 if sizes[0] > 1024 else 128
    layers = [Linear(k, n, bias=False) for n in sizes]
    for lin in layers:
        lin.make_fp8(block)
        q, s = quantize(torch.randn(lin.weight.shape, generator=g) * k**-0.5, block)
        with torch.no_grad():
            lin.weight.copy_(q)
            lin.weight_scale_inv.copy_(s)
    layers = [lin.to(DEVICE) for lin in layers]
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    want = [gemv(x, dequantize(lin.weight, Fp8Weight(lin.weight_scale_inv, block), dtype)) for lin in layers]
    f = FusedProjections(*layers)
    f.fuse()
    y = gemv(x, f.buffer, fp8=Fp8Weight(f.scales, block))
    parts = y.split([n for lin, pad in zip(layers, f.pads) for n in (lin.weight.shape[0], pad)], dim=-1)[::2]
    assert all(_same(got, ref) for got, ref in zip(parts, want, strict=True))


def _moe_weights(g, e, h, inter, block, dtype):
    gu = torch.randn(e, 2 * inter, h, generator=g) * h**-0.5
    dn = torch.randn(e, h, inter, generator=g) * inter**-0.5
    gu_block = block if inter % block.rows == 0 else Fp8Block(1, block.cols)  # as Experts.make_fp8 lays it out
    qgu, fgu, dgu = _fp8(gu, gu_block, dtype)
    qdn, fdn, ddn = _fp8(dn, block, dtype)
    return (qgu, qdn, (fgu, fdn)), (dgu, ddn)


@needs_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,n_local,start,topk,h,inter,block", [
    (1, 16, 16, 0, 4, 256, 128, Fp8Block(128, 128)), (4, 8, 4, 2, 2, 96, 48, Fp8Block(16, 12)),
    (8, 64, 64, 0, 8, 256, 96, Fp8Block(64, 128)), (40, 16, 16, 0, 4, 128, 64, Fp8Block(32, 32))])
def test_experts_fp8_equal_dequantized(dtype, t, e, n_local, start, topk, h, inter, block):
    """pair_experts and fused_experts (with a shared expert, FP8 too; per-slot and summed), expert_major_experts:
    each FP8 launch equals the same launch on the dequantized weights, a foreign shard and padding ids included
    (96 = I not a multiple of 64: gate_up keeps one scale row per weight row)."""
    from mtp_ray.layers.triton.moe import expert_major_experts, fused_experts
    from mtp_ray.layers.triton.moe_small import SharedWeights, pair_experts, shared_expert_add

    g = torch.Generator().manual_seed(t * 7 + e)
    (qgu, qdn, fp8), (dgu, ddn) = _moe_weights(g, n_local, h, inter, block, dtype)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
    ids[0, 0] = -1
    ids = ids.to(DEVICE)
    w = torch.rand(t, topk, generator=g).to(DEVICE, dtype)
    gu_block = fp8[0].block  # one launch, one block: the shared expert's as the routed experts' (SparseMoE checks)
    parts = [_fp8(torch.randn(*s, generator=g) * s[1] ** -0.5, b, dtype)
             for s, b in (((24, h), gu_block), ((24, h), gu_block), ((h, 24), block))]
    gate = torch.randn(1, h, generator=g).to(DEVICE, dtype)
    shared8 = SharedWeights(*(q for q, _, _ in parts), gate, tuple(f for _, f, _ in parts))
    shared = SharedWeights(*(d for _, _, d in parts), gate)
    with torch.no_grad():
        if t <= 8:
            assert _same(pair_experts(x, ids, w, qgu, qdn, start, fp8=fp8), pair_experts(x, ids, w, dgu, ddn, start))
            assert _same(pair_experts(x, ids, w, qgu, qdn, start, shared8, fp8),
                         pair_experts(x, ids, w, dgu, ddn, start, shared))
        for per_slot in (False, True):
            assert _same(fused_experts(x, ids, w, qgu, qdn, start, per_slot, fp8),
                         fused_experts(x, ids, w, dgu, ddn, start, per_slot))
        assert _same(fused_experts(x, ids, w, qgu, qdn, start, fp8=fp8, shared=shared8),
                     fused_experts(x, ids, w, dgu, ddn, start, shared=shared))
        routed = torch.randn(t, h, generator=g).to(DEVICE, dtype)  # (past 8 tokens: the grouped launches)
        assert _same(shared_expert_add(x, routed, shared8), shared_expert_add(x, routed, shared))
        counts = torch.randint(0, 5, (n_local,), generator=g)
        xe = torch.randn(n_local, 6, h, generator=g).to(DEVICE, dtype)
        assert _same(expert_major_experts(xe, counts.to(DEVICE), qgu, qdn, n_local * 6, fp8),
                     expert_major_experts(xe, counts.to(DEVICE), dgu, ddn, n_local * 6))


@needs_device
@pytest.mark.parametrize("dtype,k", [("bfloat16", 0), ("bfloat16", 3), ("float32", 3)])
def test_fp8_checkpoint_serves_the_dequantized_tokens_on_gpu(tmp_path, dtype, k):
    """CUDA graphs on: the FP8 checkpoint's weights stay e4m3 on the device (about half the weight bytes). fp32:
    every token equals the dequantized checkpoint's (the kernels differ from it in summation order only, so this
    catches a scale or layout error anywhere in the model); bf16: the agreement is printed, and tokens differ only
    after a near-tie."""
    import shutil

    from mtp_ray import LLM, SamplingParams
    from mtp_ray.config.engine import BUNDLED_MODEL
    from tests.test_fp8 import PROMPTS, fp8_pair

    shutil.copytree(BUNDLED_MODEL, tmp_path / "src")  # GPU-sized heads; 32 x 64 blocks: the kernels' fast paths
    fp8_pair(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq", block=[32, 64])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out, mem = {}, {}
    for name in ("fp8", "deq"):
        llm = LLM(str(tmp_path / name), device="cuda", dtype=dtype, num_speculative_tokens=k)
        out[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
        mem[name] = llm.engine.runner.memory()["weights_bytes"]
        del llm
    same = sum(a == b for x, y in zip(out["fp8"], out["deq"]) for a, b in zip(x, y)) / sum(map(len, out["deq"]))
    print(f"FP8 vs dequantized {dtype}, k = {k}: greedy token agreement {same:.3f}; weight bytes {mem}")
    assert mem["fp8"] < 0.7 * mem["deq"]
    if dtype == "float32":
        assert out["fp8"] == out["deq"]
    else:
        assert all(x[0] == y[0] for x, y in zip(out["fp8"], out["deq"]))  # differences only after a near-tie
        assert same > 0.5
