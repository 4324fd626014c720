"""Offline API: what vLLM user code asks of LLM / SamplingParams beyond sampling (test_engine_api.py): prompt
truncation, detokenize=False, bad_words (offline and in the server's request parsing), sleep / wake_up /
reset_prefix_cache / update_weights."""

from __future__ import annotations

import pytest
import torch

from mtp_ray import LLM, SamplingParams
from mtp_ray.config.engine import BUNDLED_MODEL
from mtp_ray.model.loader import checkpoint_tensors
from mtp_ray.serve.openai.chat_request import parse_chat
from mtp_ray.serve.openai.errors import ApiError
from mtp_ray.serve.openai.fields import check_fields
from mtp_ray.serve.openai.request import parse_completion

PROMPT = "def parse(self, text):\n    "
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_speculative_tokens=2, block_size=4, prefill_chunk=16, max_model_len=256)


def ids_of(llm: LLM, prompt, sp: SamplingParams) -> list[int]:
    return llm.generate(prompt, sp)[0].outputs[0].token_ids


# ---- truncate_prompt_tokens ----
def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """vLLM's: the prompt's last n tokens are the prompt (RequestOutput.prompt_token_ids too; the text stays as
    given); a prompt longer than the context is cut, not refused; -1 keeps up to max_model_len."""
    ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    out = llm.generate(PROMPT, SamplingParams(truncate_prompt_tokens=4, **GREEDY))[0]
    assert out.prompt_token_ids == ids[-4:] and out.prompt == PROMPT
    assert out.outputs[0].token_ids == ids_of(llm, [ids[-4:]], SamplingParams(**GREEDY))
    long = list(range(5, 305))  # 300 tokens, past max_model_len 256
    cut = llm.generate([long], SamplingParams(truncate_prompt_tokens=8, n=2, **GREEDY))[0]
    assert cut.prompt_token_ids == long[-8:]
    assert [o.token_ids for o in cut.outputs] == [ids_of(llm, [long[-8:]], SamplingParams(**GREEDY))] * 2
    assert llm.generate([ids], SamplingParams(truncate_prompt_tokens=-1, **GREEDY))[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):  # a path that does not cut never ignores it
        llm.engine.add_request("uncut", long[:20], SamplingParams(truncate_prompt_tokens=4))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True])
def test_bad_truncate_prompt_tokens_name_the_field(bad):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=bad)


# ---- max_logprobs ----
def test_max_logprobs_caps_requests_and_minus_one_asks_for_the_vocabulary(llm):
    """vLLM's --max-logprobs: 20 by default (a request past it is a ValueError naming the field, in vLLM's words);
    -1 lifts the cap to the vocabulary, and a request's -1 asks for every token's log-prob (top-n ranked as n's)."""
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match="Requested .* logprobs of 21, which is greater than max allowed: 20"):
            llm.generate(PROMPT, SamplingParams(**{field: 21}, **GREEDY))
        with pytest.raises(ValueError, match="greater than max allowed: 20") as e:
            llm.generate(PROMPT, SamplingParams(**{field: -1}, **GREEDY))
        assert e.value.param == field
        with pytest.raises(ValueError, match=f"^{field} must be an integer >= 0 or -1"):
            SamplingParams(**{field: -2})
    wide = LLM(num_speculative_tokens=2, max_logprobs=-1)
    vocab = wide.engine.runner.model_config.vocab_size
    sp = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    full = wide.generate(PROMPT, SamplingParams(logprobs=-1, prompt_logprobs=-1, **sp))[0]
    top = wide.generate(PROMPT, SamplingParams(logprobs=20, prompt_logprobs=20, **sp))[0]
    assert full.outputs[0].token_ids == top.outputs[0].token_ids
    for a, b in zip(full.outputs[0].logprobs, top.outputs[0].logprobs, strict=True):
        assert len(a) == vocab and list(a)[: len(b)] == list(b)  # every token, the likeliest first
        assert torch.logsumexp(torch.tensor([x.logprob for x in a.values()]), 0).abs() < 1e-4  # a distribution
    assert all(len(p) == vocab for p in full.prompt_logprobs[1:]) and full.prompt_logprobs[0] is None
    assert len(LLM(max_logprobs=30).generate(PROMPT, SamplingParams(logprobs=25, **sp))[0].outputs[0].logprobs[0]) >= 25
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(max_logprobs=-2)


