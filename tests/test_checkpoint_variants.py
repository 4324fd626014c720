"""Checkpoint variants transformers loads and mtp-ray must load the same way (tied embeddings in their forms, a
zero-width shared expert, per-tensor FP8 scales, an index beside stale files), and broken checkpoints that must be
errors naming the file, tensor or field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_ray import LLM, SamplingParams
from mtp_ray.model.loader import load_model
from tests.helpers import edit_checkpoint, hf_config, make_checkpoint, randomise

PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("variants") / "base"
    make_checkpoint(path, "gqa2_int2", seed=21)
    return path


def greedy(path: Path, k: int = 0) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(str(path), num_speculative_tokens=k).generate(PROMPTS, GREEDY)]


def test_tied_embeddings_in_every_stored_form(ckpt, tmp_path):
    """tie_word_embeddings with: the embedding only (tied); the lm_head only (transformers ties from it); both,
    equal (a .bin of a tied model: tied); both, different (transformers unties them: each keeps its own)."""
    sd = load_file(ckpt / "model.safetensors")
    emb, head = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    tie = dict(config=lambda c: c.update(tie_word_embeddings=True))
    forms = {"embed_only": lambda s: s.pop("lm_head.weight"),
             "head_only": lambda s: s.pop("model.embed_tokens.weight"),
             "both_equal": lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()})}
    for form, change in forms.items():
        m = load_model(edit_checkpoint(ckpt, tmp_path / form, tensors=change, **tie))
        assert m.lm_head.weight is m.model.embed_tokens.weight, form
        assert torch.equal(m.lm_head.weight, head if form == "head_only" else emb), form
    m = load_model(edit_checkpoint(ckpt, tmp_path / "both_different", **tie))
    assert m.lm_head.weight is not m.model.embed_tokens.weight
    assert torch.equal(m.lm_head.weight, head) and torch.equal(m.model.embed_tokens.weight, emb)
    assert greedy(tmp_path / "both_different") == greedy(ckpt)  # the untied checkpoint's output


def test_a_multimodal_checkpoint_ties_by_its_top_level_flag(ckpt, tmp_path):
    """Qwen3_5MoeForConditionalGeneration ties by the wrapper's tie_word_embeddings (default False); save_pretrained
    writes text_config's as well (False), which must not decide it."""
    sd = {("model.language_model." + k[6:] if k.startswith("model.") else k): v
          for k, v in load_file(ckpt / "model.safetensors").items()}
    text = json.loads((ckpt / "config.json").read_text())
    for top, stored_head in ((True, False), (False, True)):
        out = tmp_path / f"mm_{top}"
        out.mkdir()
        save_file({k: v for k, v in sd.items() if stored_head or k != "lm_head.weight"}, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "tie_word_embeddings": top,
                                                     "text_config": {**text, "tie_word_embeddings": not top}}))
        m = load_model(out)
        assert (m.lm_head.weight is m.model.embed_tokens.weight) == top
        want = sd["model.language_model.embed_tokens.weight" if top else "lm_head.weight"]
        assert torch.equal(m.lm_head.weight, want)


@torch.no_grad()
def test_a_zero_width_shared_expert_loads_as_transformers_builds_it(tmp_path):
    """shared_expert_intermediate_size 0: transformers saves [0, H] / [H, 0] projections and a gate; they add
    nothing. A real shared expert under a config that says 0 is an error naming it."""
    from transformers import Qwen3_5MoeForCausalLM

    cfg = hf_config("gqa2_int2")
    cfg.shared_expert_intermediate_size = 0
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(cfg).eval()
    randomise(hf, 4)
    hf.save_pretrained(tmp_path / "zero")
    keys = load_file(tmp_path / "zero" / "model.safetensors")
    assert keys["model.layers.0.mlp.shared_expert.down_proj.weight"].numel() == 0
    ref = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=False)[0, len(PROMPTS[0]):].tolist()
    out = LLM(str(tmp_path / "zero")).generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    assert out == ref
    real = tmp_path / "real"
    make_checkpoint(real, "gqa2_int2", mtp=False)
    edit_checkpoint(real, tmp_path / "says_zero", config=lambda c: c.update(shared_expert_intermediate_size=0))
    with pytest.raises(ValueError, match=r"shared_expert\..*shared_expert_intermediate_size is 0"):
        load_model(tmp_path / "says_zero", with_mtp=False)


