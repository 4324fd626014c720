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
    from mtp_ray.layers.triton.attention import paged_decode_attention

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
    for splits in (1, 3, 16):  # flash-decoding splits (some empty for short contexts) give the same result
        assert _rel(paged_decode_attention(q, kv, tables, ctx_t, q_len, d**-0.5, splits=splits), out) < tol
    ref = paged_attention(q.float(), kv.float(), ForwardBatch([q_len] * b, ctx, tables, torch.zeros(b * q_len),
                                                             [0] * b), d**-0.5)
    assert _rel(out, ref) < tol
    cpu = decode_attention(q.cpu(), kv.cpu(), tables.cpu(), UniformDecode(q_len, ctx_t.cpu(), ctx_t.cpu()), d**-0.5)
    assert _rel(cpu, ref.cpu()) < tol


def _prefill_case(g: torch.Generator, dtype, hkv: int, d: int, qlens: list[int], ctx: list[int], bs: int = 16):
    """Random paged cache + shuffled, disjoint block tables (block 0 reserved) + the ForwardBatch that reads them."""
    width = max((c + n + bs - 1) // bs for c, n in zip(ctx, qlens, strict=True))
    nblocks = 1 + len(qlens) * width
    kv = torch.randn(2, nblocks, bs, hkv, d, generator=g).to(dtype)
    tables = (torch.randperm(nblocks - 1, generator=g) + 1).view(len(qlens), width)
    slots = [int(tables[b, p // bs]) * bs + p % bs for b, (c, n) in enumerate(zip(ctx, qlens, strict=True))
             for p in range(c, c + n)]
    return kv, ForwardBatch(qlens, ctx, tables, torch.tensor(slots), [0] * len(qlens))


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (16, 2, 256), (8, 8, 64), (4, 2, 80)])
@pytest.mark.parametrize("gated", [False, True])
def test_paged_prefill_attention(dtype, tol, hq, hkv, d, gated):
    from mtp_ray.layers.attention import attn_meta
    from mtp_ray.layers.triton.attention_prefill import paged_prefill_attention

    g = torch.Generator().manual_seed(hq * 1000 + d + gated)
    qlens, ctx = [1, 5, 17, 64, 130, 2], [95, 0, 40, 3, 95, 0]
    kv, batch = _prefill_case(g, dtype, hkv, d, qlens, ctx)
    q = torch.randn(sum(qlens), hq, 2 * d, generator=g).to(dtype)  # q | gate per head, as the layer's qg
    q, gate = q[..., :d], q[..., d:]
    ref = paged_attention(q.float(), kv.float(), batch, d**-0.5)
    if gated:
        ref = (ref.to(dtype) * torch.sigmoid(gate)).float()
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    cu, ctx_t, tables = attn_meta(batch, torch.device(DEVICE))
    assert attn_meta(batch, torch.device(DEVICE))[0].data_ptr() == cu.data_ptr()  # one copy per forward
    assert cu.tolist() == batch.cu_seqlens and ctx_t.tolist() == ctx and tables.device == cu.device
    out = paged_prefill_attention(dev(q), dev(kv), tables, cu, ctx_t, d**-0.5, dev(gate) if gated else None)
    assert out.dtype == dtype and out.shape == q.shape
    assert _rel(out.cpu(), ref) < tol
    # int64 metadata, a one-sequence batch
    kv1, b1 = _prefill_case(g, dtype, hkv, d, [33], [21])
    q1 = torch.randn(33, hq, d, generator=g).to(dtype)
    out1 = paged_prefill_attention(dev(q1), dev(kv1), dev(b1.block_tables), dev(torch.tensor([0, 33])),
                                   dev(torch.tensor([21])), d**-0.5)
    assert _rel(out1.cpu(), paged_attention(q1.float(), kv1.float(), b1, d**-0.5)) < tol


@needs_device
@pytest.mark.parametrize("n", [1, 40])
def test_paged_prefill_attention_dummy(n):
    """A dummy forward (engine.inputs.dummy_inputs): every table entry block 0, any number of tokens."""
    from mtp_ray.engine.inputs import dummy_inputs
    from mtp_ray.layers.attention import attn_meta
    from mtp_ray.layers.triton.attention_prefill import paged_prefill_attention

    batch = dummy_inputs(n).batch
    kv = torch.randn(2, 3, 16, 2, 32).to(DEVICE)
    q = torch.randn(n, 4, 32).to(DEVICE)
    cu, ctx, tables = attn_meta(batch, torch.device(DEVICE))
    out = paged_prefill_attention(q, kv, tables, cu, ctx, 32**-0.5, q)
    assert out.shape == q.shape and torch.isfinite(out).all()


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_gated_attention_mixed_batch(dtype, tol, monkeypatch):
    """GatedAttention on a non-uniform batch (prefill chunks + decode rows): the device path (Triton prologue and
    prefill kernel) equals the fp32 CPU path."""
    from mtp_ray.config.engine import BUNDLED_MODEL
    from mtp_ray.config.model import ModelConfig
    from mtp_ray.layers.attention import GatedAttention

    g = torch.Generator().manual_seed(5)
    cfg = ModelConfig.from_pretrained(BUNDLED_MODEL)
    layer = GatedAttention(cfg)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * (prm.shape[-1] ** -0.5 if prm.dim() > 1 else 0.1))
    qlens, ctx = [1, 7, 70, 1, 19], [30, 0, 12, 64, 5]
    kv, batch = _prefill_case(g, torch.float32, cfg.num_key_value_heads, cfg.head_dim, qlens, ctx)
    x = torch.randn(sum(qlens), cfg.hidden_size, generator=g)
    pos = torch.tensor([p for c, n in zip(ctx, qlens, strict=True) for p in range(c, c + n)])
    with torch.no_grad():
        layer.kv_cache = kv.clone()
        ref = layer(x, pos, batch)
        layer = layer.to(DEVICE, dtype)
        layer.kv_cache = kv.to(DEVICE, dtype)
        batch.rope_cache.clear()
        batch.block_tables, batch.slot_mapping = batch.block_tables.to(DEVICE), batch.slot_mapping.to(DEVICE)
        if DEVICE == "cpu":  # interpreter run: take the layer's CUDA branch (its Triton kernels) on CPU tensors
            monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        out = layer(x.to(DEVICE, dtype), pos.to(DEVICE), batch)
    monkeypatch.undo()
    assert "varlen" in batch.rope_cache  # the Triton branch ran (its device lists are cached on the batch)
    assert out.dtype == dtype and _rel(out.cpu(), ref) < tol


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t,e,topk,h,inter,start", [(1, 8, 2, 128, 128, 0), (7, 16, 4, 64, 96, 0),
                                                    (300, 16, 4, 64, 96, 8), (33, 64, 8, 256, 128, 0)])
