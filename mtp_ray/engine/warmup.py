"""Warmup by serving: after the dummy forwards and graph capture (EngineCore.warmup), every rank serves a small
synthetic workload in lock-step, shaped like what the first real requests bring: a burst of short prompts prefilled
together, a prompt longer than one prefill chunk, greedy and sampled rows, decode / verify graph steps, draft loops
after eager prefills. The kernels those steps meet (batched varlen prefill, chunked prefill, the MoE tile classes of
large token counts, the sampling paths) compile and autotune here, not on the first burst of real requests (a cold
server's first 64-request burst waited ~7 s in Triton compiles before this, bench/serve.py `cold_burst`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtp_ray.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mtp_ray.engine.core import EngineCore

BURST = 64  # short prompts prefilled in one step (a burst of chat requests)
SHORT = 32  # their length
TOKENS = 4  # tokens generated per request: a few decode / verify steps, with their draft loops


def warmup_requests(core: EngineCore) -> int:
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
