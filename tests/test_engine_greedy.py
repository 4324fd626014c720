"""Single-rank engine, greedy: equal to transformers' generate, invariant to chunking, preemption and MTP k."""

from __future__ import annotations

import pytest
import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.config.engine import BUNDLED_MODEL
from tests.helpers import CONFIGS, make_checkpoint


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def random_ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"rand_engine_{request.param}")
    hf, _ = make_checkpoint(path, request.param, seed=11)
    return path, hf


@pytest.fixture(scope="module")
def bundled_hf():
    from transformers import Qwen3_5MoeForCausalLM

    return Qwen3_5MoeForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 23, 70, 9, 41)]


@torch.no_grad()
def hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def greedy(llm: LLM, prompts, n: int, **kw) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, **kw))]


SMALL = dict(block_size=4, prefill_chunk=8, max_num_batched_tokens=24, max_num_seqs=4)


def test_random_model_matches_transformers_chunked_and_preempted(random_ckpt):
    path, hf = random_ckpt
    prompts = mixed_prompts(97)
    ref = hf_greedy(hf, prompts, 16)
    llm = LLM(str(path), tokenizer=BUNDLED_MODEL, **SMALL)
    assert greedy(llm, prompts, 16) == ref
    # few blocks: running requests get preempted and recomputed; outputs must not change
    tight = LLM(str(path), tokenizer=BUNDLED_MODEL, num_blocks=34, max_model_len=120, **SMALL)
    assert greedy(tight, prompts, 16) == ref
    assert tight.engine.scheduler.num_preemptions > 0


def test_bundled_model_matches_transformers(bundled_hf):
    prompts = [[5, 17, 200, 31], list(range(40, 100)), [9] * 13, [300, 301, 302, 1000, 77, 78]]
    ref = hf_greedy(bundled_hf, prompts, 24)
    llm = LLM(**SMALL)
    assert greedy(llm, prompts, 24) == ref
    tight = LLM(num_blocks=30, max_model_len=100, **SMALL)
    assert greedy(tight, prompts, 24) == ref
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_is_token_identical_to_no_mtp_on_random_model(random_ckpt, k):
    """A random MTP head: almost every draft is rejected, the output must still be the target's."""
    path, _ = random_ckpt
    prompts = mixed_prompts(97, seed=k)
    base = greedy(LLM(str(path), tokenizer=BUNDLED_MODEL, **SMALL), prompts, 20)
    llm = LLM(str(path), tokenizer=BUNDLED_MODEL, num_speculative_tokens=k, **SMALL)
    assert greedy(llm, prompts, 20) == base
    assert llm.engine.stats.verify_steps > 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_is_token_identical_to_no_mtp_on_bundled_model(k):
    """Long prompts prefill in chunks of 8 while earlier requests already decode with drafts."""
    llm0 = LLM(**SMALL)
    tok = llm0.tokenizer
    texts = ["import os\n\ndef main():\n", "class A:\n    def __init__(self, x):\n        self.x = x\n" * 3,
             "for i in range(10):\n", "# comment\n" * 12, "return"]
    prompts = [tok.encode(t) for t in texts]
    base = greedy(llm0, prompts, 32)
    llm = LLM(num_speculative_tokens=k, **SMALL)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    assert [o.outputs[0].token_ids for o in outs] == base
    stats = llm.engine.stats
    assert stats.accepted > 0.3 * stats.drafted, stats  # a trained head: many drafts accepted
    spec = outs[1].outputs[0].spec
    assert spec["num_draft_tokens"] > 0 and spec["mean_acceptance_length"] > 1.0
    assert len(spec["accepted_per_pos"]) == k