@pytest.mark.parametrize("path", ["sorted", "pairs"])
def test_fused_experts(dtype, tol, t, e, topk, h, inter, start, path):
    from mtp_ray.layers.moe import Experts
    from mtp_ray.layers.triton.moe import fused_experts
    from mtp_ray.layers.triton.moe_small import pair_experts

    fn = fused_experts if path == "sorted" else pair_experts
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
        out = fn(x.to(DEVICE, dtype), ids.to(DEVICE), w.to(DEVICE, dtype), ex.gate_up_proj, ex.down_proj,
                            start)
    assert torch.isfinite(out).all()
    assert _rel(out.cpu(), ref) < tol
    from mtp_ray.layers.moe import MLP
    from mtp_ray.layers.triton.moe_common import SharedWeights

    mlp, gate = MLP(h, inter + 16), torch.randn(1, h, generator=g) * h**-0.5
    with torch.no_grad():
        for prm in mlp.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * prm.shape[-1] ** -0.5)
        ref_sh = ref + torch.sigmoid(x @ gate.T) * mlp(x)
        dev = lambda v: v.to(DEVICE, dtype)  # noqa: E731
        sw = SharedWeights(dev(mlp.gate_proj.weight), dev(mlp.up_proj.weight), dev(mlp.down_proj.weight), dev(gate))
        out_sh = fn(dev(x), ids.to(DEVICE), dev(w), ex.gate_up_proj, ex.down_proj, start, shared=sw)
    assert _rel(out_sh.cpu(), ref_sh) < tol  # the shared expert in the same launches (its own I)
    if path == "sorted":  # per-slot outputs (the low-latency EP path): zero off this shard, summing to `out`
        with torch.no_grad():
            slots = fused_experts(x.to(DEVICE, dtype), ids.to(DEVICE), w.to(DEVICE, dtype), ex.gate_up_proj,
                                  ex.down_proj, start, per_slot=True)
        assert _rel(slots.sum(1).float(), out.float()) < tol  # (torch may add the slots in another order)
        foreign = (ids < start) | (ids >= total)
        assert (slots.cpu()[foreign] == 0).all()
        with torch.no_grad():
            cpu_slots = ex.float().cpu().per_slot(x, ids, w)
        assert _rel(slots.cpu().float(), cpu_slots) < tol and (cpu_slots[foreign] == 0).all()


@needs_device
@pytest.mark.parametrize("t,k,e,start,shared,bm", [(1, 2, 8, 0, False, 16), (37, 4, 16, 8, True, 16),
                                                   (300, 8, 256, 0, True, 64), (5, 3, 600, 100, True, 16),
                                                   (1100, 8, 64, 0, False, 64)])
