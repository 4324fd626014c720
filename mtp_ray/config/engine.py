"""Engine configuration: small frozen dataclasses, built from keyword arguments or a YAML `engine:` section."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path, PurePath
from typing import Any

from mtp_ray.config.model import ModelConfig

WARMUPS = ("full", "forwards", "none")  # EngineConfig.warmup
BUNDLED_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "tiny-qwen35-mtp")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from memory_fraction (GPU) or max_num_seqs * max_model_len (CPU)
    memory_fraction: float = 0.85  # share of free device memory for KV + state after weights (GPU only)
    # prefix caching (design.md 10.1): full prompt blocks stay cached and a request with the same prefix resumes
    # there, its GDN state restored from a snapshot taken at a block boundary; outputs equal those without it
    prefix_caching: bool = True
    # GDN state snapshots kept (state slots, each the size of one sequence's GDN state: ~61 MiB at the 35B-A3B
    # shapes); None: max_num_seqs, at most 64
    prefix_snapshots: int | None = None

    def __post_init__(self) -> None:
        _typed(self, "cache")
        _check(self.block_size > 0, "cache.block_size", "must be > 0")
        _check(self.num_blocks is None or self.num_blocks >= 2, "cache.num_blocks", "must be >= 2")
        _check(0 < self.memory_fraction <= 1, "cache.memory_fraction", "must be in (0, 1]")
        _check(self.prefix_snapshots is None or self.prefix_snapshots >= 1, "cache.prefix_snapshots", "must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # running sequences per rank
    max_num_batched_tokens: int = 512  # token budget of one target forward
    prefill_chunk: int = 256  # longest prefill piece one sequence gets in one step
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # prefill pieces and decodes in separate steps (SGLang style), alternating while both wait, so decode steps stay
    # uniform and replay a CUDA graph; False: mixed steps (vLLM style); None: split when decode steps are graphs and
    # a mixed step would not be one (mixed steps with k = 0 on one rank replay graphs.mixed_tokens' graphs: mixed)
    split_prefill: bool | None = None
    # overlap the host's work for the next step with the device's current one (vLLM's async scheduling): CUDA-graph
    # decode steps whose rows are all plain greedy, without MTP (k = 0); outputs then stream one step later
    async_scheduling: bool = True
    # with async_scheduling, the same for MTP verify steps (k > 0): the next verify's tokens, positions, KV slots and
    # GDN slots are taken on the device from the step in flight (GPU-checked token-equal to the synchronous engine,
    # fp32, 1 and 2 GPUs: tests/test_gpu.py)
    async_verify: bool = True

    def __post_init__(self) -> None:
        _typed(self, "scheduler")
        _check(self.max_num_seqs > 0, "scheduler.max_num_seqs", "must be > 0")
        _check(self.max_num_batched_tokens > 0, "scheduler.max_num_batched_tokens", "must be > 0")
        _check(self.prefill_chunk > 0, "scheduler.prefill_chunk", "must be > 0")
        _check(self.max_model_len is None or self.max_model_len > 0, "scheduler.max_model_len",
               "must be > 0 (None: the model's max_position_embeddings)")


@dataclass(frozen=True)
class SpecConfig:
    method: str | None = "qwen3_5_mtp"  # None or "none": no speculative decoding
    num_speculative_tokens: int = 0
    # the MTP head drafts from token ids [0, N) only (0: the whole vocabulary). Its logits are the draft loop's
    # largest read (the lm_head, 1 GB a step at a 248k vocabulary); BPE vocabularies put frequent tokens first
    # (FR-Spec). The verify keeps the whole vocabulary: the output is unchanged, only acceptance may fall
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        _typed(self, "spec")
        _check(self.method in (None, "none", "qwen3_5_mtp", "mtp"), "spec.method", "must be qwen3_5_mtp or none")
        _check(0 <= self.num_speculative_tokens <= 8, "spec.num_speculative_tokens", "must be in 0..8")
        _check(self.draft_vocab_size >= 0, "spec.draft_vocab_size", "must be >= 0 (0: the whole vocabulary)")

    @property
    def k(self) -> int:
        return 0 if self.method in (None, "none") else self.num_speculative_tokens


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1  # DP ranks of one group == EP size (routed experts sharded over them)
    ep_backend: str = "torch"  # torch | deepep
    placement_strategy: str = "PACK"  # PACK | STRICT_PACK | SPREAD (the group's placement-group bundles)
    threads_per_rank: int = 1  # torch CPU threads in each rank actor
    cpus_per_rank: float = 1.0  # logical CPUs a rank's bundle reserves (fractions fit a small laptop)
    check_collectives: bool = True  # compare per-rank collective counters at every DPMeta gather
    draft_gathers: bool = False  # also gather DPMeta before every draft forward (exact mode; default: one per step)
    group_turns: bool = True  # split scheduling: every rank takes the turn the gathered table gives (False: alone)
    inject_ep_flip_rank: int = -1  # test hook: this rank deliberately takes the other EP mode

    def __post_init__(self) -> None:
        _typed(self, "parallel")
        _check(self.dp >= 1, "parallel.dp", "must be >= 1")
        _check(self.ep_backend in ("torch", "deepep"), "parallel.ep_backend", "must be torch or deepep")
        _check(self.placement_strategy in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"),
               "parallel.placement_strategy", "must be PACK, STRICT_PACK, SPREAD or STRICT_SPREAD")
        _check(self.threads_per_rank >= 1, "parallel.threads_per_rank", "must be >= 1")
        _check(self.cpus_per_rank > 0, "parallel.cpus_per_rank", "must be > 0")


@dataclass(frozen=True)
class GraphConfig:
    """CUDA graphs for uniform decode / verify steps, the greedy MTP draft loop, and (one-rank groups) steps that
    admit prompts (GPU only)."""

    enabled: bool = True
    # batch sizes (sequences per rank) that get a graph; a step pads to the smallest one that fits its DP-wide
    # largest batch. None: 1, 2, 4, 8, then multiples of 8 up to scheduler.max_num_seqs.
    sizes: tuple[int, ...] | None = None
    # token counts of the graphs for steps that admit prompts (prefill pieces of up to 128 tokens each, with decode
    # rows beside them when k = 0; engine/varlen_graphs.py); a step pads to the smallest that holds it, larger ones
    # run eager. None: 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048 up to max_num_batched_tokens; []: none
    mixed_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _typed(self, "graphs")
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(self.sizes))
            _check(len(self.sizes) > 0 and all(isinstance(b, int) and b > 0 for b in self.sizes), "graphs.sizes",
                   "must be a non-empty list of positive integers")
        if self.mixed_tokens is not None:
            _check(isinstance(self.mixed_tokens, list | tuple), "graphs.mixed_tokens",
                   f"must be a list of positive integers, got {self.mixed_tokens!r}")
            object.__setattr__(self, "mixed_tokens", tuple(self.mixed_tokens))
            _check(all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in self.mixed_tokens),
                   "graphs.mixed_tokens", "must be a list of positive integers")

    def batch_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        if self.sizes is not None:
            return tuple(sorted(set(self.sizes)))
        out = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
        return tuple(sorted({min(b, max_num_seqs) for b in out}))


@dataclass(frozen=True)
class TimeoutConfig:
    collective_s: float = 60.0  # a collective that takes longer fails the group (watchdog)
    progress_s: float = 90.0  # pending work but no step for this long: the group is hung
    start_s: float = 300.0  # group start (actors, model load, rendezvous, warmup)
    # a new request waits at most this long for a group that can serve it (restarting, none up): then it fails
    # with GroupUnavailable (HTTP 503 + Retry-After) rather than waiting without bound
    queue_s: float = 5.0

    def __post_init__(self) -> None:
        _typed(self, "timeouts")
        _check(self.collective_s > 0, "timeouts.collective_s", "must be > 0")
        _check(self.progress_s > 0, "timeouts.progress_s", "must be > 0")
        _check(self.start_s > 0, "timeouts.start_s", "must be > 0")
        _check(self.queue_s > 0, "timeouts.queue_s", "must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    model: str = BUNDLED_MODEL
    tokenizer: str | None = None  # default: the model directory
    # auto: the checkpoint's safetensors; dummy (vLLM's name): random weights from config.json alone, for
    # benchmarks at real shapes and RL rollouts that receive their weights through update_weights
    load_format: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"
    seed: int = 0
    # the most log-probs a request may ask per token (logprobs / top_logprobs / prompt_logprobs), as vLLM's
    # --max-logprobs; -1: the whole vocabulary (a request's -1 asks for all of it)
    max_logprobs: int = 20
    # what a group start, a wake_up and LLM(...) run before serving (EngineCore.warmup): full, the dummy forwards
    # and graph captures then a served synthetic burst (engine/warmup.py); forwards, the dummy forwards and graph
    # captures only; none, nothing: only where no CUDA graph is used (the CPU, or graphs.enabled false), since a
    # graph captured on first use could meet a step in flight (async scheduling). Lighter settings make a start
    # faster (tests); the first real requests then compile what the warmup would have
    warmup: str = "full"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)

    def __post_init__(self) -> None:
        _typed(self, "")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
               "must be auto|float32|bfloat16|float16")
        _check(self.load_format in ("auto", "dummy"), "load_format", "must be auto|dummy")
        _check(-2**63 <= self.seed < 2**63, "seed", f"must fit in 64 bits, got {self.seed}")
        _check(self.max_logprobs >= -1, "max_logprobs", f"must be -1 (the vocabulary) or >= 0, got {self.max_logprobs}")
        _check(self.warmup in WARMUPS, "warmup", f"must be {' | '.join(WARMUPS)}, got {self.warmup!r}")
        _check(self.warmup != "none" or not self.graphs.enabled or not str(self.device).startswith("cuda"), "warmup",
               "none needs no CUDA graphs (graphs.enabled: false): they are captured at warmup; use forwards")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EngineConfig:
        return _build(cls, raw, "")

    def check_fits(self, mc: ModelConfig) -> None:
        """What the model allows of these settings, a ValueError naming the field: checked by build_app at deploy
        time (a bad update fails there, not in new replicas after the old ones stopped), by the group before any
        rank starts, and by EngineCore."""
        dp, want, k, n = self.parallel.dp, self.scheduler.max_model_len, self.spec.k, self.spec.draft_vocab_size
        if dp > mc.num_experts:
            raise ValueError(f"parallel.dp={dp} exceeds the model's num_experts={mc.num_experts}: experts are "
                             "sharded over the DP ranks (EP), and each rank holds at least one")
        if want is not None and want > mc.max_position_embeddings:  # as vLLM: positions past it were never trained
            raise ValueError(f"scheduler.max_model_len ({want}) is more than the model's max_position_embeddings "
                             f"({mc.max_position_embeddings}); leave it unset for the model's length")
        if k > 0 and mc.mtp_num_hidden_layers == 0:
            raise ValueError(f"spec.num_speculative_tokens ({k}) needs the model's MTP head, but its config has "
                             "mtp_num_hidden_layers 0; use num_speculative_tokens 0")
        if n > mc.vocab_size:
            raise ValueError(f"spec.draft_vocab_size {n} exceeds the model's vocab_size {mc.vocab_size}")


_SIMPLE: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _typed(obj: Any, section: str) -> None:
    """Each field of a simple type (int, float, bool, str, or one of them | None) holds one: a string or a float where
    an int belongs fails here naming the field, not deep in the engine. Paths are taken as strings."""
    for f in fields(obj):
        kinds = [k.strip() for k in str(f.type).split("|")]
        if not all(k in _SIMPLE or k == "None" for k in kinds):
            continue  # a nested section or a tuple: checked by its own code
        v = getattr(obj, f.name)
        if isinstance(v, PurePath) and "str" in kinds:
            object.__setattr__(obj, f.name, v := str(v))
        if v is None and "None" in kinds:
            continue
        ok = any(isinstance(v, _SIMPLE[k]) and (k == "bool" or not isinstance(v, bool)) for k in kinds if k != "None")
        _check(ok, f"{section}.{f.name}" if section else f.name, f"must be {' or '.join(kinds)}, got {v!r}")


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{name} {what}")


def _build(cls: type, raw: dict[str, Any], path: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{path.rstrip('.') or 'engine'} must be a mapping, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = set(raw) - set(known)
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(f'{path}{u}' for u in unknown)}")
    kw = {}
    for k, v in raw.items():
        sub = _nested_type(cls, k)
        kw[k] = _build(sub, v, f"{path}{k}.") if sub is not None and not is_dataclass(v) else v
    return cls(**kw)


def _nested_type(cls: type, name: str) -> type | None:
    nested = {"cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig, "parallel": ParallelConfig,
              "timeouts": TimeoutConfig, "graphs": GraphConfig}
    return nested.get(name) if cls is EngineConfig else None