def test_mtp_under_preemption_is_unchanged():
    prompts = [list(range(10, 10 + n)) for n in (30, 7, 44, 12)]
    base = greedy(LLM(**SMALL), prompts, 24)
    tight = LLM(num_speculative_tokens=3, num_blocks=32, max_model_len=100, **SMALL)
    assert greedy(tight, prompts, 24) == base
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("k", [1, 3])
def test_seeded_mtp_sample_is_unchanged_by_preemption(k):
    """A preempted request keeps its drafts (their draws are already taken from its seeded generator) and verifies
    them after the recompute: a seeded sample at k > 0 is the same whether or not the cache ran out. (Before, the
    recompute sampled afresh and the output changed from the preemption on.)"""
    prompts = [[100 + i for i in range(30)], [700 + i for i in range(30)], list(range(40, 53))]
    sp = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=24, ignore_eos=True) for i in range(2)]
    sp.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    common = dict(num_speculative_tokens=k, enable_prefix_caching=False, block_size=8, max_model_len=64,
                  max_num_seqs=3)
    base = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sp)]
    for num_blocks in (13, 15):
        tight = LLM(num_blocks=num_blocks, **common)
        assert [o.outputs[0].token_ids for o in tight.generate(prompts, sp)] == base, num_blocks
        assert tight.engine.scheduler.num_preemptions > 0, num_blocks


def test_checkpoint_without_tokenizer_serves_token_ids(random_ckpt):
    path, hf = random_ckpt
    llm = LLM(str(path))  # save_pretrained wrote no tokenizer files
    assert llm.tokenizer is None
    prompts = mixed_prompts(97)[:3]
    assert greedy(llm, prompts, 8) == hf_greedy(hf, prompts, 8)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text needs a tokenizer", SamplingParams(max_tokens=2))


@pytest.mark.parametrize("k", [0, 2])
def test_split_prefill_steps_same_tokens_more_uniform_steps(k):
    """Prefill and decode in separate steps (the policy used with CUDA graphs): same greedy tokens as mixed steps,
    and no forward mixes decodes with prefill pieces (so decode steps stay graph-eligible) while new requests are
    admitted mid-flight."""
    prompts = mixed_prompts(2048, seed=5) * 2
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    runs = {}
    for split in (False, True):
        llm = LLM(num_speculative_tokens=k, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=32,
                  split_prefill=split)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runs[split] = (outs, llm.engine.stats.mixed_batch_steps)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == 0 < runs[False][1], runs


def test_a_step_is_counted_by_its_sync_and_carries_the_callers_command():
    """The step owns its state (issue 62): EngineCore.step puts the caller's next_cmd into its DPMeta and ends in
    its sync, which counts it; nobody writes either from outside (the rank worker publishes with `sync.step` and
    DPMeta.step is compared across ranks). The warmup's steps are not counted, at start or on a re-warm."""
    from mtp_ray.config.flat import engine_config
    from mtp_ray.config.model import ModelConfig
    from mtp_ray.engine.core import EngineCore
    from mtp_ray.parallel.context import DistContext
    from mtp_ray.parallel.sync import DPSync

    cfg = engine_config(num_speculative_tokens=1, max_num_seqs=8, device="cpu", dtype="float32")
    ctx = DistContext(0, 1, ModelConfig.from_pretrained(cfg.model).num_experts, torch.device("cpu"), 10.0)
    sync = DPSync(ctx)  # a group of one: the lock-step path, no collective
    core = EngineCore(cfg, sync=sync)
    core.warmup()
    assert sync.step == 0 and sync.last is not None and sync.last.ranks[0].step == 0
    core.add_request("a", [5, 17, 200, 31], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for n in range(6):
        core.step(next_cmd=n % 3)  # 0: no command held
        meta = sync.step_table.ranks[0]
        assert (meta.step, meta.next_cmd, sync.step) == (n, n % 3, n + 1)
        assert sync.step_table.command_ready == n % 3
    assert not core.has_unfinished()  # steps without work are counted too (the group still gathered)
    core.warmup()  # wake_up re-warms mid-serving: the count goes on from where it was
    assert sync.step == 6
    core.step()
    assert sync.step_table.ranks[0].step == 6 and sync.step == 7