@pytest.mark.parametrize("fn", ["plan", "plan_launch", "plan_torch"])
def test_moe_plan_is_a_stable_sort_by_expert(t, k, e, start, shared, bm, fn):
    """The plan (one launch up to KERNEL_PAIRS pairs, torch ops past it; the launch at any size) equals torch's
    stable argsort of the pairs by local expert (each token's shared-expert pair as key E, foreign experts last with
    no row), and its tiles cover each expert's rows in order."""
    from mtp_ray.layers.triton import moe_plan

    g = torch.Generator().manual_seed(t * k + e)
    ids = torch.randint(0, start + e + 4 * k, (t, k), generator=g)
    ids[0, 0] = -1
    p = getattr(moe_plan, fn)(ids.to(DEVICE), start, e, shared, bm)
    sh = int(shared)
    key = torch.where((ids >= start) & (ids < start + e), ids - start, e + sh)
    if shared:
        key = torch.cat([key, torch.full((t, 1), e)], 1)
    key = key.reshape(-1)
    order = torch.argsort(key, stable=True)
    n = int((key < e + sh).sum())
    assert torch.equal(p.dst.cpu()[:n].long(), order[:n])
    assert torch.equal(p.src.cpu()[:n].long(), order[:n] // (k + sh))
    te, r0, r1 = p.te.cpu().long(), p.r0.cpu().long(), p.r1.cpu().long()
    live = r0 < r1
    covered = torch.cat([torch.arange(a, b) for a, b in zip(r0[live].tolist(), r1[live].tolist(), strict=True)]
                        + [torch.zeros(0, dtype=torch.long)])
    assert torch.equal(covered, torch.arange(n))  # every row once, in order
    assert ((r1 - r0)[live] <= bm).all() and (key[order[r0[live]]] == te[live]).all()
    assert (key[order[r1[live] - 1]] == te[live]).all()


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="counts GPU compiles (device machine)")
def test_moe_plan_compiles_once_for_both_tile_sizes():
    """The one-launch plan's tile rows (16 or 64, chosen by the batch) are not part of its compile: a server met the
    64-row plan first at ~500-900-token steps, after the warmup, and stalled 1.5 s compiling it (cold_compiles)."""
    from triton import knobs

    from mtp_ray.layers.triton import moe_plan

    seen: list[str] = []

    def hook(**kw: object) -> bool:
        seen.append(getattr(kw.get("fn"), "name", "?"))
        return False

    ids = torch.randint(0, 40, (37, 5), device="cuda")  # top-5 of 37 local experts + shared: shapes no other test has
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = hook
    try:
        moe_plan.plan_launch(ids, 0, 37, True, 16)
        torch.cuda.synchronize()
        seen.clear()
        moe_plan.plan_launch(ids, 0, 37, True, 64)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert seen == [], seen


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("e,m,h,inter,counts", [(4, 12, 64, 32, (3, 0, 12, 1)),
                                                (8, 40, 128, 64, (40, 7, 0, 0, 33, 2, 9, 17))])
