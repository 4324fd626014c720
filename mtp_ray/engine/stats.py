"""EngineStats: one rank's engine counters (get_stats, /metrics, tests), updated only through the methods below by
the parts of the engine that own each event: the core counts steps, the output processor verify steps, the device
greedy path its graph steps and waits, the draft loop its graphs after eager steps."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field, fields

# vLLM's iteration_tokens_total buckets: tokens a step feeds its target forward
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineStats:
    steps: int = 0  # steps that ran a forward on this rank (dummy forwards included)
    uniform_steps: int = 0  # ... whose batch was all decodes / verifies of one length
    graph_steps: int = 0  # ... that replayed a CUDA graph
    mixed_batch_steps: int = 0  # ... holding decodes and prefill pieces together
    eager_tokens: int = 0  # tokens fed to eager target forwards
    mixed_graph_steps: int = 0  # steps whose general batch (new prompts, decodes beside them) replayed a graph
    mixed_graph_tokens: int = 0  # ... their tokens, and the bucket tokens they padded to
    mixed_graph_padded: int = 0
    device_greedy_steps: int = 0  # graph steps decided on the device (argmax + acceptance in the graph)
    async_steps: int = 0  # ... left in flight while the host scheduled the next one
    fused_steps: int = 0  # ... whose draft loop ran in the target graph's launch (k > 0: one launch a step)
    draft_graphs_after_eager: int = 0  # draft-loop graphs run after an eager (prefill) target forward
    verify_steps: int = 0  # per sequence: verify rows committed
    drafted: int = 0  # drafts verified
    accepted: int = 0  # ... of which accepted
    aborted: int = 0  # requests aborted on this rank
    output_tokens: int = 0  # tokens this rank's requests were given (what their callers stream)
    step_s: float = 0.0  # wall time of the steps that ran a forward, host work included
    graph_step_s: float = 0.0  # the part of step_s spent in steps that replayed a CUDA graph
    graph_wait_s: float = 0.0  # the part of graph_step_s the host waited for the device's results
    # steps by the tokens they scheduled (dummy forwards not counted): one count per bucket, the last one past
    # ITERATION_TOKEN_BUCKETS[-1]; and the tokens in all
    iteration_tokens: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    iteration_tokens_sum: int = 0
    # sequences in the batches of those steps, summed: rows_sum / work_steps is the mean running batch (a rank that
    # keeps few sequences a step runs below its capacity, whatever its tok/s while busy)
    rows_sum: int = 0
    work_steps: int = 0  # steps that scheduled tokens (= sum(iteration_tokens))

    def count_step(self, uniform: bool, graph: bool, mixed: bool, tokens: int, rows: int) -> None:
        """tokens / rows: the tokens and sequences the step scheduled (0 for a dummy forward)."""
        if tokens:
            self.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
            self.iteration_tokens_sum += tokens
            self.rows_sum += rows
            self.work_steps += 1
        self.steps += 1
        self.uniform_steps += int(uniform)
        self.graph_steps += int(graph)
        self.mixed_batch_steps += int(mixed)

    def count_eager(self, num_tokens: int) -> None:
        self.eager_tokens += num_tokens

    def count_mixed_graph(self, num_tokens: int, bucket: int) -> None:
        self.mixed_graph_steps += 1
        self.mixed_graph_tokens += num_tokens
        self.mixed_graph_padded += bucket

    def count_outputs(self, tokens: int) -> None:
        self.output_tokens += tokens

    def count_step_time(self, seconds: float, graph: bool) -> None:
        self.step_s += seconds
        if graph:
            self.graph_step_s += seconds

    def count_verify(self, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted

    def count_device_greedy(self, left_in_flight: bool, fused: bool) -> None:
        self.device_greedy_steps += 1
        self.async_steps += int(left_in_flight)
        self.fused_steps += int(fused)

    def count_graph_wait(self, seconds: float) -> None:
        self.graph_wait_s += seconds

    def count_draft_graph_after_eager(self) -> None:
        self.draft_graphs_after_eager += 1

    def count_abort(self) -> None:
        self.aborted += 1

    def reset(self) -> None:
        """Back to zero, in place (the engine's parts hold this object): after the warmup, which is not serving."""
        fresh = EngineStats()
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))

    def snapshot(self) -> dict[str, float]:
        return asdict(self)
