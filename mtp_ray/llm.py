"""Offline API in the vLLM convention: LLM(model=..., num_speculative_tokens=k).generate(prompts, params)."""

from __future__ import annotations

import inspect
import itertools
from typing import Any

from mtp_ray.config.engine import BUNDLED_MODEL, CacheConfig, EngineConfig, GraphConfig, SchedulerConfig, SpecConfig
from mtp_ray.engine.chat_content import content_text
from mtp_ray.engine.core import EngineCore
from mtp_ray.engine.detok import STOP_NEEDS_TOKENIZER, Detokenizer
from mtp_ray.engine.grammar import check_grammar
from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.request import check_request
from mtp_ray.engine.sampling_params import SamplingParams, model_defaults
from mtp_ray.request_output import CompletionOutput, RequestOutput, prompt_logprobs


def engine_config(model: str = BUNDLED_MODEL, *, num_speculative_tokens: int = 0, dtype: str = "auto",
                  device: str = "auto", seed: int = 0, block_size: int = 16, num_blocks: int | None = None,
                  max_num_seqs: int = 32, max_num_batched_tokens: int = 512, prefill_chunk: int = 256,
                  max_model_len: int | None = None, tokenizer: str | None = None, cuda_graphs: bool = True,
                  graph_sizes: tuple[int, ...] | None = None, split_prefill: bool | None = None,
                  async_scheduling: bool = True, async_verify: bool = True, load_format: str = "auto",
                  enable_prefix_caching: bool = True, prefix_snapshots: int | None = None,
                  draft_vocab_size: int = 0, gpu_memory_utilization: float = 0.85) -> EngineConfig:
    """Flat keyword arguments (vLLM style) -> EngineConfig."""
    return EngineConfig(
        model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed, load_format=load_format,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, prefix_caching=enable_prefix_caching,
                          prefix_snapshots=prefix_snapshots, memory_fraction=gpu_memory_utilization),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  prefill_chunk=prefill_chunk, max_model_len=max_model_len,
                                  split_prefill=split_prefill, async_scheduling=async_scheduling,
                                  async_verify=async_verify),
        spec=SpecConfig(num_speculative_tokens=num_speculative_tokens, draft_vocab_size=draft_vocab_size),
        graphs=GraphConfig(enabled=cuda_graphs, sizes=graph_sizes),
    )