# ---- detokenize ----
def test_detokenize_false_gives_token_ids_without_text(llm):
    want = llm.generate(PROMPT, SamplingParams(logprobs=1, **GREEDY))[0].outputs[0]
    got = llm.generate(PROMPT, SamplingParams(detokenize=False, logprobs=1, **GREEDY))[0].outputs[0]
    assert want.text and got.text == ""
    assert got.token_ids == want.token_ids and got.finish_reason == "length"
    assert all(lp.decoded_token is None for pos in got.logprobs for lp in pos.values())  # (vLLM: no text at all)
    with pytest.raises(ValueError, match="detokenize"):  # stop strings are matched in the text (vLLM refuses too)
        SamplingParams(detokenize=False, stop=["x"])
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize="no")


# ---- bad_words ----
def test_bad_words_are_tokenised_as_vllm_does(llm):
    """Each word alone and after a space (add_special_tokens=False); the spaced form only where it is another
    first token with as many tokens."""
    tok = llm.get_tokenizer()

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    sp = SamplingParams(bad_words=["parse", " (self", "xyzzy"])
    assert sp.reshapes_logits and sp.penalized  # never the device-greedy fast path; the host path with history
    sp.update_from_tokenizer(tok)
    assert len(enc(" xyzzy")) != len(enc("xyzzy"))  # (so its spaced form is left out, as vLLM does)
    assert sp.bad_words_token_ids == [enc("parse"), enc(" parse"), enc("(self"), enc(" (self"), enc("xyzzy")]
    assert sp.bad_words_token_ids[:2] == [[1075], [1999]]  # " parse" is a token of the greedy output below


@pytest.mark.parametrize("k", [0, 2])
def test_bad_words_are_never_generated_and_greedy_stays_exact(k):
    """A one-token bad word is never generated; a two-token one ("(self") bans its last token only right after its
    first: the greedy output equals the unconstrained one up to that point and differs there. Same for any k
    (drafts the ban forbids are rejected), and sampled outputs never hold them either."""
    llm = LLM(num_speculative_tokens=k)
    free = ids_of(llm, PROMPT, SamplingParams(**GREEDY))
    assert 1999 in free and 267 in free  # " parse", "self" after "("
    one = ids_of(llm, PROMPT, SamplingParams(bad_words=["parse"], **GREEDY))
    assert 1999 not in one and one[: free.index(1999)] == free[: free.index(1999)]
    assert one == ids_of(llm, PROMPT, SamplingParams(logit_bias={1999: -100, 1075: -100}, **GREEDY))
    two = ids_of(llm, PROMPT, SamplingParams(bad_words=["(self"], **GREEDY))
    at = free.index(267)  # the first "self", right after "("
    assert free[at - 1] == 10 and two[:at] == free[:at] and two[at] != 267
    sampled = llm.generate(PROMPT, SamplingParams(bad_words=["parse"], temperature=1.0, seed=7, n=4, max_tokens=24,
                                                  ignore_eos=True, logit_bias={1999: 8.0}))[0]
    assert all(1999 not in o.token_ids and 1075 not in o.token_ids for o in sampled.outputs)


def test_bad_words_values_and_untokenised_words_are_refused(llm):
    for bad in ([""], ["  "], [3], ["x", None], {"x": 1}):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
    with pytest.raises(ValueError, match="bad_words"):  # the engine never ignores words nobody tokenised
        llm.engine.add_request("untokenised", [5, 6, 7], SamplingParams(bad_words=["parse"]))
    with pytest.raises(ValueError, match="bad_words"):  # past the vocabulary
        llm.generate([[5, 6]], SamplingParams(bad_words_token_ids=[[5, 99999]]))
    assert not llm.engine.has_unfinished()


def test_the_server_parses_bad_words(llm):
    """vLLM's request field: accepted by both endpoints, tokenised where the prompt is; refused (400 naming it)
    without a tokenizer, with a bad value, or with more words than server.max_stop."""
    tok = llm.get_tokenizer()
    sp = SamplingParams(bad_words=["parse"])
    sp.update_from_tokenizer(tok)
    body = {"model": "m", "prompt": PROMPT, "bad_words": ["parse"]}
    check_fields(body, "completions")
    assert parse_completion(body, tok).params.bad_words_token_ids == sp.bad_words_token_ids
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "bad_words": ["parse"]}
    check_fields(chat, "chat")
    assert parse_chat(chat, tok).params.bad_words_token_ids == sp.bad_words_token_ids
    for body, tokenizer in (({"prompt": [5, 6], "bad_words": ["parse"]}, None),
                            ({"prompt": "x", "bad_words": [""]}, tok), ({"prompt": "x", "bad_words": "x"}, tok),
                            ({"prompt": "x", "bad_words": ["w"] * 65}, tok)):  # past max_stop: matched every step
        with pytest.raises(ApiError) as e:
            parse_completion(body, tokenizer)
        assert e.value.param == "bad_words"


