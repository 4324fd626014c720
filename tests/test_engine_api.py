"""Offline API: sampling features, stops, n > 1, seeds, logprobs, abort, and bad input."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.engine.sampling_params import SamplingParams as SP


@pytest.fixture(scope="module")
def llm():
    return LLM(num_speculative_tokens=2, block_size=4, prefill_chunk=16, max_model_len=256)


PROMPT = "def parse(self, text):\n    "


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, n=3)
    a = llm.generate(PROMPT, sp)[0]
    b = llm.generate(PROMPT, sp)[0]
    assert len(a.outputs) == 3
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_top_k_one_and_min_p_one_are_greedy(llm):
    g = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    for sp in (SamplingParams(temperature=0.8, top_k=1, max_tokens=16, seed=3),
               SamplingParams(temperature=0.8, min_p=1.0, max_tokens=16, seed=4)):
        assert llm.generate(PROMPT, sp)[0].outputs[0].token_ids == g


def test_stop_strings_stop_token_ids_and_max_tokens(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    # a stop string taken from the middle of the greedy text
    stop = base.text[8:11]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True))[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == base.text[: base.text.index(stop)]
    tid = base.token_ids[5]
    o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tid]))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == tid
    assert o.token_ids == base.token_ids[: base.token_ids.index(tid) + 1]


def test_stop_reason_of_each_end_token(llm):
    """As vLLM: the tokenizer's end token (the bundled model's <|endoftext|>, 0) stops with no stop_reason; an end
    token generation_config.json adds (<|im_end|>, 2) stops with its id, as a stop_token_ids entry would."""
    for tid, reason in ((0, None), (2, 2)):
        o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logit_bias={tid: 100}))[0].outputs[0]
        assert (o.token_ids, o.finish_reason, o.stop_reason) == ([tid], "stop", reason)
    o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logit_bias={2: 100}, ignore_eos=True))
    assert o[0].outputs[0].token_ids == [2] * 3 and o[0].outputs[0].stop_reason is None


def test_logprobs_are_raw_model_logprobs(llm):
    o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0].outputs[0]
    assert len(o.token_logprobs) == len(o.token_ids) == len(o.top_logprobs) == 8
    for tok, lp, top in zip(o.token_ids, o.token_logprobs, o.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp, abs=1e-5)  # greedy: the top token
        assert tok in top and lp <= 0
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5


def test_logprobs_read_as_vllm_writes_them(llm):
    """vLLM's shape (code written for vLLM reads it as is): per generated token {token: Logprob(logprob, rank,
    decoded_token)}, the sampled token first with its true rank (also outside the top-n: it was None there), then
    the top-n ranked 1..n; None when not asked; cumulative_logprob; prompt_logprobs as {token: Logprob} with the
    prompt token's true rank. They were floats in a list."""
    from mtp_ray import Logprob

    tok = llm.tokenizer
    ro = llm.generate(PROMPT, SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=2,
                                             prompt_logprobs=1))[0]
    o = ro.outputs[0]
    assert len(o.logprobs) == len(o.token_ids) and o.cumulative_logprob == pytest.approx(sum(o.token_logprobs))
    for t, lp, pos in zip(o.token_ids, o.token_logprobs, o.logprobs, strict=True):
        assert next(iter(pos)) == t and pos[t].logprob == lp and pos[t].decoded_token == tok.decode([t])
        ranked = sorted(pos.values(), key=lambda v: v.rank)
        assert [v.rank for v in ranked][:2] == [1, 2] and ranked[0].logprob >= ranked[1].logprob
        assert all(isinstance(v, Logprob) for v in pos.values()) and 2 <= len(pos) <= 3
        assert (pos[t].rank > 2) == (len(pos) == 3)  # outside the top 2: its own rank, past them
    assert ro.prompt_logprobs[0] is None and len(ro.prompt_logprobs) == len(ro.prompt_token_ids)
    for t, pos in zip(ro.prompt_token_ids[1:], ro.prompt_logprobs[1:], strict=True):
        best = max(pos.values(), key=lambda v: v.logprob)
        assert next(iter(pos)) == t and pos[t].rank >= 1 and best.rank == 1
        assert (pos[t].rank == 1) == (pos[t].logprob >= best.logprob - 1e-6)
    assert any(pos[t].rank > 2 for t, pos in zip(o.token_ids, o.logprobs, strict=True)), "no draw outside the top 2"
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=0))[0].outputs[0]
    assert [[(t2, v.rank) for t2, v in pos.items()] for pos in greedy.logprobs] == [[(t, 1)] for t in greedy.token_ids]
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob == pytest.approx(sum(plain.token_logprobs))