@pytest.mark.parametrize("shape", [[1], []])
def test_per_tensor_fp8_scales_of_one_element_or_none(ckpt, tmp_path, shape):
    """quantization_config without weight_block_size: one scale per tensor, stored as [1] or as a 0-dim tensor
    (both are written by exporters); dequantized on load, so the output is the dequantized checkpoint's."""
    w = "model.layers.1.self_attn.o_proj.weight"
    sd = load_file(ckpt / "model.safetensors")
    s = sd[w].abs().amax() / 448.0
    q = (sd[w] / s).to(torch.float8_e4m3fn)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    fp8 = edit_checkpoint(ckpt, tmp_path / "fp8", config=lambda c: c.update(quantization_config=qc),
                          tensors=lambda d: d.update({w: q, w + "_scale_inv": s.reshape(shape)}))
    deq = edit_checkpoint(ckpt, tmp_path / "deq", tensors=lambda d: d.update({w: q.float() * s}))
    assert torch.equal(load_model(fp8).state_dict()[w], load_model(deq).state_dict()[w])
    assert greedy(fp8, k=2) == greedy(deq, k=2)


def test_an_index_names_the_files_that_are_the_checkpoint(ckpt, tmp_path):
    """With model.safetensors.index.json only the files it names are read (a stale file beside them is not part
    of the checkpoint, as in transformers / vLLM); a file it names that is missing is an error naming the file."""
    sd = load_file(ckpt / "model.safetensors")
    keys = sorted(sd)
    out = tmp_path / "sharded"
    shutil.copytree(ckpt, out)
    (out / "model.safetensors").rename(out / "stale.safetensors")  # the old single file stays behind
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for f, names in shards.items():
        save_file({k: sd[k] for k in names}, out / f)
    index = {"metadata": {}, "weight_map": {k: f for f, names in shards.items() for k in names}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    assert greedy(out) == greedy(ckpt)
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        LLM(str(out))


@pytest.mark.parametrize("case,match", [
    ("truncated", r"model.safetensors: not a readable safetensors file"),
    ("config_json", r"config.json: not valid JSON"),
    ("generation_json", r"generation_config.json: not valid JSON"),
    ("no_field", r"required field 'linear_num_key_heads' is missing"),
    ("null_field", r"invalid model config: .*wrong type or is null"),
    ("int_tensor", r"'model.layers.0.linear_attn.A_log' is I32; weights are floating-point"),
    ("mtp_zero", r"num_speculative_tokens \(2\) needs the model's MTP head"),
])
def test_broken_checkpoints_are_errors_naming_the_file_tensor_or_field(ckpt, tmp_path, case, match):
    out = tmp_path / case
    shutil.copytree(ckpt, out)
    cfg_path, st = out / "config.json", out / "model.safetensors"
    cfg = json.loads(cfg_path.read_text())
    if case == "truncated":
        st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    elif case == "config_json":
        cfg_path.write_text(cfg_path.read_text()[:-3])
    elif case == "generation_json":
        (out / "generation_config.json").write_text("{eos_token_id: 1}")
    elif case in ("no_field", "null_field"):
        if case == "no_field":
            cfg.pop("linear_num_key_heads")
        else:
            cfg["num_experts"] = None
        cfg_path.write_text(json.dumps(cfg))
    elif case == "int_tensor":
        sd = load_file(st)
        sd["model.layers.0.linear_attn.A_log"] = sd["model.layers.0.linear_attn.A_log"].to(torch.int32)
        save_file(sd, st)
    elif case == "mtp_zero":
        cfg["mtp_num_hidden_layers"] = 0
        cfg_path.write_text(json.dumps(cfg))
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        LLM(str(out), num_speculative_tokens=2)


def test_tokenizer_end_token_read_from_the_files(tmp_path):
    """The tokenizer's own end token (no stop_reason when it stops a request) from tokenizer_config.json's
    eos_token, named in its added_tokens_decoder or in tokenizer.json's added tokens; None without the files."""
    from mtp_ray.config.model import tokenizer_eos_id

    assert tokenizer_eos_id(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert tokenizer_eos_id(tmp_path) is None  # named, but no file gives its id
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 7, "content": "<|im_end|>"}]}))
    assert tokenizer_eos_id(tmp_path) == 7
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "added_tokens_decoder": {"151645": {"content": "<|im_end|>"}}}))
    assert tokenizer_eos_id(tmp_path) == 151645
    (tmp_path / "tokenizer_config.json").write_text("[1]")
    assert tokenizer_eos_id(tmp_path) is None