# ---- sleep / wake_up / reset_prefix_cache / update_weights ----
def test_sleep_wake_up_and_reset_prefix_cache():
    """vLLM's offline names: asleep, generate() is a ValueError (not a hang); wake_up (also in two calls with
    vLLM's tags) serves as before with nothing cached; reset_prefix_cache forgets the cached prefixes."""
    llm = LLM(num_speculative_tokens=1, block_size=4)
    prompt = list(range(10, 30))
    sp = SamplingParams(**GREEDY)
    want = llm.generate([prompt], sp)[0]
    assert llm.generate([prompt], sp)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    again = llm.generate([prompt], sp)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    llm.sleep(level=1)
    with pytest.raises(ValueError, match="asleep"):
        llm.generate([prompt], sp)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["everything"])
    llm.wake_up(tags=["weights"])  # (the caches not yet)
    with pytest.raises(ValueError, match="asleep"):
        llm.generate([prompt], sp)
    llm.wake_up(tags=["kv_cache"])
    woke = llm.generate([prompt], sp)[0]
    assert woke.num_cached_tokens == 0 and woke.outputs[0].token_ids == want.outputs[0].token_ids
    llm.wake_up()  # not asleep: nothing (as vLLM)


def test_sleep_level_2_needs_the_weights_back_through_update_weights():
    """Level 2 drops the weights (the RL handle's semantics): wake_up is refused, naming the missing ones, until
    update_weights brought every weight back; then the output is the fresh engine's."""
    llm = LLM(num_speculative_tokens=1)
    sp = SamplingParams(**GREEDY)
    want = ids_of(llm, [[5, 6, 7, 8]], sp)
    llm.sleep(level=2)
    with pytest.raises(ValueError, match="needs every weight"):
        llm.wake_up()
    with pytest.raises(ValueError, match="asleep"):
        llm.generate([[5, 6, 7, 8]], sp)
    named = [(n, read(None).float()) for n, _, read in checkpoint_tensors(BUNDLED_MODEL)]
    assert llm.update_weights(named) == len(named)
    llm.wake_up()
    assert ids_of(llm, [[5, 6, 7, 8]], sp) == want
    with pytest.raises(ValueError, match="model.nope"):  # checked before anything is copied: still serving
        llm.update_weights({"model.nope": torch.zeros(2)})
    assert ids_of(llm, [[5, 6, 7, 8]], sp) == want


def test_one_sampling_params_for_many_prompts_is_prepared_once(llm, monkeypatch):
    """vLLM's usual call, one SamplingParams for every prompt: its bad_words are tokenised and its grammar checked
    once, not once per prompt (a grammar check compiles it)."""
    import mtp_ray.llm as llm_module

    words, grammars = [], []
    tokenize = SamplingParams.update_from_tokenizer
    check = llm_module.check_grammar
    monkeypatch.setattr(SamplingParams, "update_from_tokenizer", lambda sp, tok: (words.append(1), tokenize(sp, tok)))
    monkeypatch.setattr(llm_module, "check_grammar", lambda so: (grammars.append(1), check(so)))
    sp = SamplingParams(max_tokens=3, bad_words=["return"], structured_outputs={"regex": "[a-z]+"})
    outs = llm.generate([PROMPT, "x = ", "import "], sp)
    assert len(outs) == 3 and all(o.outputs[0].text.isalpha() for o in outs)
    assert (len(words), len(grammars)) == (1, 1)


def test_vllm_callers_lora_request_none_and_priority_zero(llm):
    """What vLLM callers pass without adapters or a priority scheduler is taken (positionally too); an adapter or
    a priority is a ValueError naming it, never silently ignored."""
    want = ids_of(llm, PROMPT, SamplingParams(**GREEDY))
    out = llm.generate([PROMPT], SamplingParams(**GREEDY), False, None, priority=[0])
    assert out[0].outputs[0].token_ids == want
    assert llm.chat([{"role": "user", "content": "x"}], SamplingParams(**GREEDY), lora_request=None)[0].outputs
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate([PROMPT], SamplingParams(**GREEDY), lora_request=object())
    with pytest.raises(ValueError, match="priority"):
        llm.generate([PROMPT], SamplingParams(**GREEDY), priority=[1])