def test_logprob_token_ids_score_the_named_tokens(llm):
    """vLLM's logprob_token_ids: at each generated position the named tokens' log-probs (in their order) replace the
    top alternatives, with the values the top-n list gives the same tokens; the tokens generated do not change. It
    needs logprobs, and ids in the vocabulary: a ValueError naming it otherwise."""
    top = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=20))[0].outputs[0]
    want = list(top.top_logprobs[0])[1:4] + [5]
    o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=0,
                                            logprob_token_ids=want))[0].outputs[0]
    assert o.token_ids == top.token_ids and o.token_logprobs == pytest.approx(top.token_logprobs, abs=1e-6)
    for ref, got in zip(top.top_logprobs, o.top_logprobs, strict=True):
        assert list(got) == want and all(v <= 0 for v in got.values())
        assert all(got[t] == pytest.approx(ref[t], abs=1e-6) for t in want if t in ref)
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=[1])
    with pytest.raises(ValueError, match="logprob_token_ids"):
        llm.generate(PROMPT, SamplingParams(logprobs=0, logprob_token_ids=[10**7]))


def test_min_tokens_holds_back_stop_tokens(llm):
    first = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first]))[0].outputs[0]
    assert o.token_ids == [first] and o.finish_reason == "stop"
    o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first],
                                            min_tokens=5))[0].outputs[0]
    assert len(o.token_ids) >= 5 and first not in o.token_ids[:5]


@pytest.mark.parametrize("k", [0, 3])
def test_stops_as_vllm_ends_them_whatever_k(k):
    """vLLM's detokenizer rules, the same tokens whatever k: a stop string ends token_ids at the token completing it
    (with k > 0 the step's later drafts leaked into token_ids); min_tokens holds back a stop string ending at or
    before its last token (one ending exactly there stopped; with k > 0 one inside the step's drafts did); a stop
    token is in token_ids but not in the text unless include_stop_str_in_output; min_tokens masks the end token even
    with ignore_eos (vLLM: all_stop_token_ids)."""
    llm = LLM(num_speculative_tokens=k)
    tok = llm.tokenizer
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    ids = llm.generate(PROMPT, SamplingParams(**greedy))[0].outputs[0].token_ids
    texts = [tok.decode(ids[:n]) for n in range(13)]
    i = next(i for i in range(3, 8) if tok.decode(ids[i : i + 1]).strip() and ids[i] not in ids[:i])
    word = tok.decode(ids[i : i + 1])  # the text of token i exactly
    o = llm.generate(PROMPT, SamplingParams(**greedy, stop=[word]))[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids == ids[: i + 1] and len(o.token_logprobs) == i + 1
    assert o.text == texts[i + 1][: texts[i + 1].rindex(word)]
    o = llm.generate(PROMPT, SamplingParams(**greedy, stop=[word], min_tokens=i + 1))[0].outputs[0]
    assert len(o.text) >= len(texts[i + 1]), (o.text, texts[i + 1])  # a stop must end past min_tokens' text
    for include in (False, True):
        o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[i]],
                                                include_stop_str_in_output=include))[0].outputs[0]
        assert o.token_ids == ids[: i + 1] and o.stop_reason == ids[i]
        assert o.text == texts[i + 1 if include else i], (include, o.text)
    eos = llm.engine.eos_ids[0]
    o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, min_tokens=4,
                                            logit_bias={eos: 100.0}))[0].outputs[0]
    assert not set(o.token_ids[:4]) & set(llm.engine.eos_ids) and o.token_ids[4:] == [eos] * 4, o.token_ids


def test_token_id_prompts_and_prompt_dicts(llm):
    ids = llm.tokenizer.encode(PROMPT)
    a = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0]
    b = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and b.prompt is None


def test_abort_frees_the_cache(llm):
    eng = llm.engine
    free = eng.blocks.num_free_blocks
    eng.add_request("x", list(range(1, 60)), SamplingParams(temperature=0, max_tokens=50))
    eng.step()
    assert eng.blocks.num_free_blocks < free
    out = eng.abort_request("x")
    assert out.finished and out.finish_reason == "abort"
    assert eng.blocks.num_free_blocks == free and not eng.has_unfinished()


@pytest.mark.parametrize("kw,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(stop=5), "stop"), (dict(stop=[""]), "stop"),
    (dict(n=0), "n"), (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"), (dict(logprobs=-2), "logprobs"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"), (dict(seed="x"), "seed"),
])
def test_bad_sampling_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SP(**kw)


