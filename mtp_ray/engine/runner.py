"""ModelRunner: the model on its device with its caches; runs target and MTP forwards over StepInputs."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mtp_ray.config.engine import EngineConfig
from mtp_ray.config.model import ModelConfig
from mtp_ray.engine.cache import CacheShape, bind_caches, free_caches
from mtp_ray.engine.graphs import CudaGraphs, Fetched
from mtp_ray.engine.inputs import StepInputs
from mtp_ray.engine.varlen_graphs import VarlenGraphs, default_buckets
from mtp_ray.layers.linear import fuse_projections, unfuse_projections
from mtp_ray.layers.moe import ExpertDispatcher, local_dispatch
from mtp_ray.layers.rope import bind_rope_tables
from mtp_ray.model.loader import WeightLoader, load_model

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_CACHE_BYTES = 1 << 30  # KV + state budget when sizing from memory on CPU


def resolve_device(cfg: EngineConfig) -> torch.device:
    if cfg.device != "auto":
        return torch.device(cfg.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[cfg.dtype]


class ModelRunner:
    def __init__(self, cfg: EngineConfig, max_model_len: int, expert_range: tuple[int, int] | None = None,
                 dispatch: ExpertDispatcher = local_dispatch, barrier: Callable[[], None] | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        self.k = cfg.spec.k
        if self.device.type == "cuda" and dispatch is not local_dispatch:
            # PDL launches (layers/triton/pdl.py) have not run beside a cross-rank EP exchange on GPUs yet (no 2-GPU
            # machine since they landed): off in multi-rank groups until the dp = 2 GPU tests have checked them
            from mtp_ray.layers.triton import pdl

            pdl.set_enabled(False)
            log.info("PDL launches off: EP exchange between ranks")
        self.model = load_model(cfg.model, self.dtype, self.device, expert_range, with_mtp=self.k > 0,
                                dispatch=dispatch, dummy_seed=cfg.seed if cfg.load_format == "dummy" else None)
        self.model_config: ModelConfig = self.model.config
        vocab, n = self.model_config.vocab_size, cfg.spec.draft_vocab_size  # (n <= vocab: EngineConfig.check_fits)
        self.draft_vocab = n if n < vocab else 0  # ids the MTP drafts from: [0, draft_vocab), 0: all
        self.fuse_projections()
        self.slots_per_seq = 1 + (self.k + 1 if self.k else 0)
        # blocks one sequence of max_model_len needs, with the MTP draft loop's lookahead and a spare (async verify:
        # and the k tokens a verify in flight may still accept)
        reach = max_model_len + 2 * self.k + (self.k if cfg.scheduler.async_verify else 0)
        self.blocks_per_seq = (reach + cfg.cache.block_size) // cfg.cache.block_size + 1
        if self.device.type == "cuda":  # every position a sequence's block table spans
            bind_rope_tables(self.model, self.blocks_per_seq * cfg.cache.block_size, self.dtype, self.device)
        self.cache_shape = self._cache_shape()
        self.cache_bytes = 0
        self.asleep = 0  # 0: awake; else the sleep level
        self._shapes: dict[str, torch.Size] = {}  # parameter shapes while dropped (sleep level 2)
        self.restore: WeightLoader | None = None  # tracks the weights given back after sleep(2)
        self.allocate()
        self.graphs: CudaGraphs | None = None
        if self.device.type == "cuda" and cfg.graphs.enabled:
            sizes = cfg.graphs.batch_sizes(cfg.scheduler.max_num_seqs)
            self.graphs = CudaGraphs(self.model, sizes, self.k, self.blocks_per_seq, cfg.cache.block_size,
                                     self.device, barrier, cfg.scheduler.async_verify, self.draft_vocab)
        # steps that admit prompts: one-rank groups (an EP exchange between ranks would make the choice group-wide)
        self.varlen: VarlenGraphs | None = None
        buckets = cfg.graphs.mixed_tokens
        buckets = default_buckets(cfg.scheduler.max_num_batched_tokens) if buckets is None else buckets
        if self.graphs is not None and dispatch is local_dispatch and buckets:
            self.varlen = VarlenGraphs(self.model, buckets, cfg.scheduler.max_num_seqs, self.blocks_per_seq,
                                       self.device, barrier, q=self.k + 1)

    @property
    def mixed_buckets(self) -> tuple[int, ...]:
        """Token buckets with a graph for steps that admit prompts (empty: those steps run eagerly)."""
        return self.varlen.buckets if self.varlen is not None and not self.asleep else ()

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """Batch sizes with a CUDA graph (empty: every forward runs eagerly)."""
        return self.graphs.sizes if self.graphs is not None and not self.asleep else ()

    def _cache_shape(self) -> CacheShape:
        c, s = self.cfg.cache, self.cfg.scheduler
        per_seq = self.blocks_per_seq
        num_blocks = c.num_blocks
        if num_blocks is None:
            mc = self.model_config
            attn_layers = len(mc.full_attention_layers) + (mc.mtp_num_hidden_layers if self.k else 0)
            per_block = 2 * c.block_size * mc.num_key_value_heads * mc.head_dim * attn_layers * self.dtype.itemsize
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                # the GDN state slots come out of the same memory (at 40 layers, 128 sequences and k = 3 they
                # are ~40 GB: on top of the KV budget they ran the device out of memory)
                budget = int(free * c.memory_fraction) - self._state_slots() * self._state_slot_bytes()
            else:
                budget = CPU_CACHE_BYTES
            num_blocks = max(2, min(budget // max(per_block, 1), s.max_num_seqs * per_seq + 1))
        return CacheShape(num_blocks, c.block_size, self._state_slots())

    def _state_slots(self) -> int:
        return 1 + self.cfg.scheduler.max_num_seqs * self.slots_per_seq + self.snapshot_slots

    def _state_slot_bytes(self) -> int:
        """One GDN state slot over every GDN layer: conv state (model dtype) + recurrent state (fp32)."""
        mc = self.model_config
        gdn = mc.num_hidden_layers - len(mc.full_attention_layers)
        conv = mc.conv_dim * (mc.linear_conv_kernel_dim - 1) * self.dtype.itemsize
        ssm = mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim * 4
        return gdn * (conv + ssm)

    @property
    def snapshot_slots(self) -> int:
        """State slots kept for prefix-cache snapshots (the last ones; engine/block_manager.py)."""
        c = self.cfg.cache
        if not c.prefix_caching:
            return 0
        return c.prefix_snapshots or min(self.cfg.scheduler.max_num_seqs, 64)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """GDN conv + recurrent state of slot src into slot dst, every layer, for each (src, dst): a prefix-cache
        snapshot taken or restored. Device copies in stream order (before the forward that reads them)."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        with torch.no_grad():
            for gdn in self.model.gdn_layers():
                gdn.conv_state.index_copy_(0, dst, gdn.conv_state.index_select(0, src))
                gdn.ssm_state.index_copy_(0, dst, gdn.ssm_state.index_select(0, src))

    def fuse_projections(self) -> None:
        """GPU: the projections of one input read one weight buffer, one GEMM (sleep breaks the views)."""
        if self.device.type == "cuda":
            fuse_projections(self.model)

    def allocate(self) -> None:
        self.cache_bytes = bind_caches(self.model, self.cache_shape, self.dtype, self.device)
        log.info("caches: %s, %.1f MiB", self.cache_shape, self.cache_bytes / 2**20)

    def free(self) -> None:
        free_caches(self.model)
        self.cache_bytes = 0

    def reset_caches(self) -> None:
        """Zero every KV block and state slot (nothing cached survives; used with no request running)."""
        for attn in self.model.attention_layers():
            if attn.kv_cache is not None:
                attn.kv_cache.zero_()
        for gdn in self.model.gdn_layers():
            if gdn.conv_state is not None:
                gdn.conv_state.zero_()
                gdn.ssm_state.zero_()

    # ---- sleep / wake_up (memory) ----
    def sleep(self, level: int) -> None:
        """1: free KV + state, weights to host memory; 2: free KV + state and drop the weights."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.asleep:
            raise ValueError(f"already asleep (level {self.asleep})")
        self.free()
        if self.graphs is not None:
            self.graphs.reset()  # they point at the caches (and, after level 2, the weights) being freed
        if self.varlen is not None:
            self.varlen.reset()
        unfuse_projections(self.model)  # wake_up fuses again
        params = dict(self.model.named_parameters())
        if level == 1 and self.device.type != "cpu":
            for p in params.values():
                p.data = p.data.to("cpu").pin_memory()
        if level == 2:
            self._shapes = {n: p.shape for n, p in params.items()}
            for p in params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        if self.device.type == "cuda":  # give the freed memory back to the device (a trainer may need it), not
            torch.cuda.synchronize(self.device)  # to the caching allocator's pool
            torch.cuda.empty_cache()
        self.asleep = level

    def weight_loader(self) -> WeightLoader:
        """The loader an update goes through; after sleep(2) it first re-allocates the dropped weights."""
        if self.asleep == 2:
            if self.restore is None:
                for n, p in self.model.named_parameters():
                    p.data = torch.empty(self._shapes[n], dtype=p.dtype, device=self.device)
                self.restore = WeightLoader(self.model)
            return self.restore
        return WeightLoader(self.model)

    def wake_up(self) -> None:
        if not self.asleep:
            raise ValueError("wake_up: the engine is not asleep")
        if self.asleep == 2:
            missing = self.restore.missing() if self.restore is not None else sorted(self._shapes)
            if missing:
                more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
                raise ValueError("wake_up after sleep(2) needs every weight through update_weights first; missing: "
                                 + ", ".join(missing[:10]) + more)
            self.restore = None
        if self.asleep == 1 and self.device.type != "cpu":
            for p in self.model.parameters():
                p.data = p.data.to(self.device)
        self.fuse_projections()
        self.allocate()
        self.asleep = 0

    def memory(self) -> dict:
        params = list(self.model.parameters())
        # by device type: the parameters sit on cuda:N where the runner's device may read plain "cuda"
        on_dev = sum(p.numel() * p.element_size() for p in params if p.device.type == self.device.type)
        on_host = sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu"
                      and self.device.type != "cpu")
        out = {"weights_bytes": on_dev, "weights_host_bytes": on_host, "cache_bytes": self.cache_bytes,
               "asleep": self.asleep}
        if self.device.type == "cuda":  # measured: what this process holds, and what the device has free
            out.update(device_allocated_bytes=torch.cuda.memory_allocated(self.device),
                       device_reserved_bytes=torch.cuda.memory_reserved(self.device),
                       device_free_bytes=torch.cuda.mem_get_info(self.device)[0])
        return out

    @torch.inference_mode()
    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Target forward -> final-normed hidden [T, H]."""
        return self.model(inp.input_ids.to(self.device), inp.positions.to(self.device), self._on_device(inp))

    @torch.inference_mode()
    def mtp_forward(self, inp: StepInputs, hidden: torch.Tensor, step: int) -> torch.Tensor:
        return self.model.mtp_forward(inp.input_ids.to(self.device), hidden, inp.positions.to(self.device),
                                      self._on_device(inp), step)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] fp32 on the model's device (reduce there; move only the rows sampling needs)."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP hidden [N, H] -> [N, V] fp32; with spec.draft_vocab_size the ids past it are -inf (a draft never
        takes them, and a sampled draft's distribution is zero there, as the rejection sampler must see it)."""
        logits = self.model.draft_logits(hidden, self.draft_vocab).float()
        if not self.draft_vocab:
            return logits
        full = logits.new_full((logits.shape[0], self.model_config.vocab_size), float("-inf"))
        full[:, : self.draft_vocab] = logits
        return full

    def mixed_bucket(self, inp: StepInputs) -> int:
        """The captured token bucket whose graph runs this general batch (0: it runs eagerly)."""
        return self.varlen.bucket_for(inp) if self.varlen is not None and not self.asleep else 0

    @torch.inference_mode()
    def replay_mixed(self, inp: StepInputs, bucket: int) -> torch.Tensor:
        """A general batch in its token bucket's graph -> hidden [T, H] (static: read before the next replay)."""
        assert self.varlen is not None
        return self.varlen.run(inp, bucket)

    @torch.inference_mode()
    def capture_mixed(self, bucket: int) -> None:
        assert self.varlen is not None
        self.varlen.capture(bucket)

    @torch.inference_mode()
    def replay_target(self, inp: StepInputs, size: int, src: list[int] | None = None, fused: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform batch padded to a graph size -> hidden [size * q, H], logits [size * q, V] (device, static).
        src: per row, the in-flight step's row it follows, or -1. fused: the draft loop in the same launch (the
        fused graph, for a step whose rows are all plain greedy)."""
        assert self.graphs is not None
        return self.graphs.run_target(inp, size, src, fused)

    @torch.inference_mode()
    def replay_drafts(self, next_ids: torch.Tensor | None, last: torch.Tensor | None, size: int) -> torch.Tensor:
        """-> drafts [size, k] on the device; next_ids / last None: set on the device by the target graph."""
        assert self.graphs is not None
        return self.graphs.run_drafts(next_ids, last, size)

    @torch.inference_mode()
    def replay_drafts_after_eager(self, inp: StepInputs, hidden: torch.Tensor, next_ids: torch.Tensor,
                                  last: torch.Tensor, size: int) -> torch.Tensor:
        """The draft-loop graph from rows of an eager forward (inp: build_uniform of `size`; hidden [size * q, H]
        on the device) -> drafts [size, k] on the device."""
        assert self.graphs is not None
        return self.graphs.run_drafts_after_eager(inp, hidden, next_ids, last, size)

    @torch.inference_mode()
    def fetch_greedy(self, size: int, with_drafts: bool) -> Fetched:
        """Start copying the last replays' greedy block to the host; `.wait()` returns it as rows of floats."""
        assert self.graphs is not None
        return self.graphs.fetch(size, with_drafts)

    def _on_device(self, inp: StepInputs):
        b = inp.batch
        if self.device.type != "cpu":
            b.block_tables = b.block_tables.to(self.device)
            b.slot_mapping = b.slot_mapping.to(self.device)
            u = b.uniform
            if u is not None:
                u.context_lens, u.state_slots = u.context_lens.to(self.device), u.state_slots.to(self.device)
                if u.spec_slots is not None:
                    u.spec_slots = u.spec_slots.to(self.device)
        return b