# vLLM's LLM(...) arguments that ask for what this engine does anyway (one process, one device): accepted as
# such; another value is refused with what to use instead
_SAME = {"trust_remote_code": None, "disable_log_stats": None, "tokenizer_mode": None, "enable_chunked_prefill": True,
         "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1}
_SCALE_OUT = "one LLM is one rank; a DP x EP group is the server's (serve run) or the RL actor's (launch_engine)"


def from_vllm_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """vLLM's names for LLM(...) arguments -> engine_config's: speculative_config {"method": "...mtp",
    "num_speculative_tokens": k}, enforce_eager; unknown names are a ValueError listing the known ones."""
    kw = dict(kw)
    for name, same in _SAME.items():
        if name in kw and same is not None and kw.pop(name) != same:
            raise ValueError(f"{name}: only {same!r} ({_SCALE_OUT})")
        kw.pop(name, None)
    if "enforce_eager" in kw:
        kw["cuda_graphs"] = not kw.pop("enforce_eager")
    spec = kw.pop("speculative_config", None)
    if spec is not None:
        if (not isinstance(spec, dict) or not str(spec.get("method", "mtp")).endswith("mtp")
                or set(spec) - {"method", "num_speculative_tokens"}):
            raise ValueError(f"speculative_config: only {{'method': '...mtp', 'num_speculative_tokens': k}} "
                             f"(the model's MTP head), got {spec!r}")
        kw["num_speculative_tokens"] = spec.get("num_speculative_tokens", 1)
    known = set(inspect.signature(engine_config).parameters) - {"model"}
    if set(kw) - known:
        raise ValueError(f"LLM() got unknown arguments {sorted(set(kw) - known)}; it takes {sorted(known)} "
                         f"(or config=EngineConfig(...)), and of vLLM's also {sorted(_SAME)}, enforce_eager, "
                         "speculative_config")
    return kw


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenizer_or_none(path: str):
    """The tokenizer at `path`, or None when a model directory holds no tokenizer files (transformers would make an
    empty tokenizer of the model type, which encodes text to nothing and decodes to \"\"): such a model serves token
    ids only."""
    from pathlib import Path

    p = Path(path)
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if p.is_dir() and not any((p / f).exists() for f in files):
        return None
    return load_tokenizer(path)


def _shown(x: Any) -> str:
    """What a refused prompt was, in a few words (the types inside a list: a bool or a float among the ids)."""
    if isinstance(x, list):
        return f"a list of {sorted({type(t).__name__ for t in x}) or 'nothing'}"
    return type(x).__name__


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _message(m: Any, i: int) -> dict:
    """A chat message for the template: text content parts joined (as the server does), the rest as given."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {_shown(m)}")
    c = m.get("content")
    try:
        text = content_text(c, f"messages[{i}].content")
    except ValueError as e:
        raise ValueError(f"{e}, got {_shown(c)}") from None
    return m if text is c else {**m, "content": text}


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
                             f"({_SCALE_OUT})")
        self._defaults = model_defaults(generation_config, self.config.model)
        self.engine = EngineCore(self.config)
        if self.engine.runner.graphs is not None:
            self.engine.warmup()  # captures the CUDA graphs up front
        path = self.config.tokenizer or self.config.model
        # a checkpoint without tokenizer files (e.g. a random model from save_pretrained) serves token ids only
        self.tokenizer = tokenizer_or_none(path)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a generate() / chat() call that passes none, as vLLM's: the model's
        generation_config.json sampling fields (max_new_tokens as max_tokens) over SamplingParams()."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self):
        """The tokenizer (None: the model has no tokenizer files), as vLLM's LLM.get_tokenizer."""
        return self.tokenizer

    def encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:  # vLLM's TokensPrompt: the ids count, a
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")  # "prompt" beside them is only echoed
            if not _is_ids(ids):
                raise ValueError(f"prompt_token_ids must be a list of int token ids, got {_shown(ids)}")
            return (text if isinstance(text, str) else None), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
            prompt = prompt["prompt"]
        if isinstance(prompt, str):  # emptiness (here and for id lists) is check_request's, in generate()
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer files; pass token ids (or tokenizer=...)")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if _is_ids(prompt):
            return None, list(prompt)
        raise ValueError("prompt must be a string, a list of int token ids, or {\"prompt\": ...} / "
                         f"{{\"prompt_token_ids\": ...}}, got {_shown(prompt)}")

    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """vLLM's LLM.generate: one prompt or a list (strings, token-id lists, {"prompt"} / {"prompt_token_ids"}
        dicts), with one SamplingParams or one per prompt. use_tqdm: accepted for vLLM callers (no progress bar)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {_shown(prompts)}")
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if not all(isinstance(sp, SamplingParams) for sp in plist):
            raise ValueError("sampling_params must be a SamplingParams (or a list of them, one per prompt)")
        if len(plist) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        encoded = [self.encode(p) for p in prompts]  # validate everything before anything is queued
        vocab = self.engine.runner.model_config.vocab_size
        for (_, ids), sp in zip(encoded, plist, strict=False):
            sp.validate()
            check_request(ids, sp, vocab, self.engine.max_model_len)
            if sp.structured_outputs is not None:
                check_grammar(sp.structured_outputs)
            if sp.stop and self.tokenizer is None:
                raise ValueError(STOP_NEEDS_TOKENIZER)
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
                    detok[cid] = (ro, co, child, Detokenizer(self.tokenizer, child.stop, child.skip_special_tokens,
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
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them, rendered by
        the tokenizer's chat template (or `chat_template`), then generated as `generate` does."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer files, so no chat template; use generate()")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if not isinstance(convs, list) or not convs or not all(isinstance(c, list) and c for c in convs):
            raise ValueError("messages must be a non-empty list of {\"role\", \"content\"} messages, or a list of "
                             "such conversations")
        texts = []
        for conv in convs:
            msgs = [_message(m, i) for i, m in enumerate(conv)]
            try:
                texts.append(self.tokenizer.apply_chat_template(
                    msgs, tools=tools, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tokenize=False, **(chat_template_kwargs or {})))
            except Exception as e:  # a template that rejects the roles / order, or kwargs it cannot take
                raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from e
        return self.generate(texts, sampling_params, use_tqdm)

    def _apply(self, out: StepOutput, detok: dict) -> None:
        ro, co, sp, dt = detok[out.request_id]
        decode = self._decode_one if self.tokenizer is not None else None
        if out.prompt_logprobs is not None and ro.prompt_logprobs is None:
            ro.prompt_logprobs = prompt_logprobs(out.prompt_logprobs, ro.prompt_token_ids, decode)
        if out.num_cached_tokens is not None:
            ro.num_cached_tokens = max(ro.num_cached_tokens or 0, out.num_cached_tokens)
        co.token_ids += out.new_token_ids
        co.token_logprobs += out.new_logprobs
        co.top_logprobs += out.new_top_logprobs
        dt.add(out.new_token_ids, out.stop_token)
        dt.cut(co.token_ids, co.token_logprobs, co.top_logprobs)
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