def test_bad_prompts_name_the_field_and_leave_the_engine_working(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([""], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([list(range(300))], SamplingParams(max_tokens=4))  # over max_model_len 256
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[5, 99999]], SamplingParams(max_tokens=4))  # token id outside the vocabulary
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([3.5], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    out = llm.generate(["ok", PROMPT], SamplingParams(temperature=0, max_tokens=5))
    assert all(len(o.outputs[0].token_ids) == 5 for o in out)


def test_generation_stops_at_max_model_len(llm):
    o = llm.generate([list(range(1, 250))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(o[0].outputs[0].token_ids) == 256 - 249 and o[0].outputs[0].finish_reason == "length"


def test_engine_config_from_yaml_section_rejects_unknown_fields():
    from mtp_ray.config.engine import EngineConfig

    cfg = EngineConfig.from_dict({"spec": {"num_speculative_tokens": 2}, "cache": {"block_size": 8}})
    assert cfg.spec.k == 2 and cfg.cache.block_size == 8
    with pytest.raises(ValueError, match="cache.blok_size"):
        EngineConfig.from_dict({"cache": {"blok_size": 8}})
    with pytest.raises(ValueError, match="spec.num_speculative_tokens"):
        EngineConfig.from_dict({"spec": {"num_speculative_tokens": -1}})


def test_token_budget_must_hold_a_verify_step():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(num_speculative_tokens=3, max_num_batched_tokens=3)


def test_warmup_forwards_stay_inside_max_model_len(monkeypatch):
    """A step's token budget may exceed max_model_len (many short prompts a step): the warmup's dummy forward of
    the whole budget still names only positions a sequence can reach (on a GPU the rope table ends there, and a
    position past it was an illegal memory access at engine start: bench/profile_step.py --model 35b)."""
    from mtp_ray.engine.runner import ModelRunner

    seen: list[int] = []
    forward = ModelRunner.forward

    def spy(self, inp):
        seen.append(int(inp.positions.max()))
        return forward(self, inp)

    monkeypatch.setattr(ModelRunner, "forward", spy)
    llm = LLM(max_model_len=24, max_num_batched_tokens=128, num_speculative_tokens=1)
    llm.engine.warmup()  # as a serving rank does (the offline LLM warms up with graphs only)
    assert seen and max(seen) < 24, seen
    o = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert len(o[0].outputs[0].token_ids) == 24 - 3 and o[0].outputs[0].finish_reason == "length"


def test_warmup_setting_picks_what_runs(monkeypatch):
    """engine.warmup: full runs the dummy forwards then a served workload; forwards the dummy forwards only; none
    nothing but the closing gather, and is refused where CUDA graphs would be captured on first use. Each ends
    with the counters at zero and nothing running."""
    from mtp_ray.engine import core as core_mod

    llm = LLM(max_model_len=64, max_num_batched_tokens=64, num_speculative_tokens=1)
    ran: list[str] = []
    monkeypatch.setattr(core_mod, "warmup_forwards", lambda c: ran.append("forwards"))
    monkeypatch.setattr(core_mod, "warmup_requests", lambda c: ran.append("requests"))
    for mode, want in (("full", ["forwards", "requests"]), ("forwards", ["forwards"]), ("none", [])):
        ran.clear()
        monkeypatch.setattr(llm.engine, "cfg", replace(llm.engine.cfg, warmup=mode))
        llm.engine.warmup()
        assert ran == want and not llm.engine.has_unfinished() and llm.engine.stats.steps == 0, mode
    monkeypatch.setattr(llm.engine.runner, "graphs", object())  # as on a GPU with graphs
    with pytest.raises(ValueError, match="warmup: none"):
        llm.engine.warmup()
    from mtp_ray.config.engine import EngineConfig

    assert LLM(warmup="forwards").config.warmup == "forwards"
    assert EngineConfig.from_dict({"warmup": "none"}).warmup == "none"


@pytest.mark.parametrize("kw,field", [
    ({"block_size": 1.5}, "cache.block_size"), ({"max_model_len": "64"}, "scheduler.max_model_len"),
    ({"max_model_len": -1}, "scheduler.max_model_len"), ({"num_speculative_tokens": None}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"), ({"seed": "x"}, "seed"), ({"seed": 2**70}, "seed"),
    ({"enable_prefix_caching": "no"}, "prefix_caching"), ({"warmup": "fast"}, "warmup"), ({"warmup": 0}, "warmup"),
    ({"warmup": "none", "device": "cuda"}, "warmup"),  # graphs on by default: captured at warmup
    ({"max_model_len": 4097}, "max_position_embeddings (4096)"),  # the bundled model's; vLLM refuses it too
])
def test_bad_constructor_arguments_name_the_field(kw, field):
    """A value of the wrong type or range is a ValueError naming the field before anything is built (a string or a
    float where an int belongs failed deep in torch; -1 was taken as a context length)."""
    with pytest.raises(ValueError, match=re.escape(field)):
        LLM(**kw)


def test_vllm_prompt_forms_and_clear_refusals(llm):
    """vLLM's prompt forms ({"prompt": text}, {"prompt_token_ids": ids}), use_tqdm and get_tokenizer; prompts of
    no known form are a ValueError saying what they were (a bool among the ids, None, a dict of params)."""
    sp = SamplingParams(temperature=0, max_tokens=4)
    ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    outs = llm.generate([PROMPT, {"prompt": PROMPT}, {"prompt_token_ids": ids}], sp, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    for bad, said in (([1, True], "'bool'"), (None, "NoneType"), (5, "int")):
        with pytest.raises(ValueError, match=said):
            llm.generate(bad, sp)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.generate([PROMPT], {"temperature": 0})
    assert not llm.engine.has_unfinished()


def test_vllm_scripts_run_as_written(llm):
    """What vLLM scripts pass: LLM(speculative_config=..., enforce_eager, trust_remote_code, tensor_parallel_size=1,
    gpu_memory_utilization) (a TypeError naming engine_config() before); a TokensPrompt whose "prompt" is only
    echoed (the text was encoded, the ids dropped); stop=None; numpy numbers; a tuple of SamplingParams; an empty
    list of them is refused (it meant the defaults); what one LLM cannot be is a ValueError saying what can."""
    import numpy as np

    from mtp_ray.config.engine import EngineConfig, ParallelConfig

    v = LLM(speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": 2}, enforce_eager=True,
            trust_remote_code=True, tensor_parallel_size=1, gpu_memory_utilization=0.5, disable_log_stats=True)
    assert (v.config.spec.num_speculative_tokens, v.config.graphs.enabled, v.config.cache.memory_fraction) == \
        (2, False, 0.5)
    for kw, said in (({"tensor_parallel_size": 2}, "tensor_parallel_size"), ({"swap_space": 4}, "swap_space"),
                     ({"speculative_config": {"model": "x", "num_speculative_tokens": 1}}, "speculative_config")):
        with pytest.raises(ValueError, match=said):
            LLM(**kw)
    with pytest.raises(ValueError, match="parallel.dp"):
        LLM(config=EngineConfig(parallel=ParallelConfig(dp=2)))
    ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=np.int64(4), stop=None, stop_token_ids=None, seed=np.int64(1),
                        top_p=np.float32(1.0))
    want = llm.generate(PROMPT, sp)[0].outputs[0].token_ids
    both = llm.generate({"prompt": "echoed only", "prompt_token_ids": ids}, sp)[0]
    assert both.prompt == "echoed only" and both.prompt_token_ids == ids and both.outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT], (sp, sp))] == [want, want]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([PROMPT, PROMPT], [])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": "text"}, sp)


def test_a_generate_that_fails_leaves_the_llm_usable(llm, monkeypatch):
    """A seed out of range, a flag of the wrong type, an exception raised while stepping (here from the
    detokenizer, as a Ctrl-C would): a clear error, nothing left queued, the next generate as before."""
    from mtp_ray.engine import detok

    ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="seed"):
        llm.generate(["x"], SamplingParams(seed=2**63, n=2))
    with pytest.raises(ValueError, match="skip_special_tokens"):
        llm.generate(["x"], SamplingParams(skip_special_tokens=None, max_tokens=2))
    assert not llm.engine.has_unfinished()

    def interrupted(self, ids, stop_token=False):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(detok.Detokenizer, "add", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPT, "x = 1"], SamplingParams(temperature=0, max_tokens=8))
    assert not llm.engine.has_unfinished()
    assert llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids == ref


