"""The bundled tiny model: loads offline, generates code-like text, and its MTP head agrees with the target."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.config.engine import BUNDLED_MODEL
from mtp_ray.model.loader import load_model
from mtp_ray.prompts import load_tokenizer
from tests.helpers import PagedSeqs, positions_for

HELDOUT = Path(__file__).parent / "data" / "heldout.py.txt"


def test_bundled_model_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in Path(BUNDLED_MODEL).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert sum(files.values()) <= 10 * 2**20
    assert json.loads((Path(BUNDLED_MODEL) / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"


def test_bundled_model_greedy_generates_code():
    llm = LLM(max_num_seqs=4)
    out = llm.generate(["import os\n\n\ndef ", "class Config:\n    def __init__(self"],
                       SamplingParams(temperature=0, max_tokens=40))
    for o in out:
        text = o.outputs[0].text
        print(repr(o.prompt + text))
        assert len(o.outputs[0].token_ids) >= 10
        assert text.isascii() and any(c in text for c in "():=")


@torch.no_grad()
def test_mtp_first_draft_agreement_on_heldout_text():
    """argmax of the MTP head at i (fed token i+1 and h[i]) vs the target's argmax at i+1, on held-out stdlib
    source; the floor is the share of positions where the target predicts its single most frequent token."""
    tok = load_tokenizer(BUNDLED_MODEL)
    ids = tok.encode(HELDOUT.read_text(), add_special_tokens=False)
    model = load_model(BUNDLED_MODEL)
    win, n_win = 256, 8
    agree = floor = total = 0
    for w in range(n_win):
        seq = ids[w * win : (w + 1) * win]
        cache = PagedSeqs(model, 1, win + 8, block_size=16)
        parts = [(0, 0, win)]
        pos = positions_for(parts)
        hidden = model(torch.tensor(seq), pos, cache.batch(parts))
        target = model.compute_logits(hidden).argmax(-1)  # [win]: prediction for position i + 1
        # MTP at i sees token i + 1 and h[i]; compare with the target's prediction at i + 1
        m = model.mtp_forward(torch.tensor(seq[1:]), hidden[:-1], pos[:-1], cache.batch([(0, 0, win - 1)]))
        draft = model.compute_logits(m).argmax(-1)
        agree += (draft[:-1] == target[1:-1]).sum().item()
        floor += (target[1:-1] == target[1:-1].mode().values).sum().item()
        total += win - 2
    agreement, base = agree / total, floor / total
    print(f"MTP first-draft agreement {agreement:.3f}, constant-guess floor {base:.3f}")
    assert agreement >= 0.6
    assert agreement >= base + 0.3
