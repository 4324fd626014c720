"""mtp-ray's model against transformers' Qwen3_5MoeForCausalLM on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from mtp_ray.model.loader import load_model
from tests.helpers import CONFIGS, PagedSeqs, make_checkpoint, positions_for

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, head = make_checkpoint(path, request.param, seed=len(request.param))
    return path, hf, head, load_model(path)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def test_full_prefill_matches_transformers(pair):
    """Several prompts of mixed lengths (one > 64 so the chunked GDN form spans chunks) in one flat forward."""
    _, hf, _, ours = pair
    ps = prompts(ours.config.vocab_size, [1, 7, 70, 19])
    cache = PagedSeqs(ours, len(ps), 80)
    parts = [(b, 0, len(p)) for b, p in enumerate(ps)]
    ids = torch.tensor([t for p in ps for t in p])
    logits = ours.compute_logits(ours(ids, positions_for(parts), cache.batch(parts)))
    start = 0
    for p in ps:
        ref = hf_logits(hf, p)
        got = logits[start : start + len(p)]
        assert (got - ref).abs().max().item() < TOL
        start += len(p)


@torch.no_grad()
def test_prefill_then_decode_matches_transformers(pair):
    """Chunked prefill (chunks of 5 mixed with other sequences' decodes), then token-by-token decode with our
    paged KV and GDN state: every position's logits equal transformers' full forward of the same sequence."""
    _, hf, _, ours = pair
    full = prompts(ours.config.vocab_size, [23, 12, 30], seed=1)
    prompt_len = [11, 5, 17]
    cache = PagedSeqs(ours, len(full), 40)
    got: list[list[torch.Tensor]] = [[] for _ in full]
    done = [0] * len(full)
    while any(d < len(s) for d, s in zip(done, full, strict=False)):
        parts = []
        for b, s in enumerate(full):
            if done[b] < len(s):  # prefill in chunks of 5 up to prompt_len, then one token per step
                n = min(5, prompt_len[b] - done[b]) if done[b] < prompt_len[b] else 1
                parts.append((b, done[b], n))
        ids = torch.tensor([full[b][t] for b, c, n in parts for t in range(c, c + n)])
        logits = ours.compute_logits(ours(ids, positions_for(parts), cache.batch(parts)))
        i = 0
        for b, _c, n in parts:
            got[b].extend(logits[i : i + n])
            i += n
            done[b] += n
    for b, s in enumerate(full):
        ref = hf_logits(hf, s)
        assert (torch.stack(got[b]) - ref).abs().max().item() < TOL, f"sequence {b}"


@torch.no_grad()
def test_mtp_head_matches_transformers_modules(pair):
    """Our MTP head (prefill over all positions, then decode steps with its own KV cache) against the reference
    built from transformers' decoder layer (layer_types=['full_attention']), norms and fc."""
    _, hf, head, ours = pair
    n, h = 13, ours.config.hidden_size
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, h, generator=g)
    nxt = torch.randint(0, ours.config.vocab_size, (n,), generator=g)
    pos = torch.arange(n)
    for step in range(len(head.layers)):  # with several MTP layers, draft step j runs layer j
        ref = head(hf.model.embed_tokens(nxt)[None], hidden[None], pos[None], step)[0]
        cache = PagedSeqs(ours, 1, 16)
        pre = 9
        out = [ours.mtp_forward(nxt[:pre], hidden[:pre], pos[:pre], cache.batch([(0, 0, pre)]), step)]
        for t in range(pre, n):
            out.append(ours.mtp_forward(nxt[t : t + 1], hidden[t : t + 1], pos[t : t + 1],
                                        cache.batch([(0, t, 1)]), step))
        got = torch.cat(out)
        assert (got - ref).abs().max().item() < TOL, f"MTP step {step}"
        assert (ours.compute_logits(got) - hf.lm_head(ref)).abs().max().item() < TOL
