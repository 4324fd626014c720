"""Offline API in the vLLM convention: LLM(model=..., num_speculative_tokens=k).generate(prompts, params)."""

from __future__ import annotations

import itertools
import logging
from typing import Any

from mtp_ray.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from mtp_ray.config.engine import BUNDLED_MODEL, EngineConfig
from mtp_ray.config.flat import SCALE_OUT, engine_config, from_vllm_kwargs
from mtp_ray.engine.core import EngineCore
from mtp_ray.engine.detok import STOP_NEEDS_TOKENIZER, Detokenizer
from mtp_ray.engine.grammar import check_grammar
from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.request import check_request
from mtp_ray.engine.rollout_checks import WAKE_TAGS, woken_by
from mtp_ray.engine.sampling_params import SamplingParams, model_defaults
from mtp_ray.engine.weight_sync import apply_update, check_update, resolve
from mtp_ray.prompts import encode_prompt, render_chats, salted, shown, tokenize_bad_words, tokenizer_or_none
from mtp_ray.request_output import CompletionOutput, RequestOutput, prompt_logprobs

log = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str = BUNDLED_MODEL, *, config: EngineConfig | None = None,
                 generation_config: str = "auto", **kw: Any):
        """generation_config (vLLM's): where generate() without sampling_params takes its defaults: "auto", the
        model's generation_config.json; "vllm", SamplingParams(); else a directory holding a generation_config.json."""
        if config is not None and kw:
            raise ValueError(f"LLM(): pass config= or keyword arguments, not both (got {sorted(kw)})")
        self.config = config or engine_config(model, **from_vllm_kwargs(kw))
        if self.config.parallel.dp != 1:
            raise ValueError(f"parallel.dp: LLM runs dp = 1 in this process, got {self.config.parallel.dp} "
                             f"({SCALE_OUT})")
        self._defaults = model_defaults(generation_config, self.config.model)
        self.engine = EngineCore(self.config)
        if self.engine.runner.graphs is not None:
            self.engine.warmup()  # captures the CUDA graphs up front
        path = self.config.tokenizer or self.config.model
        # a checkpoint without tokenizer files (e.g. a random model from save_pretrained) serves token ids only
        self.tokenizer = tokenizer_or_none(path)
        self._ids = itertools.count()
        self._woken: set[str] = set()  # wake_up tags named since sleep

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a generate() / chat() call that passes none, as vLLM's: the model's
        generation_config.json sampling fields (max_new_tokens as max_tokens) over SamplingParams()."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self):
        """The tokenizer (None: the model has no tokenizer files), as vLLM's LLM.get_tokenizer."""
        return self.tokenizer

    def encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        """One prompt (vLLM's forms) -> (its text or None, its token ids): prompts.encode_prompt."""
        return encode_prompt(prompt, self.tokenizer)

    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: Any = None, priority: list[int] | None = None
                 ) -> list[RequestOutput]:
        """vLLM's LLM.generate: one prompt or a list (strings, token-id lists, {"prompt"} / {"prompt_token_ids"}
        dicts, with "cache_salt"), with one SamplingParams or one per prompt. use_tqdm: accepted for vLLM callers (no
        progress bar); lora_request None and priority 0 only (what vLLM callers pass without adapters or a
        priority scheduler)."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported (pass None)")
        if priority is not None and any(p != 0 for p in priority):
            raise ValueError("priority: requests are scheduled first come, first served (pass None or zeros)")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {shown(prompts)}")
        if self.engine.runner.asleep:  # (its caches are gone: a step would fail, not wait)
            raise ValueError(f"generate: the engine is asleep (sleep level {self.engine.runner.asleep}); call "
                             "wake_up() first")
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if not all(isinstance(sp, SamplingParams) for sp in plist):
            raise ValueError("sampling_params must be a SamplingParams (or a list of them, one per prompt)")
        if len(plist) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        encoded = [self.encode(p) for p in prompts]  # validate everything before anything is queued
        vocab, max_len = self.engine.runner.model_config.vocab_size, self.engine.max_model_len
        for sp in {id(sp): sp for sp in plist}.values():  # once per SamplingParams (all prompts often share one)
            sp.validate()
            tokenize_bad_words(sp, self.tokenizer)
            if sp.structured_outputs is not None:
                check_grammar(sp.structured_outputs)
            if sp.stop and self.tokenizer is None:
                raise ValueError(STOP_NEEDS_TOKENIZER)
        for i, ((text, ids), sp) in enumerate(zip(encoded, plist, strict=False)):
            plist[i] = sp = salted(prompts[i], sp)  # a prompt dict's cache_salt
            ids = sp.truncated(ids, max_len)  # truncate_prompt_tokens (RequestOutput.prompt stays the text, as vLLM's)
            encoded[i] = text, ids
            check_request(ids, sp, vocab, max_len, self.config.max_logprobs)
        results: dict[str, RequestOutput] = {}
        detok: dict[str, tuple[RequestOutput, CompletionOutput, Detokenizer]] = {}
        order = []
        try:
            for (text, ids), sp in zip(encoded, plist, strict=False):
                rid = str(next(self._ids))
                ro = RequestOutput(rid, text, ids, [], finished=False)
                results[rid] = ro
                order.append(rid)
                for i in range(sp.n):
                    child = sp.child(i)  # n > 1: independent samples (seeded: each its own seed, as the server)
                    cid = f"{rid}-{i}"
                    co = CompletionOutput(i, "", [], None, None, None, None)
                    ro.outputs.append(co)
                    tok = self.tokenizer if child.detokenize else None  # detokenize=False: no text
                    detok[cid] = (ro, co, child, Detokenizer(tok, child.stop, child.skip_special_tokens,
                                                             child.include_stop_str_in_output,
                                                             min_tokens=child.min_tokens))
                    self.engine.add_request(cid, ids, child)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id in detok:  # (not: a late output of a call that failed before)
                        self._apply(out, detok)
        except BaseException:  # (Ctrl-C too) this call's requests go, so the next call starts from an idle engine
            for cid in detok:
                self.engine.abort_request(cid)
            raise
        return [results[r] for r in order]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them, rendered by
        the tokenizer's chat template (or `chat_template`), then generated as `generate` does."""
        texts = render_chats(self.tokenizer, messages, tools=tools, chat_template=chat_template,
                             add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        return self.generate(texts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: list[Any], params: BeamSearchParams, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (mtp_ray/beam_search.py): per prompt (generate()'s forms) the beam_width best
        sequences, each its prompt + generated tokens, decoded whole as vLLM's; concurrency_limit: prompts searched
        at a time (None: all)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {shown(params)}")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive integer or None, got {concurrency_limit!r}")
        prompts = [prompts] if isinstance(prompts, (str, dict)) else prompts
        ids = [self.encode(p)[1] for p in prompts]
        whole = SamplingParams(max_tokens=params.max_tokens)  # every step of the search must fit
        for p in ids:
            check_request(p, whole, self.engine.runner.model_config.vocab_size, self.engine.max_model_len)
        step, chunk, out = params.step_params(), concurrency_limit or max(1, len(ids)), []
        for at in range(0, len(ids), chunk):
            # each prompt's search and its steps' params (a prompt dict's cache_salt kept), all stepped in one call
            searches = [(BeamSearch(p, params, self.engine.eos_ids), salted(prompt, step))
                        for p, prompt in zip(ids[at:at + chunk], prompts[at:at + chunk], strict=True)]
            while batch := [(sp, t) for s, sp in searches for t in s.pending()]:
                done = iter(self.generate([{"prompt_token_ids": t} for _, t in batch], [sp for sp, _ in batch]))
                for s, _ in searches:
                    s.advance([next(done).outputs[0].logprobs[0] for _ in s.pending()])
            for s, _ in searches:
                seqs = s.results()
                for q in seqs:
                    q.text = self.tokenizer.decode(q.tokens) if self.tokenizer is not None else None
                out.append(BeamSearchOutput(seqs))
        return out

    # ---- sleep / wake_up / weights: vLLM's offline names, the RL handle's semantics (mtp_ray/rl/engine.py) ----
    def sleep(self, level: int = 1) -> None:
        """vLLM's LLM.sleep: 1, the KV cache and states freed, the weights to host memory (on a GPU); 2, both
        dropped: every weight must then come back through update_weights before wake_up (which otherwise refuses,
        naming the missing ones). The prefix cache is forgotten; generate() while asleep is a ValueError."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"level: sleep level must be 1 or 2, got {level!r}")
        runner = self.engine.runner
        if runner.asleep:  # as vLLM: a warning, nothing done
            log.warning("sleep: already asleep (level %d)", runner.asleep)
            return
        self.engine.abort_all()  # (none run between generate() calls; what a failed call left goes)
        runner.sleep(level)
        self.engine.invalidate_prefixes()  # the caches are gone
        self._woken = set()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's LLM.wake_up: the weights back on the device, the caches reallocated (CUDA graphs recaptured).
        tags: vLLM's "weights" / "kv_cache" (None: both) for a wake-up in two calls (weights synced between them:
        here update_weights writes the sleeping weights); the engine wakes once both were named."""
        runner = self.engine.runner
        woken = woken_by(tags)
        if not runner.asleep:  # as vLLM: a warning, nothing done
            log.warning("wake_up: not asleep")
            return
        self._woken |= woken
        if self._woken != WAKE_TAGS:
            return
        runner.wake_up()  # (after sleep(2): refused, naming what update_weights has not brought back)
        if runner.graphs is not None:
            self.engine.warmup()  # recaptures the CUDA graphs, as at start

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: every cached prefix forgotten and the caches zeroed (e.g. after the weights changed outside
        update_weights). False while requests run (between generate() calls none do; reset_running_requests:
        accepted for vLLM callers)."""
        if self.engine.has_unfinished():
            return False
        self.engine.runner.reset_caches()
        self.engine.invalidate_prefixes()
        return True

    def update_weights(self, weights: Any) -> int:
        """The RL handle's update_weights in this process: (name, tensor) pairs or a {name: tensor} dict under the
        checkpoint's names (mtp.* to the MTP head), every one checked (name, shape, dtype) before any is copied.
        Awake or asleep (after sleep(2) it re-allocates the dropped weights first). Returns the tensors loaded."""
        loader = self.engine.runner.weight_loader()
        items = resolve(weights)
        check_update(loader, items)
        n = apply_update(loader, items)
        self.engine.invalidate_prefixes()  # KV and states computed with the old weights
        return n

    def _apply(self, out: StepOutput, detok: dict) -> None:
        ro, co, sp, dt = detok[out.request_id]
        decode = self._decode_one if self.tokenizer is not None and sp.detokenize else None
        if out.prompt_logprobs is not None and ro.prompt_logprobs is None:
            ro.prompt_logprobs = prompt_logprobs(out.prompt_logprobs, ro.prompt_token_ids, decode)
        if out.num_cached_tokens is not None:
            ro.num_cached_tokens = max(ro.num_cached_tokens or 0, out.num_cached_tokens)
        co.token_ids += out.new_token_ids
        co.token_logprobs += out.new_logprobs
        co.top_logprobs += out.new_top_logprobs
        co.token_ranks += out.ranks()
        dt.add(out.new_token_ids, out.stop_token)
        dt.cut(co.token_ids, co.token_logprobs, co.top_logprobs, co.token_ranks)
        co.text = dt.text
        if dt.stopped_by is not None and not out.finished:
            aborted = self.engine.abort_request(out.request_id)
            co.finish_reason, co.stop_reason = "stop", dt.stopped_by
            co.spec = aborted.spec if aborted else {}
        elif out.finished:
            co.finish_reason = "stop" if dt.stopped_by else out.finish_reason
            co.stop_reason = dt.stopped_by or out.stop_reason
            co.spec, co.error = out.spec, out.error
        if co.finish_reason is not None:
            co.finish_logprobs(sp.logprobs is not None or bool(sp.logprob_token_ids), not sp.logprob_token_ids,
                               decode)
        ro.finished = all(c.finish_reason is not None for c in ro.outputs)

    def _decode_one(self, token: int) -> str:
        """A token's text alone (vLLM's Logprob.decoded_token)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)
