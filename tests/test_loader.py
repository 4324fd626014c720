"""Checkpoint loading: expert layouts, expert ranges, multimodal and qwen3_next checkpoints, errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_ray.model.loader import load_model
from tests.helpers import PagedSeqs, fuse_experts, make_checkpoint, positions_for, randomise


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("per_expert")
    make_checkpoint(path, "gqa2_int2", seed=5)
    return path


@torch.no_grad()
def run(model, ids: list[int], mtp: bool = False) -> torch.Tensor:
    cache = PagedSeqs(model, 1, len(ids) + 4)
    parts = [(0, 0, len(ids))]
    hidden = model(torch.tensor(ids), positions_for(parts), cache.batch(parts))
    if mtp:
        hidden = model.mtp_forward(torch.tensor(ids), hidden, positions_for(parts), cache.batch(parts))
    return model.compute_logits(hidden)


IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]


def test_fused_and_per_expert_checkpoints_load_identically(ckpt, tmp_path):
    fused = tmp_path / "fused"
    shutil.copytree(ckpt, fused)
    fuse_experts(fused)
    keys = load_file(fused / "model.safetensors").keys()
    assert any(k.endswith("experts.gate_up_proj") for k in keys) and not any(".experts.0." in k for k in keys)
    a, b = load_model(ckpt), load_model(fused)
    assert torch.equal(run(a, IDS), run(b, IDS))
    assert torch.equal(run(a, IDS, mtp=True), run(b, IDS, mtp=True))


def test_pytorch_bin_shards_load_as_safetensors_do(ckpt, tmp_path):
    """A checkpoint saved as pytorch_model-0000N-of-0000M.bin shards (no safetensors) loads the same weights, an
    expert range included; a .bin that is not a state dict of tensors is a clear error."""
    bins = tmp_path / "bins"
    bins.mkdir()
    shutil.copy(ckpt / "config.json", bins / "config.json")
    sd = load_file(ckpt / "model.safetensors")
    names = sorted(sd)
    for i, part in enumerate((names[::2], names[1::2])):
        torch.save({n: sd[n] for n in part}, bins / f"pytorch_model-0000{i + 1}-of-00002.bin")
    a, b = load_model(ckpt), load_model(bins)
    assert torch.equal(run(a, IDS), run(b, IDS)) and torch.equal(run(a, IDS, mtp=True), run(b, IDS, mtp=True))
    assert torch.equal(load_model(bins, expert_range=(1, 3)).model.layers[0].mlp.experts.gate_up_proj,
                       load_model(ckpt, expert_range=(1, 3)).model.layers[0].mlp.experts.gate_up_proj)
    torch.save({"step": 3}, bins / "pytorch_model-00002-of-00002.bin")
    with pytest.raises(ValueError, match="pytorch_model-00002-of-00002.bin"):
        load_model(bins)


def test_trunk_and_mtp_may_use_different_expert_layouts(ckpt, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(ckpt, mixed)
    sd = load_file(mixed / "model.safetensors")
    # MTP layer fused (as the reference head stores it), trunk per expert
    assert any(k.startswith("mtp.") and k.endswith("experts.gate_up_proj") for k in sd)
    assert any(k.startswith("model.") and ".experts.0.gate_proj" in k for k in sd)
    assert torch.equal(run(load_model(mixed), IDS, mtp=True), run(load_model(ckpt), IDS, mtp=True))


def test_expert_range_holds_only_owned_experts(ckpt, tmp_path):
    full = load_model(ckpt)
    fused = tmp_path / "fused"
    shutil.copytree(ckpt, fused)
    fuse_experts(fused)
    for path in (ckpt, fused):
        part = load_model(path, expert_range=(1, 3))
        for (name, p), (_, q) in zip(part.named_parameters(), full.named_parameters(), strict=False):
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                assert p.shape[0] == 2 and q.shape[0] == 4, name
                assert torch.equal(p, q[1:3]), name
            else:
                assert torch.equal(p, q), name
        n_expert = sum(p.numel() for n, p in part.named_parameters() if ".experts." in n)
        n_full = sum(p.numel() for n, p in full.named_parameters() if ".experts." in n)
        assert n_expert * 2 == n_full


def test_missing_tensor_is_named(ckpt, tmp_path):
    bad = tmp_path / "missing"
    shutil.copytree(ckpt, bad)
    sd = load_file(bad / "model.safetensors")
    del sd["model.layers.1.self_attn.k_norm.weight"]
    del sd["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(sd, bad / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load_model(bad)
    assert "model.layers.1.self_attn.k_norm.weight" in str(e.value)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in str(e.value)
    # a rank whose expert range excludes a missing expert does not need it
    sd["model.layers.1.self_attn.k_norm.weight"] = torch.zeros(8)
    save_file(sd, bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj"):
        load_model(bad, expert_range=(2, 4))
    assert load_model(bad, expert_range=(0, 2)).model.layers[0].mlp.experts.gate_up_proj.shape[0] == 2


def test_wrong_shape_is_named(ckpt, tmp_path):
    for key, shape in (("model.layers.0.linear_attn.in_proj_z.weight", (5, 32)),
                       ("mtp.layers.0.mlp.experts.down_proj", (4, 32, 15))):
        bad = tmp_path / key.replace(".", "_")
        shutil.copytree(ckpt, bad)
        sd = load_file(bad / "model.safetensors")
        sd[key] = torch.zeros(shape)
        save_file(sd, bad / "model.safetensors")
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_model(bad)


def test_missing_mtp_weights_is_a_clear_error(tmp_path):
    make_checkpoint(tmp_path, "gqa2_int2", mtp=False)
    with pytest.raises(ValueError, match="mtp"):
        load_model(tmp_path)
    assert load_model(tmp_path, with_mtp=False).mtp is None


def test_multimodal_checkpoint_loads_text_weights(ckpt, tmp_path):
    mm = tmp_path / "mm"
    mm.mkdir()
    sd = load_file(ckpt / "model.safetensors")
    sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
    sd["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    # split across two shard files, as large checkpoints are
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[::2]}, mm / "model-00001-of-00002.safetensors")
    save_file({k: sd[k] for k in keys[1::2]}, mm / "model-00002-of-00002.safetensors")
    text = json.loads((ckpt / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text,
                                                 "vision_config": {"depth": 1}}))
    assert torch.equal(run(load_model(mm), IDS, mtp=True), run(load_model(ckpt), IDS, mtp=True))


@torch.no_grad()
@pytest.mark.parametrize("norm_topk", [True, False])
def test_qwen3_next_checkpoint_matches_transformers(tmp_path, norm_topk):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=61, hidden_size=32, num_hidden_layers=4, full_attention_interval=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, intermediate_size=24, mlp_only_layers=[1],
                          norm_topk_prob=norm_topk)
    torch.manual_seed(0)
    hf = Qwen3NextForCausalLM(cfg).eval()
    randomise(hf, 7)
    hf.save_pretrained(tmp_path)
    keys = load_file(tmp_path / "model.safetensors").keys()
    assert any("in_proj_qkvz" in k for k in keys)
    ours = load_model(tmp_path, with_mtp=False)
    ids = [i % 61 for i in IDS * 6]
    ref = hf(torch.tensor([ids])).logits[0]
    assert (run(ours, ids) - ref).abs().max().item() < 1e-4


@torch.no_grad()
def test_attention_bias_config_matches_transformers(tmp_path):
    from transformers import Qwen3_5MoeForCausalLM

    from tests.helpers import hf_config

    cfg = hf_config("gqa2_int2")
    cfg.attention_bias = True
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(cfg).eval()
    randomise(hf, 3)
    hf.save_pretrained(tmp_path)
    assert any(k.endswith("q_proj.bias") for k in load_file(tmp_path / "model.safetensors"))
    ref = hf(torch.tensor([IDS])).logits[0]
    assert (run(load_model(tmp_path, with_mtp=False), IDS) - ref).abs().max().item() < 1e-4


@torch.no_grad()
def test_qwen3_5_ignores_keys_transformers_ignores(tmp_path):
    """Qwen3.5-MoE always renormalises its top-k and has no dense-MLP layers, whatever config.json says of
    norm_topk_prob / mlp_only_layers / decoder_sparse_step (Qwen3-Next's keys): as transformers does."""
    from transformers import Qwen3_5MoeForCausalLM

    from tests.helpers import hf_config

    cfg = hf_config("mha_types")
    cfg.norm_topk_prob, cfg.mlp_only_layers, cfg.decoder_sparse_step = False, [1], 2
    cfg.num_experts_per_tok = 3  # a renormalised top-3 differs from the raw probabilities
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(cfg).eval()
    randomise(hf, 5)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["norm_topk_prob"] is False
    ref = hf(torch.tensor([IDS])).logits[0]
    assert (run(load_model(tmp_path, with_mtp=False), IDS) - ref).abs().max().item() < 1e-4


def test_unused_checkpoint_tensor_is_an_error(ckpt, tmp_path):
    bad = tmp_path / "extra"
    shutil.copytree(ckpt, bad)
    sd = load_file(bad / "model.safetensors")
    sd["model.layers.0.mlp.gate.weight_scale_inv"] = torch.ones(1)
    save_file(sd, bad / "model.safetensors")
    with pytest.raises(ValueError, match="weight_scale_inv"):
        load_model(bad)


def test_fused_projections_share_the_parameters():
    """Projections of one input fused into one weight buffer: same outputs, parameters stay addressable (a weight
    update through the parameter reaches the fused GEMM), and a broken view falls back to separate GEMMs."""
    from mtp_ray.layers.linear import FusedProjections, Linear

    torch.manual_seed(0)
    layers = [Linear(16, n, bias=False) for n in (24, 8, 3)]
    x = torch.randn(5, 16)
    want = [lin(x) for lin in layers]
    f = FusedProjections(*layers)
    f.fuse()
    assert f.fused and all(w.untyped_storage().data_ptr() == f.buffer.untyped_storage().data_ptr()
                           for w in (lin.weight for lin in layers))
    with torch.no_grad():
        for got, ref in zip(f(x), want, strict=True):
            assert torch.allclose(got, ref, atol=1e-6)
        layers[1].weight.copy_(torch.ones(8, 16))  # an update by name lands in the fused buffer
        assert torch.allclose(f(x)[1], x.sum(-1, keepdim=True).expand(5, 8), atol=1e-5)
        layers[2].weight.data = layers[2].weight.data.clone()  # e.g. sleep moved it: views broken
        assert not f.fused and torch.allclose(f(x)[2], want[2], atol=1e-6)


@pytest.mark.parametrize("rows", [8, 16])
def test_fused_fp8_projections_equal_separate(rows):
    """FP8 projections fuse too (weights and scales stacked); a projection whose rows are no whole number of
    scale blocks (rows = 16: 24 rows, then 8) is followed by zero rows up to the next block, so every projection
    keeps its own block and scale rows; the same outputs, and an update by name still lands in the buffer."""
    from mtp_ray.layers.fp8 import Fp8Block, quantize
    from mtp_ray.layers.linear import FusedProjections, Linear

    torch.manual_seed(0)
    block = Fp8Block(rows, 8)
    layers = [Linear(16, n, bias=False) for n in (24, 8, 3)]
    for lin in layers:
        lin.make_fp8(block)
        q, scale = quantize(torch.randn(lin.weight.shape), block)
        with torch.no_grad():
            lin.weight.copy_(q)
            lin.weight_scale_inv.copy_(scale)
    x = torch.randn(5, 16)
    want = [lin(x) for lin in layers]
    f = FusedProjections(*layers)
    f.fuse()
    assert f.fused and f.scales is not None and all(lin.fp8_block == block for lin in layers)
    pad = 0 if rows == 8 else 8
    assert f.pads == (pad, pad, 0) and f.buffer.shape[0] == 35 + 2 * pad
    assert f.scales.shape[0] == sum(-(-n // rows) for n in (24, 8, 3))  # each projection's own scale rows
    assert f.buffer[24 : 24 + pad].float().abs().sum() == 0
    for got, ref in zip(f(x), want, strict=True):
        assert torch.allclose(got, ref, atol=1e-5)  # one GEMM against three: the same up to BLAS blocking
    with torch.no_grad():
        layers[1].weight.zero_()  # an update by name lands in the fused buffer
    assert f.fused and f(x)[1].abs().sum() == 0


def test_rope_tables_equal_per_forward_cos_sin():
    from torch import nn

    from mtp_ray.layers.rope import RotaryEmbedding, bind_rope_tables

    m = nn.ModuleList([RotaryEmbedding(8, 10000.0), RotaryEmbedding(8, 10000.0), RotaryEmbedding(16, 1e6)])
    bind_rope_tables(m, 300, torch.bfloat16, torch.device("cpu"))
    assert m[0].table is m[1].table and m[2].table is not m[0].table  # shared per (rotary_dim, theta)
    pos = torch.tensor([0, 7, 299, 150])
    for r in m:
        cos, sin = r.cos_sin(pos, torch.bfloat16)
        assert torch.equal(r.table[0][pos], cos) and torch.equal(r.table[1][pos], sin)


def test_dummy_load_format_needs_only_config_json(tmp_path):
    """load_format=dummy (vLLM's name): random weights from config.json alone, through the public LLM API; the same
    seed gives the same weights (and tokens), MTP included; a bad value is a ValueError naming the field."""
    from mtp_ray import LLM, SamplingParams
    from mtp_ray.config.engine import BUNDLED_MODEL, EngineConfig

    shutil.copy(f"{BUNDLED_MODEL}/config.json", tmp_path / "config.json")  # no weights, no tokenizer
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 200, 31], [9] * 7]

    def tokens(**kw):
        llm = LLM(str(tmp_path), load_format="dummy", num_speculative_tokens=2, **kw)
        assert llm.tokenizer is None  # token ids in, token ids out
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)], llm

    a, llm = tokens(seed=3)
    assert all(len(t) == 6 for t in a)
    b, _ = tokens(seed=3)
    assert a == b
    params = dict(llm.engine.runner.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    w = next(p for n, p in params.items() if "experts" in n).detach()
    assert 0.01 < float(w.float().std()) < 0.03  # N(0, 0.02), not zeros or garbage
    _, other = tokens(seed=4)
    assert not torch.equal(next(other.engine.runner.model.parameters()), next(llm.engine.runner.model.parameters()))
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig.from_dict({"load_format": "safetensor"})
    with pytest.raises(FileNotFoundError):  # the default format still wants the weights
        LLM(str(tmp_path))


@pytest.mark.parametrize("change,field", [
    ({"head_dim": 12, "partial_rotary_factor": 0.25}, "head_dim 12 x partial_rotary_factor = 3"),
    ({"num_key_value_heads": 3}, "num_key_value_heads (3)"),
    ({"linear_num_key_heads": 3}, "linear_num_key_heads (3)"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok (9)"),
])
def test_an_impossible_config_names_its_fields_and_values(tmp_path, change, field):
    """A config.json whose shapes cannot work is refused before any weight is read, with the fields and their values
    (through the public LLM entry point)."""
    from mtp_ray import LLM
    from tests.helpers import hf_config

    cfg = hf_config("gqa2_int2").to_dict()
    rope = dict(cfg["rope_parameters"], partial_rotary_factor=change.pop("partial_rotary_factor", 0.25))
    cfg.update(change, rope_parameters=rope)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=re.escape(field)):
        LLM(str(tmp_path), load_format="dummy")