def test_expert_major_experts(dtype, tol, e, m, h, inter, counts):
    """DeepEP's low-latency layout [E, M, H]: valid rows first in each expert's block; padding rows hold garbage
    (NaN here) and must come back zero without touching the valid rows."""
    from mtp_ray.layers.moe import Experts
    from mtp_ray.layers.triton.moe import expert_major_experts

    g = torch.Generator().manual_seed(e * 31 + m)
    ex = Experts(h, inter, 0, e)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(e, 2 * inter, h, generator=g) * h**-0.5)
        ex.down_proj.copy_(torch.randn(e, h, inter, generator=g) * inter**-0.5)
    cnt = torch.tensor(counts, dtype=torch.int32)
    x = torch.full((e, m, h), float("nan"))
    for i, n in enumerate(counts):
        x[i, :n] = torch.randn(n, h, generator=g)
    with torch.no_grad():
        ref = ex.float().expert_major(x, cnt, sum(counts))
    ex = ex.to(DEVICE, dtype)
    with torch.no_grad():
        out = expert_major_experts(x.to(DEVICE, dtype), cnt.to(DEVICE), ex.gate_up_proj, ex.down_proj,
                                   sum(counts) + 5).cpu()
    assert torch.isfinite(out).all()
    assert _rel(out.float(), ref) < tol
    for i, n in enumerate(counts):
        assert (out[i, n:] == 0).all()


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows,d", [(1, 128), (7, 2048), (33, 96)])
def test_rms_norms(dtype, tol, rows, d):
    from mtp_ray.layers.norm import GatedRMSNorm, RMSNorm
    from mtp_ray.layers.triton.norm import gated_rms_norm, rms_norm

    g = torch.Generator().manual_seed(rows + d)
    x, r, z = (torch.randn(rows, d, generator=g).to(dtype) for _ in range(3))
    norm, gated = RMSNorm(d).to(dtype), GatedRMSNorm(d).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g) * 0.1)
        gated.weight.copy_(1 + torch.randn(d, generator=g) * 0.1)
        ref, ref_sum, ref_gated = norm(x + r), x + r, gated(x, z)
        dev = lambda t: t.to(DEVICE)  # noqa: E731
        out, s = rms_norm(dev(x), dev(norm.weight), norm.eps, dev(r))
        # the residual stream is rounded exactly as x + r (the CPU interpreter truncates fp32 -> bf16 instead)
        assert torch.equal(s.cpu(), ref_sum) if DEVICE == "cuda" else _rel(s.cpu(), ref_sum) < tol
        assert _rel(out.cpu(), ref) < tol
        assert _rel(rms_norm(dev(x), dev(norm.weight), norm.eps)[0].cpu(), norm(x)) < tol
        assert _rel(gated_rms_norm(dev(x), dev(z), dev(gated.weight), gated.eps).cpu(), ref_gated) < tol
        if d % 32 == 0:  # the gate as a strided [T, heads, 32] column slice of a wider buffer (fused projections)
            wide = torch.randn(rows, d + 40, generator=g).to(dtype)
            zs = wide[:, 8 : 8 + d].view(rows, d // 32, 32)
            g32 = GatedRMSNorm(32).to(dtype)
            want = g32(x.view(rows, d // 32, 32), zs)
            got = gated_rms_norm(dev(x).view(rows, d // 32, 32), dev(wide)[:, 8 : 8 + d].view(rows, d // 32, 32),
                                 dev(g32.weight), g32.eps)
            assert _rel(got.cpu(), want) < tol


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hk,hv,dk,dv,q_len,spec", [(2, 4, 32, 32, 1, False), (2, 4, 32, 32, 4, True),
                                                     (1, 3, 64, 48, 2, True), (4, 8, 128, 128, 1, False)])
def test_gdn_decode(dtype, tol, hk, hv, dk, dv, q_len, spec):
    """conv_decode + recurrent_decode = GatedDeltaNet._uniform: outputs, main and snapshot states."""
    import dataclasses

    import torch.nn.functional as F

    from mtp_ray.config.engine import BUNDLED_MODEL
    from mtp_ray.config.model import ModelConfig
    from mtp_ray.layers.gated_delta import GatedDeltaNet
    from mtp_ray.layers.triton.gated_delta import conv_decode, recurrent_decode

    cfg = dataclasses.replace(ModelConfig.from_pretrained(BUNDLED_MODEL), linear_num_key_heads=hk,
                              linear_num_value_heads=hv, linear_key_head_dim=dk, linear_value_head_dim=dv)
    g = torch.Generator().manual_seed(hk * 100 + dv + q_len)
    m = GatedDeltaNet(cfg)
    c, b, slots = m.conv_dim, 3, 12
    with torch.no_grad():
        m.conv1d.weight.copy_(torch.randn(c, 1, m.kernel, generator=g) * 0.5)
        m.A_log.copy_(torch.randn(hv, generator=g))
        m.dt_bias.copy_(torch.randn(hv, generator=g))
    conv0 = torch.randn(slots, c, m.kernel - 1, generator=g)
    ssm0 = torch.randn(slots, hv, dk, dv, generator=g) * 0.1
    mixed = torch.randn(b * q_len, c, generator=g)
    a_raw, b_raw = torch.randn(b * q_len, hv, generator=g), torch.randn(b * q_len, hv, generator=g)
    state_slots = torch.tensor([3, 7, 1])
    spec_slots = torch.tensor([[2, 4, 5, 6][:q_len], [8, 9, 10, 11][:q_len], [0, 0, 0, 0][:q_len]]) if spec else None
    # reference: the module's batched PyTorch path, fp32 on the CPU
    m.conv_state, m.ssm_state = conv0.clone(), ssm0.clone()
    beta = b_raw.sigmoid()
    gg = -m.A_log.float().exp() * F.softplus(a_raw + m.dt_bias.float())
    batch = ForwardBatch.decode(UniformDecode(q_len, torch.zeros(b, dtype=torch.long), state_slots, spec_slots),
                                torch.zeros(b, 1, dtype=torch.long), torch.zeros(b * q_len, dtype=torch.long))
    with torch.no_grad():
        ref = m._uniform(mixed, gg, beta, m.conv1d.weight[:, 0, :], batch)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    w = dev(m.conv1d.weight.detach()[:, 0, :].to(dtype).contiguous())
    ss, sp = dev(state_slots), dev(spec_slots) if spec else None
    # the batch's own tile, and for 128-row states the 64-column tile large batches take (recurrent_tile)
    for tile in [None] + ([(64, 4)] if dk == 128 else []):
        conv_state, ssm_state = dev(conv0.to(dtype)).clone(), dev(ssm0).clone()  # (on the CPU .to() does not copy)
        with torch.no_grad():
            conv = conv_decode(dev(mixed.to(dtype)), conv_state, w, ss, sp, q_len)
            out = recurrent_decode(conv, dev(a_raw.to(dtype)), dev(b_raw.to(dtype)), dev(m.A_log.detach()),
                                   dev(m.dt_bias.detach()), ssm_state, ss, sp, q_len, hk, dk, dtype, tile)
        assert _rel(out.cpu(), ref) < tol
        touched = state_slots.tolist() + ([s for row in spec_slots[:2].tolist() for s in row] if spec else [])
        for s in touched:
            assert _rel(ssm_state[s].cpu(), m.ssm_state[s]) < tol, s
            assert _rel(conv_state[s].cpu().float(), m.conv_state[s]) < tol, s
        untouched = [s for s in range(1, slots) if s not in touched and s != 0]
        for s in untouched:
            assert torch.equal(ssm_state[s].cpu(), ssm0[s])


@needs_device
@pytest.mark.parametrize("t,e,topk,norm", [(1, 8, 2, True), (5, 256, 8, True), (3, 64, 4, False), (2, 512, 10, True)])
def test_route_topk(t, e, topk, norm):
    from mtp_ray.layers.triton.route import route_topk

    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(e + t))
    p = torch.softmax(logits, -1)
    w, ids = torch.topk(p, topk, -1)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    got_ids, got_w = route_topk(logits.to(DEVICE), topk, norm, torch.float32)
    assert torch.equal(got_ids.cpu(), ids)
    assert _rel(got_w.cpu(), w) < 1e-5


@needs_device
@pytest.mark.parametrize("e,topk", [(8, 3), (256, 8), (60, 8)])
def test_route_topk_ties_take_the_lowest_id(e, topk):
    """Equal probabilities (logits from a few values) are taken lowest expert id first, as a stable sort does."""
    from mtp_ray.layers.triton.route import route_topk

    logits = torch.randint(0, 3, (4, e), generator=torch.Generator().manual_seed(e)).float()
    p = torch.softmax(logits, -1)
    w, ids = torch.sort(p, stable=True, dim=-1, descending=True)
    w, ids = w[:, :topk], ids[:, :topk]
    got_ids, got_w = route_topk(logits.to(DEVICE), topk, True, torch.float32)
    assert torch.equal(got_ids.cpu(), ids)
    assert _rel(got_w.cpu(), w / w.sum(-1, keepdim=True)) < 1e-6


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("t,hq,hkv,d,rd", [(1, 4, 2, 32, 8), (6, 16, 2, 256, 64), (5, 8, 8, 64, 64)])
def test_qk_norm_rope_store(dtype, tol, t, hq, hkv, d, rd):
    from mtp_ray.layers.norm import RMSNorm
    from mtp_ray.layers.rope import RotaryEmbedding
    from mtp_ray.layers.triton.attention import paged_decode_attention, qk_norm_rope_store

    g = torch.Generator().manual_seed(t + hq + d)
    qg = torch.randn(t, hq, 2 * d, generator=g).to(dtype)
    k, v = torch.randn(t, hkv * d, generator=g).to(dtype), torch.randn(t, hkv * d, generator=g).to(dtype)
    qn, kn = RMSNorm(d).to(dtype), RMSNorm(d).to(dtype)
    with torch.no_grad():
        qn.weight.copy_(torch.randn(d, generator=g) * 0.1)
        kn.weight.copy_(torch.randn(d, generator=g) * 0.1)
    pos = torch.tensor([7, 300, 4095, 0, 12, 99][:t])
    cos, sin = RotaryEmbedding(rd, 10000.0).cos_sin(pos, dtype)
    slots = torch.tensor([5, -1, 17, 30, 2, 9][:t])  # -1: not written
    with torch.no_grad():
        ref_q = RotaryEmbedding.apply(qn(qg[..., :d]), cos, sin)
        ref_k = RotaryEmbedding.apply(kn(k.view(t, hkv, d)), cos, sin)
        cache = torch.randn(2, 4, 8, hkv, d, generator=g).to(dtype)
        dev = lambda x: x.to(DEVICE)  # noqa: E731
        cache_d = dev(cache)
        q = qk_norm_rope_store(dev(qg), dev(k), dev(v), dev(qn.weight), dev(kn.weight), qn.eps, dev(cos), dev(sin),
                               dev(slots), cache_d)
        got = cache_d.cpu().view(2, -1, hkv, d)
    assert _rel(q.cpu(), ref_q) < tol
    # the per-position table path (the engine's): rows read by position, the same values
    ct, st = RotaryEmbedding(rd, 10000.0).cos_sin(torch.arange(4096), dtype)
    cache_t = dev(cache)
    with torch.no_grad():
        q_t = qk_norm_rope_store(dev(qg), dev(k), dev(v), dev(qn.weight), dev(kn.weight), qn.eps, dev(ct), dev(st),
                                 dev(slots), cache_t, dev(pos))
    assert torch.equal(q_t.cpu(), q.cpu()) and torch.equal(cache_t.cpu(), cache_d.cpu())
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert _rel(got[0, s], ref_k[i]) < tol and torch.equal(got[1, s], v[i].view(hkv, d))
    assert torch.equal(got[:, 1], cache.view(2, -1, hkv, d)[:, 1])  # slot 1 is nobody's
    # the decode kernel's fused output gate = o * sigmoid(gate)
    tables = torch.arange(4).view(1, 4).repeat(t, 1)
    ctx = torch.tensor([3, 9, 20, 1, 0, 5][:t])
    u = UniformDecode(1, ctx, ctx)
    plain = paged_decode_attention(q, cache_d, dev(tables), dev(ctx), 1, d**-0.5)
    gated = paged_decode_attention(q, cache_d, dev(tables), dev(ctx), 1, d**-0.5, dev(qg[..., d:]))
    assert _rel(gated.cpu(), plain.cpu() * torch.sigmoid(qg[..., d:])) < tol
    assert _rel(decode_attention(q.cpu(), cache_d.cpu(), tables, u, d**-0.5, qg[..., d:]), gated.cpu()) < 2 * tol


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("t,h,inter", [(1, 128, 128), (4, 2048, 512), (8, 96, 80), (9, 128, 64), (70, 96, 80)])
def test_shared_expert_add(dtype, tol, t, h, inter):
    """The shared expert after an EP exchange: per-token GEMVs up to SHARED_PAIR_TOKENS, grouped launches past."""
    from mtp_ray.layers.moe import MLP
    from mtp_ray.layers.triton.moe_small import SharedWeights, shared_expert_add

    g = torch.Generator().manual_seed(t * h + inter)
    mlp = MLP(h, inter)
    gate = torch.nn.Linear(h, 1, bias=False)
    with torch.no_grad():
        for p in [*mlp.parameters(), gate.weight]:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    mlp, gate = mlp.to(dtype), gate.to(dtype)
    x, routed = torch.randn(t, h, generator=g).to(dtype), torch.randn(t, h, generator=g).to(dtype)
    with torch.no_grad():
        ref = routed + torch.sigmoid(gate(x)) * mlp(x)
        dev = lambda v: v.to(DEVICE)  # noqa: E731
        sw = SharedWeights(dev(mlp.gate_proj.weight), dev(mlp.up_proj.weight), dev(mlp.down_proj.weight),
                           dev(gate.weight))
        out = shared_expert_add(dev(x), dev(routed), sw)
    assert _rel(out.cpu(), ref) < tol


def test_moe_path_follows_pairs_per_local_expert():
    """Per-pair GEMVs up to PAIRS_PER_EXPERT pairs a local expert (FP8: its own share), the grouped tiles past it;
    never below 16 pairs (small expert counts). A pure function of the shape (graph-safe)."""
    from mtp_ray.layers.fp8 import Fp8Block
    from mtp_ray.layers.moe import Experts

    ex = Experts(16, 8, 0, 256)
    assert ex.pairs(torch.zeros(22, 8)) and not ex.pairs(torch.zeros(23, 8))  # 176 pairs of 256 experts: the last
    assert not ex.pairs(torch.zeros(32, 8))  # a batch-8 verify of k = 3 (256 pairs): grouped
    ex.make_fp8(Fp8Block(128, 128))
    assert ex.pairs(torch.zeros(28, 8)) and not ex.pairs(torch.zeros(29, 8))
    few = Experts(16, 8, 0, 8)
    assert few.pairs(torch.zeros(8, 2)) and not few.pairs(torch.zeros(9, 2))


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t,e,topk,h,inter,inter_sh", [(1, 16, 4, 128, 64, 64), (3, 16, 2, 96, 48, 80),
                                                        (4, 64, 8, 256, 128, 32), (40, 16, 4, 128, 64, 96),
                                                        (70, 64, 8, 256, 128, 128)])
