"""CUDA graphs for uniform decode / verify steps: the target forward (B x q_len tokens -> hidden, logits) and the
greedy MTP draft loop (k chained MTP forwards with the argmax on the device), one pair of graphs per batch size.

Inputs live in one static int64 buffer: the graph of size b reads it in `uniform_layout(b)` order, the order in which
`build_uniform` packs a step's inputs on the host, so a replay copies them in with one transfer and runs the graph
of the step's padded size (the DP-wide size from the gathered DPMeta). The graphs also end with what a greedy step
needs on the host: the target graph with the device acceptance (accepted count, the draft loop's inputs) and the
argmax / log-prob per row, the draft-loop graph with the drafts, all packed into one float64 block per graph, so a
plain-greedy step is two replays and one device -> host copy, with no eager kernels in between. A size without a
graph is captured when first used: every size at engine warmup, and again on first use after `reset()` (sleep frees
the tensors the graphs point at). In a DP group every rank reaches a capture at the same step (the size is a function
of the gathered table) and captures behind a barrier, so captures happen in the same order everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mtp_ray.engine.inputs import StepInputs, UniformLayout, uniform_layout
from mtp_ray.engine.sampler import argmax_logprob
from mtp_ray.layers.context import ForwardBatch, UniformDecode
from mtp_ray.model.qwen3_5 import Qwen3_5MoeForCausalLM

log = logging.getLogger(__name__)


class CudaGraphs:
    def __init__(self, model: Qwen3_5MoeForCausalLM, sizes: tuple[int, ...], k: int, width: int, block_size: int,
                 device: torch.device, barrier: Callable[[], None] | None = None):
        self.model, self.sizes, self.k, self.q = model, sizes, k, k + 1
        self.width, self.block_size, self.device = width, block_size, device
        self.barrier = barrier or (lambda: None)
        max_b = max(sizes)
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        # target step inputs, packed (the draft loop reads them too: same positions, slots, tables)
        self.inputs = z(self.layout(max_b).total)
        # draft loop inputs: the token after each verify row, and the last committed row of each sequence
        self.next_ids, self.last = z(max_b * self.q), z(max_b)
        # size -> (graph, hidden [n, H], logits [n, V], greedy block [b, 2q (+ 1 accepted count when k)])
        self.target: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # size -> (graph, drafts [b, k], greedy block [b, 2q + 1 + k])
        self.draft: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None

    def layout(self, b: int) -> UniformLayout:
        return uniform_layout(b, self.q, self.width, spec=self.k > 0)

    def views(self, b: int) -> dict[str, torch.Tensor]:
        """The static input views the graphs of size b read (ids, pos, slots [b*q]; tables [b, W]; ctx, state
        [b]; spec [b, q] or empty)."""
        return self.layout(b).views(self.inputs)

    def reset(self) -> None:
        self.target.clear()
        self.draft.clear()
        self.pool = None

    # ---- the captured functions ----
    def _batch(self, v: dict[str, torch.Tensor]) -> ForwardBatch:
        u = UniformDecode(self.q, v["ctx"], v["state"], v["spec"] if self.k else None)
        return ForwardBatch.decode(u, v["tables"], v["slots"])

    def _target_fn(self, b: int) -> tuple[torch.Tensor, ...]:
        """-> hidden [n, H], logits [n, V], greedy block [b, 2q (+ 1)]: argmax and its log-prob per row (first
        max on ties), and with k the accepted drafts: a sequence accepts while draft j (input j + 1 of its verify
        rows) equals the argmax of row j. The draft loop's inputs are set on the device too (the token after every
        row = its argmax; the last committed row = the accepted count); a host-path step overwrites them."""
        v, n = self.views(b), b * self.q
        hidden = self.model(v["ids"], v["pos"], self._batch(v))  # [n, H]
        logits = self.model.compute_logits(hidden)  # [n, V] fp32
        ids, lp = argmax_logprob(logits)  # [n] each
        parts = [ids.view(b, self.q).double(), lp.view(b, self.q).double()]
        if self.k:
            match = ids.view(b, self.q)[:, : self.k] == v["ids"].view(b, self.q)[:, 1:]
            self.last[:b].copy_(match.long().cumprod(1).sum(1))
            self.next_ids[:n].copy_(ids)
            parts.append(self.last[:b, None].double())
        return hidden, logits, torch.cat(parts, 1)

    def _draft_fn(self, b: int, hidden: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the target graph's [b * q, H] output; greedy: its greedy block -> drafts [b, k], and the greedy
        block with the drafts appended [b, 2q + 1 + k]."""
        m, n, v = self.model, b * self.q, self.views(b)
        # step 1 over every verify row (rows past the accepted ones write MTP KV that later steps overwrite)
        h = m.mtp_forward(self.next_ids[:n], hidden, v["pos"], self._batch(v), 0)  # [n, H]
        last = self.last[:b]
        h = h[torch.arange(b, device=self.device) * self.q + last]  # [b, H] at the last committed position
        drafts = [m.compute_logits(h).argmax(-1)]
        base = v["ctx"] + last  # position of the last committed token
        tables = v["tables"]
        for j in range(1, self.k):
            pos = base + j  # step j + 1 feeds draft j at the next position
            slot = tables.gather(1, (pos // self.block_size)[:, None])[:, 0] * self.block_size + pos % self.block_size
            batch = ForwardBatch.decode(UniformDecode(1, pos, v["state"]), tables, slot)
            h = m.mtp_forward(drafts[-1], h, pos, batch, j)
            drafts.append(m.compute_logits(h).argmax(-1))
        out = torch.stack(drafts, 1)
        return out, torch.cat([greedy, out.double()], 1)

    def _capture(self, fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        self.barrier()
        fn()  # eager run first: kernel compilation and library handles stay out of the capture
        torch.cuda.synchronize(self.device)
        self.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = g.pool()
        return g, out

    # ---- replay ----
    def run_target(self, inp: StepInputs, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the target graph of size b on inp (built with size b and this width) -> hidden, logits."""
        u = inp.batch.uniform
        assert u is not None and u.context_lens.shape[0] == b and inp.batch.block_tables.shape[1] == self.width
        n, total = b * self.q, self.layout(b).total
        if b not in self.target:
            # capture on padded rows only (zeros: block 0, state slot 0): the eager run inside the capture must not
            # advance a real sequence's GDN state before the replay does
            self.inputs.zero_()
            log.info("capturing the target graph for batch %d (%d tokens)", b, n)
            g, outs = self._capture(lambda: self._target_fn(b))
            self.target[b] = (g, *outs)
        assert inp.packed is not None and inp.packed.numel() == total, "graph inputs come packed (build_uniform)"
        self.inputs[:total].copy_(inp.packed, non_blocking=True)  # one transfer
        g, hidden, logits = self.target[b][:3]
        g.replay()
        return hidden, logits

    def greedy_results(self, b: int, with_drafts: bool) -> list[list[float]]:
        """The greedy block of the last replays, one device -> host copy: per sequence [argmax of each row (q),
        log-prob of each (q), accepted drafts (1, with k), next drafts (k, when the draft loop ran)] as floats (ids
        are exact below 2**53)."""
        block = self.draft[b][2] if with_drafts else self.target[b][3]
        return block.cpu().tolist()

    def run_drafts(self, next_ids: torch.Tensor | None, last: torch.Tensor | None, b: int) -> torch.Tensor:
        """next_ids: [b * q] token after each verify row; last: [b] last committed row -> drafts [b, k] (device).
        None: the inputs are already in place (the target graph's device acceptance)."""
        if next_ids is not None and last is not None:
            self.next_ids[: b * self.q].copy_(next_ids, non_blocking=True)
            self.last[:b].copy_(last, non_blocking=True)
        if b not in self.draft:
            # the eager run inside the capture repeats this step's MTP forwards exactly (no recurrent state in the
            # MTP layer): its KV writes equal the replay's
            log.info("capturing the MTP draft-loop graph for batch %d (k=%d)", b, self.k)
            hidden, greedy = self.target[b][1], self.target[b][3]
            g, outs = self._capture(lambda: self._draft_fn(b, hidden, greedy))
            self.draft[b] = (g, *outs)
        g, drafts = self.draft[b][:2]
        g.replay()
        return drafts
