"""vLLM-style flat keyword arguments (`LLM(model, num_speculative_tokens=3, max_model_len=...)`) -> EngineConfig,
and vLLM's own names for them (speculative_config, enforce_eager, ...)."""

from __future__ import annotations

import inspect
from typing import Any

from mtp_ray.config.engine import BUNDLED_MODEL, CacheConfig, EngineConfig, GraphConfig, SchedulerConfig, SpecConfig


def engine_config(model: str = BUNDLED_MODEL, *, num_speculative_tokens: int = 0, dtype: str = "auto",
                  device: str = "auto", seed: int = 0, block_size: int = 16, num_blocks: int | None = None,
                  max_num_seqs: int = 32, max_num_batched_tokens: int = 512, prefill_chunk: int = 256,
                  max_model_len: int | None = None, tokenizer: str | None = None, cuda_graphs: bool = True,
                  graph_sizes: tuple[int, ...] | None = None, mixed_graph_tokens: tuple[int, ...] | None = None,
                  split_prefill: bool | None = None,
                  async_scheduling: bool = True, async_verify: bool = True, load_format: str = "auto",
                  enable_prefix_caching: bool = True, prefix_snapshots: int | None = None,
                  draft_vocab_size: int = 0, gpu_memory_utilization: float = 0.85,
                  max_logprobs: int = 20, warmup: str = "full") -> EngineConfig:
    """Flat keyword arguments (vLLM style) -> EngineConfig."""
    return EngineConfig(
        model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed, load_format=load_format,
        max_logprobs=max_logprobs, warmup=warmup,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, prefix_caching=enable_prefix_caching,
                          prefix_snapshots=prefix_snapshots, memory_fraction=gpu_memory_utilization),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  prefill_chunk=prefill_chunk, max_model_len=max_model_len,
                                  split_prefill=split_prefill, async_scheduling=async_scheduling,
                                  async_verify=async_verify),
        spec=SpecConfig(num_speculative_tokens=num_speculative_tokens, draft_vocab_size=draft_vocab_size),
        graphs=GraphConfig(enabled=cuda_graphs, sizes=graph_sizes, mixed_tokens=mixed_graph_tokens),
    )


# vLLM's LLM(...) arguments that ask for what this engine does anyway (one process, one device): accepted as
# such; another value is refused with what to use instead
_SAME = {"trust_remote_code": None, "disable_log_stats": None, "tokenizer_mode": None, "enable_chunked_prefill": True,
         "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1}
SCALE_OUT = "one LLM is one rank; a DP x EP group is the server's (serve run) or the RL actor's (launch_engine)"


def from_vllm_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """vLLM's names for LLM(...) arguments -> engine_config's: speculative_config {"method": "...mtp",
    "num_speculative_tokens": k}, enforce_eager; unknown names are a ValueError listing the known ones."""
    kw = dict(kw)
    for name, same in _SAME.items():
        if name in kw and same is not None and kw.pop(name) != same:
            raise ValueError(f"{name}: only {same!r} ({SCALE_OUT})")
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