def test_moe_shared_in_expert_launches(dtype, tol, t, e, topk, h, inter, inter_sh, monkeypatch):
    """SparseMoE on the GPU with no EP runs routed + shared experts in the same launches: the per-pair GEMVs for
    few tokens, the grouped GEMMs (the shared expert one more key of the plan) past them."""
    import copy
    import dataclasses

    from mtp_ray.config.engine import BUNDLED_MODEL
    from mtp_ray.config.model import ModelConfig
    from mtp_ray.layers.moe import SparseMoE

    cfg = dataclasses.replace(ModelConfig.from_pretrained(BUNDLED_MODEL), hidden_size=h, num_experts=e,
                              num_experts_per_tok=topk, moe_intermediate_size=inter,
                              shared_expert_intermediate_size=inter_sh)
    g = torch.Generator().manual_seed(t * e + inter_sh)
    moe = SparseMoE(cfg)
    with torch.no_grad():
        for prm in moe.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * prm.shape[-1] ** -0.5)
    x = torch.randn(t, h, generator=g)
    ref_moe = copy.deepcopy(moe)
    with torch.no_grad():
        ref = moe(x)
        moe = moe.to(DEVICE, dtype)
        assert moe.experts.pairs(torch.zeros(t, topk)) == (t <= 8)
        if DEVICE == "cpu":  # interpreter run: take the layer's CUDA branch (its Triton kernels) on CPU tensors
            monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        out = moe(x.to(DEVICE, dtype))
        ids, w = moe.route(x.to(DEVICE, dtype))
    monkeypatch.undo()
    if dtype != torch.float32:  # bf16 routing may pick another expert at a near-tie: the reference takes its pick
        ref_moe.route = lambda _: (ids.cpu(), w.cpu().float())
        with torch.no_grad():
            ref = ref_moe(x)
    assert out.dtype == dtype and _rel(out.cpu(), ref) < tol


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("m,n,k", [(1, 32, 128), (4, 8192, 2048), (16, 2048, 4096), (3, 100, 96), (1, 1000, 600),
                                   (1, 12352, 2048), (8, 256, 2048)])  # the last: split-K by default (bf16)
