"""Warmup (EngineCore.warmup), every rank in lock-step. `warmup_forwards`: eager dummy forwards of every size
class the serving path meets (and up to the step token budget on a GPU), then every CUDA graph captured. Then
warmup by serving (`warmup_requests`): every rank serves a small synthetic workload, shaped like what the first
real requests bring: a burst of short prompts prefilled together, a prompt longer than one prefill chunk, greedy
and sampled rows, decode / verify graph steps, draft loops after eager prefills. The kernels those steps meet
(batched varlen prefill, chunked prefill, the MoE tile classes of large token counts, the sampling paths) compile
and autotune here, not on the first burst of real requests (bench/cold_compiles.py finds what is missed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mtp_ray.engine.inputs import build_uniform, dummy_inputs
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.parallel.dp_meta import DPMeta

if TYPE_CHECKING:
    from mtp_ray.config.engine import EngineConfig
    from mtp_ray.engine.block_manager import BlockManager
    from mtp_ray.engine.mtp import MTPProposer
    from mtp_ray.engine.outputs import StepOutput
    from mtp_ray.engine.runner import ModelRunner
    from mtp_ray.parallel.sync import Sync

BURST = 64  # short prompts prefilled in one step (a burst of chat requests)
SHORT = 32  # their length
TOKENS = 4  # tokens generated per request: a few decode / verify steps, with their draft loops


class Engine(Protocol):
    """What the warmup drives: an engine (engine/core.py: EngineCore) and its parts."""

    cfg: EngineConfig
    k: int
    max_model_len: int
    blocks: BlockManager
    runner: ModelRunner
    proposer: MTPProposer
    sync: Sync

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def step(self, next_cmd: int = 0) -> list[StepOutput]: ...

    def has_unfinished(self) -> bool: ...


def warmup_requests(core: Engine) -> int:
    """Serve the workload to its end (every rank steps until the gathered table says no rank has work); returns
    the steps it took. Sized to the engine's limits and its free KV blocks; the blocks go back to the pool."""
    sched, k = core.cfg.scheduler, core.k
    room = core.max_model_len - TOKENS - k - 1
    if room < 2:
        return 0
    free = core.blocks.num_free_blocks
    short = min(SHORT, room)
    per_short = core.blocks.blocks_for(short + TOKENS + k + 1)
    burst = max(1, min(BURST, sched.max_num_seqs - 1, free // max(per_short, 1) - 1))
    long = min(sched.prefill_chunk + 16, room)  # more than one prefill chunk
    vocab = min(core.runner.model_config.vocab_size, 1000)  # ids inside any vocabulary, a tiny one too
    prompts = [[(7 * i + j) % vocab for j in range(short)] for i in range(burst)]
    if core.blocks.blocks_for(long + TOKENS + k + 1) + burst * per_short <= free:
        prompts.append([(5 * j) % vocab for j in range(long)])
    # seeded: an unseeded request would draw from the engine's seed sequence and shift every later one's
    params = [SamplingParams(temperature=0, seed=0, max_tokens=TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=0, max_tokens=TOKENS, ignore_eos=True)]
    for i, p in enumerate(prompts):
        core.add_request(f"warmup-{i}", p, params[i % 2])
    steps = 0
    while True:
        core.step()
        steps += 1
        if not core.sync.lockstep:  # one rank: until its own work is done
            if not core.has_unfinished():
                return steps
            continue
        table = core.sync.step_table  # in lock-step: until no rank has work (the same step on every rank)
        if table is not None and table.all_dummy and not table.any_unfinished:
            return steps


def warmup_forwards(core: Engine) -> None:
    """Every rank together: eager dummy decode and prefill forwards with the k draft forwards, then (GPU) every
    CUDA graph size captured, largest first, on padded rows only, so that no capture stalls a serving step."""
    # eager forwards of padded rows (KV writes dropped) at 1, 2, 9, 16 and 64 tokens: the eager kernels and their
    # size classes (the GEMV's M == 1 / % 16 / other, on both sides of the shared expert's GEMV path at
    # SHARED_PAIR_TOKENS, varlen attention, GDN chunk, the MoE paths) compile here rather than stalling the
    # first requests that meet them; and up to a full step's token budget: fla's q / k
    # L2-norm autotunes once per bucket of ceil(tokens x key heads / 65536) (25 configs, ~3.5 s at the 35B
    # shapes, on the first step of a new bucket: bench/cold_compiles.py)
    budget = core.cfg.scheduler.max_num_batched_tokens
    span = max(1, 65536 // core.runner.model_config.linear_num_key_heads)
    large = (*range(span, budget, span), budget) if core.runner.device.type == "cuda" else ()  # (no Triton: CPU)
    # with prefix caching a piece's snapshots add their rows to the GDN layers' varlen batch (design.md 10.1): up
    # to twice the budget, so the buckets past it too, a full-budget forward with a snapshot making up the rest
    over = (*range(span * (budget // span + 1), 2 * budget - 1, span), 2 * budget - 1) \
        if large and core.blocks.caching else ()
    forwards = [(n, None) for n in sorted({min(n, budget) for n in (1, 2, 9, 16, 64, *large)})]
    # a short piece with a snapshot: the GDN kernels' snapshot-writing variants (layers/context.py SHORT_PIECE),
    # which a serving step meets with its first short new prompt past one block
    forwards += [(min(64, budget), min(64, budget) // 2)] if core.blocks.caching and budget > 1 else []
    forwards += [(budget, m - budget) for m in over if 0 < m - budget < budget]
    for n, snap in forwards:
        with core.sync.agree(DPMeta(num_tokens=n, batch_size=1, is_decoding=int(n == 1), is_dummy=0,
                                    has_unfinished=1)):
            core.runner.forward(dummy_inputs(n, snap, core.max_model_len))
        core.proposer.propose([], None)
    q_len = 1 + core.k
    for size in sorted(core.runner.graph_sizes, reverse=True):
        meta = DPMeta(num_tokens=size * q_len, batch_size=size, is_decoding=1, is_dummy=0, has_unfinished=1,
                      graph_ok=1)
        with core.sync.agree(meta, (size,)) as table:
            assert table is not None and table.graph_size == size
            core.runner.replay_target(build_uniform([], core.blocks, q_len, size, core.runner.blocks_per_seq),
                                      size)
        if core.k:
            core.proposer.propose_graph([], table)
    # the graphs of steps that admit prompts (token buckets), largest first: their memory pool serves the rest
    for bucket in sorted(core.runner.mixed_buckets, reverse=True):
        with core.sync.agree(DPMeta(num_tokens=bucket, batch_size=1, is_dummy=0, has_unfinished=1)):
            core.runner.capture_mixed(bucket)