def test_seeds_of_n_samples_wrap_past_the_largest_as_the_server_does(llm):
    """Sample i of a seeded request draws from seed + i, wrapping past 2**63 - 1 to -2**63 (the server's choices
    do the same): a seed near the top with n > 1 is valid, and each sample equals that seed's single sample."""
    sp = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    got = [c.token_ids for c in llm.generate([PROMPT], replace(sp, seed=2**63 - 2, n=3))[0].outputs]
    want = [llm.generate([PROMPT], replace(sp, seed=s))[0].outputs[0].token_ids for s in (2**63 - 2, 2**63 - 1, -2**63)]
    assert got == want


def test_a_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([[5, 6, 7], [5, 99999]], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished()


def test_a_request_that_fails_while_generating_says_why(llm):
    """A constraint that validates but fails once tokens arrive (llguidance's lexer limit) ends with finish_reason
    "error" and the reason on the output (as the server's 400 gives it); the other prompt of the batch completes."""
    bad = SamplingParams(temperature=0, max_tokens=4, structured_outputs={"regex": "(a{1000}){1000}"})
    out = llm.generate([PROMPT, PROMPT], [bad, SamplingParams(temperature=0, max_tokens=4)])
    failed, ok = out[0].outputs[0], out[1].outputs[0]
    assert failed.finish_reason == "error" and "structured_outputs" in failed.error, failed
    assert ok.finish_reason == "length" and ok.error is None and len(ok.token_ids) == 4


def test_chat_renders_the_template_and_generates(llm):
    """vLLM's LLM.chat: one conversation or a list, text content parts joined, the template's options passed on;
    its outputs are generate's on the rendered prompt."""
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def fib(n):"}]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    text = llm.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    ref = llm.generate([text], greedy)[0]
    one = llm.chat(conv, greedy)
    assert len(one) == 1 and one[0].prompt == text and one[0].outputs[0].token_ids == ref.outputs[0].token_ids
    split = [{"type": "text", "text": "def "}, {"type": "text", "text": "fib(n):"}]
    parts = [conv[0], {"role": "user", "content": split}]
    two = llm.chat([parts, conv + [{"role": "assistant", "content": "return"}]], greedy,
                   add_generation_prompt=False, continue_final_message=True)
    assert two[0].prompt == llm.tokenizer.apply_chat_template(conv, add_generation_prompt=False, tokenize=False,
                                                              continue_final_message=True)
    assert two[1].prompt.rstrip().endswith("return") and len(two[1].outputs[0].token_ids) == 8
    for bad, match in (([], "messages"), ([{"content": "x"}], r"messages\[0\]"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts")):
        with pytest.raises(ValueError, match=match):
            llm.chat(bad, greedy)
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conv, greedy, continue_final_message=True)
    with pytest.raises(ValueError, match="chat template failed"):  # (a raw TypeError from transformers before)
        llm.chat(conv, greedy, chat_template_kwargs={"tokenize": True})
    assert not llm.engine.has_unfinished()


def test_incremental_detokenizer_equals_full_decode(llm):
    """The detokenizer decodes only a window of recent tokens (linear in the output length); its text equals a
    full decode after every chunk, across multi-byte characters, and stop strings still cut the text."""
    import random

    from mtp_ray.engine.detok import Detokenizer

    tok = llm.tokenizer
    rng = random.Random(0)
    text = "def f(x):\n    return x * 2  # ünïcödé ✓ 漢字テスト 🙂🙂\n" * 12
    ids = tok.encode(text, add_special_tokens=False)
    ids += [rng.randrange(tok.vocab_size) for _ in range(150)]  # arbitrary ids: partial UTF-8 byte tokens too
    ids += tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)  # special tokens: kept or skipped
    for skip in (True, False):  # (the Rust backend decodes here, as transformers' decode would)
        d = Detokenizer(tok, [], skip_special_tokens=skip)
        at = 0
        while at < len(ids):
            n = rng.randint(1, 4)
            d.add(ids[at : at + n])
            at += n
            assert d.text == tok.decode(ids[:at], skip_special_tokens=skip)
        assert d.committed > len(ids) // 2  # most of the output was committed, not re-decoded each step
    stop = Detokenizer(tok, ["return x"])
    for i in range(len(ids)):
        stop.add(ids[i : i + 1])
    assert stop.stopped_by == "return x" and stop.text == text[: text.index("return x")]


def test_streamed_text_never_runs_past_what_a_stop_regex_keeps(llm):
    """A stream is the final text's prefix at every step: text that may still become (part of) a stop_regex match is
    held back like a stop string's prefix (it used to go out, and the match then cut it from the whole text)."""
    import random

    from mtp_ray.engine.detok import Detokenizer

    tok, rng = llm.tokenizer, random.Random(3)
    text = "def fib(n):\n    return fib(n - 1) + fib(n - 2)  # (x) 12 345 def g(a, b)\n" * 3
    ids = tok.encode(text, add_special_tokens=False)
    cut_at = 0
    for pattern in (r"\(\w*\)", r"def \w", r"\d{3}", r"fib\(n - 2\)", r"[ab], [ab]", r"\(x\)\s+\d+\s+\d+",
                    r"(?<=\# )\(", r"zzz", r"fib(?=\(n - 2)", r"(?=345 def)", r"\b(?=g\()"):
        for min_tokens in (0, 7):
            d = Detokenizer(tok, [], stop_regex=[pattern], min_tokens=min_tokens)
            streamed, at = "", 0
            while at < len(ids) and d.stopped_by is None:
                n = rng.randint(1, 4)
                d.add(ids[at : at + n])
                at += n
                streamed += d.delta(False)
                assert d.text.startswith(streamed), (pattern, streamed, d.text)
            streamed += d.delta(True)
            assert streamed == d.text, pattern
            cut_at += d.stopped_by is not None
    assert cut_at >= 18  # (most patterns did stop)


def test_a_stop_regex_that_matches_empty_text_stops_there(llm):
    """A pattern whose match is empty (`^`, a lookahead, `\\b`) stops where it matches, as SGLang's re.search does,
    and so does one whose lookahead completes with later text: such matches were skipped (they never stopped)."""
    from mtp_ray.engine.detok import Detokenizer

    tok = llm.tokenizer
    text = "def f(x):\n    return x * 2\n"
    ids = tok.encode(text, add_special_tokens=False)
    for pattern, cut, matched in ((r"^", "", ""), (r"(?=return)", "def f(x):\n    ", ""),
                                  (r"\b(?=x \*)", "def f(x):\n    return ", ""), (r"(?<=\):)", "def f(x):", ""),
                                  (r"return(?= x \* 2)", "def f(x):\n    ", "return")):
        d = Detokenizer(tok, [], stop_regex=[pattern])
        for i in range(len(ids)):
            d.add(ids[i : i + 1])
        assert (d.stopped_by, d.stopped_on, d.text) == (matched, pattern, cut), pattern
        assert 1 <= d.stop_tokens <= len(ids) and tok.decode(ids[: d.stop_tokens]).startswith(cut)


def test_a_stop_regex_cuts_where_it_would_token_by_token_whatever_the_grouping(llm):
    """Tokens come k + 1 a step, and several steps at once when the ingress lags: an end-anchored pattern (`$`,
    `\\Z`, a negative lookahead) cut the text where a group ended, so a stream and the whole answer differed."""
    from mtp_ray.engine.detok import Detokenizer

    tok = llm.tokenizer
    ids = tok.encode('x):\n    """\n    Additional future.', add_special_tokens=False)
    for pattern in ("$", r"\Z", r"\s(?!\s)", r"\)(?!;)"):
        texts = set()
        for size in (1, 3, 4, len(ids)):
            d = Detokenizer(tok, [], stop_regex=[pattern])
            for at in range(0, len(ids), size):
                d.add(ids[at : at + size])
            texts.add((d.text, d.stop_tokens))
        assert len(texts) == 1, (pattern, texts)


@pytest.mark.parametrize("kind", ["wordpiece", "metaspace"])
def test_incremental_detokenizer_commits_with_joining_decoders(kind):
    """Decoders that join words with spaces (WordPiece) or drop the first word's leading space (Metaspace): the
    text after a boundary depends on the tokens before it, so the tail is decoded with them as context. The text
    still equals a full decode after every chunk, and the window still commits (a tail decoded alone used to
    miss the joining space, so nothing was ever committed and each chunk decoded the whole output)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mtp_ray.engine.detok import Detokenizer

    words = [f"w{i}" for i in range(50)] + ["##ing", "##ed"] if kind == "wordpiece" else \
        [f"\u2581w{i}" for i in range(50)] + ["ing", "ed", "\u2581"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>"] + words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece() if kind == "wordpiece" else decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    rng = random.Random(1)
    ids = [rng.randrange(1, len(words) + 1) for _ in range(300)]
    d = Detokenizer(tok, [])
    at = 0
    while at < len(ids):
        n = rng.randint(1, 5)
        d.add(ids[at : at + n])
        at += n
        assert d.text == tok.decode(ids[:at], skip_special_tokens=True), at
    assert d.committed > len(ids) // 2


@pytest.mark.parametrize("k", [0, 2])
def test_plain_greedy_fast_path_equals_full_sampling_path(k):
    """Plain greedy rows take the step's one argmax (and its log-prob); a request for top log-probs goes through
    the per-row sampler and verifier: same tokens, same log-probs, with and without MTP."""
    llm = LLM(num_speculative_tokens=k)
    prompts = [[5, 17, 200, 31], list(range(40, 90)), [9] * 13]
    fast = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    full = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1))
    for f, s in zip(fast, full, strict=True):
        assert f.outputs[0].token_ids == s.outputs[0].token_ids
        # the fast path's log-prob is max - logsumexp, the full path's log_softmax()[token]: equal up to fp32
        # rounding of a logsumexp of magnitude ~10 (an ulp there is ~1e-6; which side rounds depends on the CPU's
        # vector width)
        assert f.outputs[0].token_logprobs == pytest.approx(s.outputs[0].token_logprobs, abs=1e-5)
        assert all(lp <= 0 for lp in f.outputs[0].token_logprobs)


@pytest.mark.parametrize("k", [0, 2])
def test_mixed_request_kinds_in_one_step_equal_each_alone(k):
    """A step reduces its logit rows where they are (argmax + log-prob) and brings full rows to the host only for
    requests that sample, report top log-probs or reshape logits: with all kinds sharing steps (and the plain
    greedy ones between them), every request gets exactly what it gets alone."""
    llm = LLM(num_speculative_tokens=k)
    prompts = [[5, 17, 200, 31], list(range(40, 90)), [9] * 13, [300, 301, 302], [77, 78] * 9, list(range(7, 30))]
    base = {"max_tokens": 12, "ignore_eos": True}
    params = [SamplingParams(temperature=0, **base),
              SamplingParams(temperature=0.8, seed=11, **base),
              SamplingParams(temperature=0, logprobs=2, **base),
              SamplingParams(temperature=0, repetition_penalty=1.3, **base),
              SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, **base),
              SamplingParams(temperature=0, **base)]
    together = llm.generate(prompts, params)
    for p, sp, t in zip(prompts, params, together, strict=True):
        alone = llm.generate([p], sp)[0].outputs[0]
        assert t.outputs[0].token_ids == alone.token_ids
        assert t.outputs[0].token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-5)
        got = t.outputs[0].top_logprobs
        assert [d.keys() for d in got] == [d.keys() for d in alone.top_logprobs]
        assert [list(d.values()) for d in got] == [pytest.approx(list(d.values()), abs=1e-5)
                                                   for d in alone.top_logprobs]
        assert bool(got and got[0]) == bool(sp.logprobs)  # top-n only where asked for


def test_presence_and_frequency_penalties():
    """OpenAI's presence / frequency penalties over the output tokens (the prompt's do not count): the processed
    logits against a direct computation, and through the engine: greedy MTP (k = 3, the verify rows carry the drafts
    before them) gives exactly the k = 0 tokens; a strong frequency penalty changes a repetitive greedy output and
    repeats less; out-of-range values are a ValueError naming the field."""
    from mtp_ray.engine.sampler import Row, process

    logits = torch.randn(50, dtype=torch.float32)
    row = Row(SamplingParams(presence_penalty=0.7, frequency_penalty=0.4), [3, 3, 9, 4, 4, 4, 9, 1], 5, ())
    want = logits.clone()
    for t, n in {4: 3, 9: 1, 1: 1}.items():  # the last 5 tokens are the output; 3 is only in the prompt
        want[t] -= 0.7 + 0.4 * n
    assert torch.allclose(process(logits, row), want)
    assert torch.equal(process(logits, Row(row.params, [3, 3], 0, ())), logits)

    prompts = [[5, 17, 200, 31], [9] * 13, [77, 78] * 9]
    pen = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=0.5, frequency_penalty=1.0)
    k0 = [o.outputs[0].token_ids for o in LLM(num_speculative_tokens=0).generate(prompts, pen)]
    k3 = LLM(num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in k3.generate(prompts, pen)] == k0
    plain = [o.outputs[0].token_ids
             for o in k3.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))]
    assert plain != k0
    repeats = [sum(len(t) - len(set(t)) for t in outs) for outs in (plain, k0)]
    assert repeats[1] < repeats[0], repeats
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: 2.5})


def test_logit_bias_applies_before_the_repetition_penalty():
    """vLLM's order (its Sampler: logits processors, logit_bias among them, then the penalties): a repetition penalty
    scales the biased logit by its sign; the bias was added after the penalty, which made a penalized prompt token
    win (1.0 / 2 + 5 = 5.5 > 5.0, where vLLM has (1.0 + 5) / 2 = 3.0)."""
    from mtp_ray.engine.sampler import Row, process

    logits = torch.zeros(20)
    logits[10], logits[5], logits[7] = 1.0, 5.0, -1.0
    p = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={10: 5.0, 7: 0.5})
    got = process(logits, Row(p, [10, 7, 3], 0, ()))
    assert got[10].item() == 3.0 and got[7].item() == -1.0 and got[5].item() == 5.0  # (-1 + 0.5) * 2
    assert int(got.argmax()) == 5


@pytest.mark.parametrize("k", [0, 3])
def test_logit_bias_and_token_ids_past_the_vocabulary(k):
    """logit_bias (OpenAI's) moves the greedy and the sampled token; a token id past the vocabulary in logit_bias or
    stop_token_ids is a ValueError naming the field before anything runs (it used to fail the step: IndexError in
    the min_tokens mask), and the engine keeps serving."""
    llm = LLM(num_speculative_tokens=k)
    prompts = [[5, 17, 200, 31], list(range(40, 90))]
    for temp in (0, 0.9):
        sp = SamplingParams(temperature=temp, seed=3, max_tokens=10, ignore_eos=True, logit_bias={300: 100})
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == [[300] * 10] * 2
    mild = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={300: 3.0, 17: -5.0})
    ref = [o.outputs[0].token_ids for o in LLM(num_speculative_tokens=0).generate(prompts, mild)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, mild)] == ref  # exact under MTP too
    vocab = llm.engine.runner.model_config.vocab_size
    for kw in ({"stop_token_ids": [vocab], "min_tokens": 2}, {"logit_bias": {vocab + 5: 1.0}}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, **kw))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 200})
    assert len(llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("k", [0, 2])
def test_extreme_sampling_values_never_fail_a_step(k):
    """Valid but extreme parameters (a temperature far below 1e-5, penalties that overflow fp32) produce tokens and
    never fail the step (a failed step takes a serving group down); a temperature below 1e-5 is greedy (vLLM's
    rule); values that cannot work (an infinite penalty, a seed past 64 bits) are a ValueError naming the field."""
    llm = LLM(num_speculative_tokens=k)
    p = [[5, 6, 7], list(range(40, 60))]
    greedy = [o.outputs[0].token_ids for o in llm.generate(p, SamplingParams(temperature=0, max_tokens=8))]
    assert [o.outputs[0].token_ids for o in llm.generate(p, SamplingParams(temperature=1e-44, max_tokens=8))] == greedy
    for kw in ({"repetition_penalty": 1e-300, "temperature": 0.5}, {"repetition_penalty": 1e300, "temperature": 0.5},
               {"temperature": 1e-4, "top_k": 3, "top_p": 0.5, "min_p": 0.2, "logit_bias": {1: 100, 2: 100}},
               {"frequency_penalty": 2, "presence_penalty": -2, "temperature": 0.01, "seed": -5}):
        outs = llm.generate(p, SamplingParams(max_tokens=8, ignore_eos=True, **kw))
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs), kw
    for kw in ({"repetition_penalty": float("inf")}, {"seed": 2**63}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)


def test_top_logprobs_past_a_small_vocabulary():
    """top_n above the vocabulary size (a small random model, logprobs = 20) returns the whole vocabulary."""
    from mtp_ray.engine.sampler import logprob_info

    lp = torch.log_softmax(torch.randn(7), -1)
    got, top, rank = logprob_info(lp, 3, 20)
    assert got == float(lp[3]) and sorted(top) == list(range(7))
    assert rank == 1 + sorted(lp.tolist(), reverse=True).index(got)


def test_iteration_tokens_histogram_counts_every_scheduled_token():
    """EngineStats.iteration_tokens (vLLM's iteration_tokens_total): every step with work lands in one bucket, and
    the tokens sum to what was fed: each prompt once but what it took from the prefix cache (the three share their
    first tokens), and each generated token but the last (k = 0)."""
    from mtp_ray.engine.stats import ITERATION_TOKEN_BUCKETS

    llm = LLM(num_speculative_tokens=0)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 17)]
    max_tokens = [6, 2, 9]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    cached = sum(o.num_cached_tokens for o in outs)
    st = llm.engine.stats
    assert sum(st.iteration_tokens) == st.steps == st.work_steps > 0 and cached == 16  # the 17-token prompt's 1st block
    # the running batch: 3 sequences while all three run, fewer as they end (6, 2 and 9 tokens; one step a token)
    assert st.rows_sum == sum(max_tokens) and 1 < st.rows_sum / st.work_steps <= 3
    assert st.iteration_tokens_sum == sum(map(len, prompts)) - cached + sum(m - 1 for m in max_tokens)
    assert len(st.iteration_tokens) == len(ITERATION_TOKEN_BUCKETS) + 1


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_lets_go_of_the_fused_projection_buffers(level):
    """The fused projections' weight buffers (GPU only; forced here on the CPU) go with the weights at sleep:
    after sleep(2) nothing references them (they used to stay, ~1.9 GB per rank at the 35B-A3B shapes, while
    memory() said 0 weight bytes); after sleep(1) + wake_up the engine serves as before."""
    import gc
    import weakref

    from mtp_ray.layers.linear import FusedProjections, fuse_projections

    llm = LLM(num_speculative_tokens=1)
    runner = llm.engine.runner
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate([[5, 6, 7, 8]], sp)[0].outputs[0].token_ids
    fuse_projections(runner.model)
    fused = [f for m in runner.model.modules() for f in vars(m).values() if isinstance(f, FusedProjections)]
    assert fused and all(f.fused for f in fused)
    buffers = [weakref.ref(f.buffer) for f in fused]
    runner.sleep(level)
    gc.collect()
    assert all(f.buffer is None for f in fused)
    if level == 2:
        assert all(b() is None for b in buffers), "a fused buffer outlived sleep(2)"
        assert runner.memory()["weights_bytes"] == 0
        return
    runner.wake_up()
    fuse_projections(runner.model)  # (wake_up fuses on the GPU only)
    assert all(f.fused for f in fused)
    assert llm.generate([[5, 6, 7, 8]], sp)[0].outputs[0].token_ids == want