def test_gemv(dtype, tol, m, n, k):
    from mtp_ray.layers.linear import Linear
    from mtp_ray.layers.triton.linear import gemv

    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k**-0.5
    out = gemv(x.to(DEVICE, dtype), w.to(DEVICE, dtype))
    assert out.dtype == dtype and _rel(out.cpu(), x @ w.T) < tol
    lin = Linear(k, n, bias=False).to(DEVICE, dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        assert _rel(lin(x.to(DEVICE, dtype)).cpu(), x @ w.T) < tol
    if m == 1 and dtype == torch.bfloat16:  # the one-row kernel at other tiles (the sweep's space) agrees too
        for tile in [("row", 2, 256, 2, 1, 1), ("row", 16, 1024, 8, 3, 1)]:
            assert _rel(gemv(x.to(DEVICE, dtype), w.to(DEVICE, dtype), tile).cpu(), x @ w.T) < tol


@needs_device
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("m,n,k,split", [(4, 256, 2048, 8), (8, 2048, 4096, 2), (3, 100, 600, 4), (16, 48, 1030, 3),
                                         (2, 40, 96, 4)])
def test_gemv_split_k(dtype, tol, m, n, k, split):
    """Split-K tiles: each K part's fp32 partial summed by the tile's last program in split order, so the result
    is the product (any K, ragged or shorter than the split) and the same bits every launch; the arrival counters
    are back at zero after each launch (the next launch, any shape, counts from zero)."""
    from mtp_ray.layers.triton.linear import _counter_bufs, gemv

    g = torch.Generator().manual_seed(m * n + k + split)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k**-0.5
    xd, wd = x.to(DEVICE, dtype), w.to(DEVICE, dtype)
    tile = ("dot", 16 if dtype == torch.float32 else 32, 128, 4, 3, split)
    a, b = gemv(xd, wd, tile), gemv(xd, wd, tile)
    assert a.dtype == dtype and _rel(a.cpu(), x @ w.T) < tol
    assert torch.equal(a, b)
    assert int(_counter_bufs[xd.device].abs().sum()) == 0


@needs_device
@pytest.mark.parametrize("b,k,width,bs", [(1, 3, 4, 16), (5, 1, 3, 4), (8, 2, 6, 8), (33, 3, 5, 16)])
def test_feed_in_flight(b, k, width, bs):
    """The fused async-verify feed moves exactly what the torch ops move: rows following an in-flight verify
    (src >= 0) by its accepted count, the other rows left as the host wrote them."""
    from mtp_ray.engine.graph_ops import feed_in_flight_torch
    from mtp_ray.engine.inputs import uniform_layout
    from mtp_ray.layers.triton.graph_ops import feed_in_flight as fused

    q, max_b = k + 1, b + 3
    g = torch.Generator().manual_seed(b * 100 + k)
    layout = uniform_layout(b, q, width, spec=True)
    flat = torch.randint(1, 1000, (layout.total,), generator=g)
    v = layout.views(flat)
    v["tables"].copy_(torch.randint(1, 50, (b, width), generator=g))
    v["ctx"].copy_(torch.randint(1, width * bs - 2 * q, (b,), generator=g))  # room for q + k positions
    src = torch.randint(-1, max_b, (b,), generator=g)
    src[0] = 0  # at least one live row, one exact row
    src[-1] = -1 if b > 1 else 0
    last = torch.randint(0, k + 1, (max_b,), generator=g)
    next_ids = torch.randint(0, 2048, (max_b * q,), generator=g)
    drafts = torch.randint(0, 2048, (max_b, k), generator=g)
    ref = flat.clone()
    feed_in_flight_torch(layout.views(ref), src, last, next_ids, drafts, q, k, bs)
    assert not torch.equal(ref, flat)
    got = flat.to(DEVICE)
    fused(layout.views(got), *(t.to(DEVICE) for t in (src, last, next_ids, drafts)), q, k, bs)
    assert torch.equal(got.cpu(), ref)


@needs_device
@pytest.mark.parametrize("b,k,vocab", [(1, 3, 2048), (4, 0, 2048), (3, 2, 9000), (17, 1, 300), (2, 3, 70000),
                                         (1, 3, 248320)])
def test_greedy_block(b, k, vocab):
    """The fused argmax / log-prob / acceptance block equals the torch ops: ties broken to the first max (rounded
    logits make ties, also across the kernel's vocabulary blocks), accepted counts from 0 to k."""
    from mtp_ray.engine.graph_ops import greedy_block_torch
    from mtp_ray.layers.triton.graph_ops import greedy_block as fused

    q = k + 1
    g = torch.Generator().manual_seed(b * vocab + k)
    logits = (torch.randn(b * q, vocab, generator=g) * 4).round()  # few distinct values: ties
    logits[0, vocab - 1] = logits[0, 0] = logits.max() + 1  # a tie between the first and the last block
    ids = logits.argmax(-1)
    inp = torch.randint(0, vocab, (b * q,), generator=g)
    for r in range(b):  # sequence r's drafts match the argmax except draft r % (k + 1): it accepts r % (k + 1)
        for j in range(k):
            inp[r * q + j + 1] = ids[r * q + j] + (j == r % q)
    last, nxt = torch.full((b + 2,), 7), torch.full((b * q + 3,), 7)
    ref = greedy_block_torch(logits, inp, q, k, last, nxt)
    if k:
        assert ref[:, 2 * q].tolist() == [r % q for r in range(b)]
    last_d, nxt_d = last.new_full((b + 2,), 7).to(DEVICE), nxt.new_full((b * q + 3,), 7).to(DEVICE)
    got = fused(logits.to(DEVICE), inp.to(DEVICE), q, k, last_d, nxt_d).cpu()
    assert got.shape == ref.shape and torch.equal(got[:, :q], ref[:, :q])
    assert torch.equal(got[:, 2 * q :], ref[:, 2 * q :])
    assert torch.allclose(got[:, q : 2 * q], ref[:, q : 2 * q], atol=1e-5)
    assert torch.equal(last_d.cpu(), last) and torch.equal(nxt_d.cpu(), nxt)


@needs_device
@pytest.mark.parametrize("n,vocab,dtype", [(1, 248320, torch.bfloat16), (3, 32768, torch.bfloat16),
                                           (5, 9000, torch.float32), (2, 300, torch.bfloat16)])
def test_argmax_ids(n, vocab, dtype):
    """The draft loop's two-launch argmax equals torch.argmax: the first max on ties, also across its blocks."""
    from mtp_ray.layers.triton.graph_ops import argmax_ids

    g = torch.Generator().manual_seed(n * vocab)
    logits = (torch.randn(n, vocab, generator=g) * 4).round().to(dtype)  # few distinct values: ties
    logits[0, vocab - 1] = logits[0, 0] = logits.max() + 1  # a tie between the first and the last block
    assert torch.equal(argmax_ids(logits.to(DEVICE)).cpu(), logits.argmax(-1))


@needs_device
@pytest.mark.parametrize("b,k,width,bs", [(1, 3, 4, 16), (5, 1, 3, 4), (8, 2, 6, 8), (33, 4, 5, 16)])
def test_draft_rows(b, k, width, bs):
    """The draft loop's rows, positions and KV slots in one launch equal the torch ops."""
    from mtp_ray.engine.graph_ops import draft_rows_torch
    from mtp_ray.layers.triton.graph_ops import draft_rows

    g = torch.Generator().manual_seed(b * 10 + k)
    tables = torch.randint(1, 50, (b, width), generator=g)
    ctx = torch.randint(1, width * bs - 2 * (k + 1), (b,), generator=g)
    last = torch.randint(0, k + 1, (b + 2,), generator=g)
    ref = draft_rows_torch(ctx, last, tables, k + 1, k, bs)
    got = draft_rows(ctx.to(DEVICE), last.to(DEVICE), tables.to(DEVICE), k + 1, k, bs)
    for r, x in zip(ref, got):
        assert x.shape == r.shape and torch.equal(x.cpu(), r)
