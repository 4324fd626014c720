"""The CUDA-graph step logic, checked on the CPU: CudaGraphs with its capture replaced by an eager re-run that
writes the graph's static outputs in place (what a replay does). The static input buffers, padding to the graph
size, the device greedy acceptance, the draft-loop graph and the result block are then compared with the eager
engine token for token (fp32), without a GPU. Only the capture itself is left to the GPU tests."""

from __future__ import annotations

import pytest

from mtp_ray import LLM, SamplingParams
from mtp_ray.engine.graphs import CudaGraphs

PROMPTS = [[5, 17, 200, 31], list(range(40, 100)), [9] * 13, [300, 301, 302, 1000, 77, 78] * 5, [4, 4]]


class ReplayByRerun:
    """Stands in for a captured graph: replay() runs the function again and copies into the first outputs."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new = self.fn()
        olds, news = (self.out, new) if isinstance(self.out, tuple) else ((self.out,), (new,))
        for o, n in zip(olds, news, strict=True):
            o.copy_(n)


@pytest.fixture
def emulated_graphs(monkeypatch):
    def capture(self, fn):
        self.barrier()
        out = fn()  # as on the GPU: the eager warm-up run executes, the capture does not
        return ReplayByRerun(fn, out), out

    monkeypatch.setattr(CudaGraphs, "_capture", capture)


def with_graphs(llm: LLM, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> LLM:
    r = llm.engine.runner
    r.graphs = CudaGraphs(r.model, sizes, r.k, r.blocks_per_seq, llm.config.cache.block_size, r.device)
    llm.engine.scheduler.split = True  # as with graphs on a GPU: decode steps never mix with prefill
    llm.engine.warmup()
    return llm


def run(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_graph_steps_equal_eager(emulated_graphs, k):
    greedy = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    eager = run(LLM(num_speculative_tokens=k, max_num_seqs=8), greedy)
    llm = with_graphs(LLM(num_speculative_tokens=k, max_num_seqs=8))
    assert run(llm, greedy) == eager
    st = llm.engine.stats
    assert st["device_greedy_steps"] > 0, "no step took the device greedy path"
    g = llm.engine.runner.graphs
    assert set(g.target) == {1, 2, 4, 8} and bool(g.draft) == bool(k)
    # seeded sampling and log-probs: the target graph with the host path (and the eager draft loop)
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=i, logprobs=2 * (i % 2),
                              ignore_eos=True) for i in range(len(PROMPTS))]
    before = st["device_greedy_steps"]
    assert run(llm, sampled) == run(LLM(num_speculative_tokens=k, max_num_seqs=8), sampled)
    assert st["device_greedy_steps"] == before
