"""FP8 block-quantized checkpoints (Qwen's published format), CPU: a test-made FP8 checkpoint loads to exactly the
weights of its dequantized checkpoint and serves the same tokens, k = 0 and 3, dp = 1 and 2; malformed ones are
errors that name the tensor or field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_ray import LLM, SamplingParams
from mtp_ray.layers.fp8 import Fp8Weight, dequantize
from mtp_ray.model.fp8 import fp8_weights
from mtp_ray.model.loader import load_model
from tests.helpers import edit_checkpoint, make_checkpoint

BLOCK = [16, 12]  # small blocks so that the tiny weights span several, with partial ones at the edges
KEEP = ("embed_tokens", "lm_head", "mlp.gate.", "shared_expert_gate", "norm", "conv1d")  # modules_to_not_convert
PROMPTS = [[5, 17, 60, 31], list(range(20, 60)), [9] * 13, [70, 71, 72, 3, 77, 78] * 4]


def quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block e4m3 quantization, block by block (a reference independent of the loader's broadcast): returns
    (q float8 [..., N, K], scale_inv fp32 [..., N / bn, K / bk], dequantized fp32 [..., N, K])."""
    bn, bk = block
    n, k = w.shape[-2:]
    w = w.float()
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    deq = torch.empty_like(w)
    scale = torch.empty(*w.shape[:-2], -(-n // bn), -(-k // bk))
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            blk = w[..., rows, cols]
            s = blk.abs().amax(dim=(-2, -1)).clamp(min=1e-8) / 448.0  # e4m3's largest finite value
            q[..., rows, cols] = (blk / s[..., None, None]).to(torch.float8_e4m3fn)
            deq[..., rows, cols] = q[..., rows, cols].float() * s[..., None, None]
            scale[..., i, j] = s
    return q, scale, deq


def quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() >= 2 and not any(k in name for k in KEEP)


def fp8_pair(src: Path, fp8: Path, deq: Path, block: list[int] = BLOCK) -> None:
    """From a bf16 / fp32 checkpoint: its FP8 version (quantization_config + scales) and the dequantized one."""
    for out in (fp8, deq):
        shutil.copytree(src, out)
    sd = load_file(src / "model.safetensors")
    q_sd, d_sd = {}, {}
    for name, t in sd.items():
        if not quantized(name, t):
            q_sd[name] = d_sd[name] = t
            continue
        q, s, d = quantize(t, block)
        q_sd[name], q_sd[name + "_scale_inv"], d_sd[name] = q, s, d
    assert any(k.endswith(".experts.0.gate_proj.weight_scale_inv") for k in q_sd)
    assert any(k.startswith("mtp.") and k.endswith("_scale_inv") for k in q_sd)  # the MTP head too
    save_file(q_sd, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(d_sd, deq / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": block, "modules_to_not_convert": list(KEEP)}
    (fp8 / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    make_checkpoint(root / "src", "gqa2_int2", seed=11)
    fp8_pair(root / "src", root / "fp8", root / "deq")
    return root / "fp8", root / "deq"


def greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]


def weights(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight as the model multiplies it: FP8-resident ones dequantized (scales folded in, not listed)."""
    fp8 = fp8_weights(model)
    params = dict(model.named_parameters())
    out = {}
    for n, p in params.items():
        if n.endswith("_scale_inv"):
            continue
        if n in fp8:
            sname, block = fp8[n]
            p = dequantize(p, Fp8Weight(params[sname], block), dtype)
        out[n] = p
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_checkpoint_loads_the_dequantized_weights(ckpts, dtype):
    fp8, deq = ckpts
    a, b = load_model(fp8, dtype=dtype), load_model(deq, dtype=dtype)
    kept = fp8_weights(a)  # what stays FP8: every quantized projection and expert tensor, MTP head included
    assert {n for n, p in a.named_parameters() if p.dtype == torch.float8_e4m3fn} == kept.keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in kept and "mtp.fc.weight" in kept
    assert not any(k in n for n in kept for k in KEEP)
    pa, pb = weights(a, dtype), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[n], pb[n]) for n in pa), [n for n in pa if not torch.equal(pa[n], pb[n])]
    src = load_model(fp8.parent / "src", dtype=dtype)  # quantization changed them: the check is not vacuous
    assert not torch.equal(dict(src.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"],
                           pa["model.layers.0.mlp.experts.gate_up_proj"])


def test_fused_expert_fp8_checkpoint_equals_per_expert(ckpts, tmp_path):
    """Fused expert tensors [E, N, K] with [E, N / bn, K / bk] scales (each EP rank reads its experts' scales)."""
    fp8, _ = ckpts
    fused = tmp_path / "fused"
    shutil.copytree(fp8, fused)
    sd = load_file(fused / "model.safetensors")
    for p in {k.split(".experts.")[0] for k in sd if ".experts.0." in k}:
        ids = sorted({int(k.split(".experts.")[1].split(".")[0]) for k in sd if k.startswith(p + ".experts.")})
        for suffix in ("weight", "weight_scale_inv"):
            sd[f"{p}.experts.gate_up_proj" + ("_scale_inv" if suffix != "weight" else "")] = torch.stack(
                [torch.cat([sd.pop(f"{p}.experts.{e}.gate_proj.{suffix}"), sd.pop(f"{p}.experts.{e}.up_proj.{suffix}")])
                 for e in ids])
            sd[f"{p}.experts.down_proj" + ("_scale_inv" if suffix != "weight" else "")] = torch.stack(
                [sd.pop(f"{p}.experts.{e}.down_proj.{suffix}") for e in ids])
    save_file(sd, fused / "model.safetensors", metadata={"format": "pt"})
    for rng in (None, (1, 3)):  # the whole set, and an EP rank's slice
        a, b = load_model(fp8, expert_range=rng), load_model(fused, expert_range=rng)
        pb = dict(b.named_parameters())
        assert all(torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                               pb[n].view(torch.uint8) if p.dtype == torch.float8_e4m3fn else pb[n])
                   for n, p in a.named_parameters())


@pytest.mark.parametrize("k", [0, 3])
def test_fp8_serves_what_the_dequantized_checkpoint_serves(ckpts, k):
    fp8, deq = ckpts
    assert greedy(LLM(str(fp8), num_speculative_tokens=k)) == greedy(LLM(str(deq), num_speculative_tokens=k))


@pytest.mark.parametrize("k", [0, 3])
def test_fp8_dp2_group_equals_dequantized_dp1(ray_cluster, ckpts, k):
    from mtp_ray.rl.engine import launch_engine

    fp8, deq = ckpts
    want = greedy(LLM(str(deq), num_speculative_tokens=k))
    h = launch_engine({"model": str(fp8), "spec": {"num_speculative_tokens": k}, "parallel": {"dp": 2},
                       "timeouts": {"collective_s": 20, "progress_s": 30}, "warmup": "forwards"})
    try:
        sp = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
        got = ray_cluster.get([h.generate.remote(p, sp) for p in PROMPTS], timeout=300)
        assert [r["token_ids"] for r in got] == want
    finally:
        ray_cluster.get(h.shutdown.remote())


def test_fp8_group_sleeps_and_takes_bf16_updates_quantized(ray_cluster, ckpts, tmp_path):
    """RL on an FP8 checkpoint, dp = 2, k = 3: sleep(2) drops the FP8 weights and their scales; an fp32 update
    with another checkpoint's dequantized weights is quantized on load into the FP8 weights; after wake_up the
    group serves what that checkpoint's FP8 version serves, with about a third of the fp32 weight bytes."""
    from mtp_ray.rl.engine import launch_engine

    fp8, deq = ckpts
    make_checkpoint(tmp_path / "src", "gqa2_int2", seed=12)
    fp8_pair(tmp_path / "src", tmp_path / "fp8", tmp_path / "deq")
    want = greedy(LLM(str(tmp_path / "fp8"), num_speculative_tokens=3))
    h = launch_engine({"model": str(fp8), "spec": {"num_speculative_tokens": 3}, "parallel": {"dp": 2},
                       "timeouts": {"collective_s": 20, "progress_s": 30}, "warmup": "forwards"})
    sp = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    try:
        before = [r["token_ids"] for r in ray_cluster.get([h.generate.remote(p, sp) for p in PROMPTS], timeout=300)]
        awake = ray_cluster.get(h.get_stats.remote())["memory"]  # per rank: ModelRunner.memory()
        asleep = ray_cluster.get(h.sleep.remote(2))
        assert all(m["weights_bytes"] == 0 and m["asleep"] == 2 for m in asleep)
        ray_cluster.get(h.update_weights.remote(load_file(tmp_path / "deq" / "model.safetensors")), timeout=120)
        ray_cluster.get(h.wake_up.remote())
        got = [r["token_ids"] for r in ray_cluster.get([h.generate.remote(p, sp) for p in PROMPTS], timeout=300)]
        assert got == want and got != before
        fp32 = sum(p.numel() * 4 for p in load_model(deq).parameters())  # the whole model in fp32
        assert all(m["weights_bytes"] < 0.5 * fp32 for m in awake), awake
    finally:
        ray_cluster.get(h.shutdown.remote())


def test_an_fp8_weight_update_is_refused_by_name(ckpts):
    """Updates carry bf16 / fp32 weights: an FP8 tensor without its scales cannot be dequantized."""
    from mtp_ray.model.loader import WeightLoader

    loader = WeightLoader(load_model(ckpts[1]))
    with pytest.raises(ValueError, match="'model.norm.weight' has dtype torch.float8_e4m3fn; send bf16 / fp32"):
        loader.check("model.norm.weight", [32], torch.float8_e4m3fn)


W = "model.layers.0.mlp.experts.1.down_proj.weight"


@pytest.mark.parametrize("case,match", [
    ("no_scale", f"FP8 weight '{W}' has no '{W}_scale_inv'"),
    ("bad_scale", rf"{W}_scale_inv has shape \[1, 1\], expected \[2, 2\]"),
    ("no_config", "weight' is F8_E4M3 but .*config.json has no quantization_config"),
    ("method", "quant_method 'awq' is not supported"),
    ("static", "activation_scheme 'static' is not supported"),
    ("block", "weight_block_size must be two positive ints"),
    ("e5m2", f"'{W}' is F8_E5M2; FP8 checkpoints store F8_E4M3"),
])
def test_malformed_fp8_checkpoints_are_errors_naming_the_field(ckpts, tmp_path, case, match):
    fp8, _ = ckpts
    edits = {
        "no_scale": dict(tensors=lambda sd: sd.pop(W + "_scale_inv")),
        "bad_scale": dict(tensors=lambda sd: sd.update({W + "_scale_inv": torch.ones(1, 1)})),
        "no_config": dict(config=lambda c: c.pop("quantization_config")),
        "method": dict(config=lambda c: c["quantization_config"].update(quant_method="awq")),
        "static": dict(config=lambda c: c["quantization_config"].update(activation_scheme="static")),
        "block": dict(config=lambda c: c["quantization_config"].update(weight_block_size=[128])),
        "e5m2": dict(tensors=lambda sd: sd.update({W: sd[W].float().to(torch.float8_e5m2)})),
    }
    bad = edit_checkpoint(fp8, tmp_path / case, **edits[case])
    with pytest.raises(ValueError, match=match):
        load_model(bad)
    with pytest.raises(ValueError, match=match):  # the public entry point says the same
        LLM(str(bad))
