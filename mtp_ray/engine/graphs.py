"""CUDA graphs for uniform decode / verify steps: the target forward (B x q_len tokens -> hidden, logits) and the
greedy MTP draft loop (k chained MTP forwards with the argmax on the device), one pair of graphs per batch size.

Inputs live in static buffers sized for the largest batch; a replay copies the step's inputs in with copy_ and
runs the graph of the step's padded size (the DP-wide size from the gathered DPMeta). A size without a graph is
captured when first used: every size at engine warmup, and again on first use after `reset()` (sleep frees the
tensors the graphs point at). In a DP group every rank reaches a capture at the same step (the size is a function
of the gathered table) and captures behind a barrier, so captures happen in the same order everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mtp_ray.engine.inputs import StepInputs
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
        # target step inputs (the draft loop reads them too: same positions, slots, tables)
        self.ids, self.pos, self.slots = z(max_b * self.q), z(max_b * self.q), z(max_b * self.q)
        self.tables, self.ctx, self.state = z(max_b, width), z(max_b), z(max_b)
        self.spec = z(max_b, self.q) if k else None
        # draft loop inputs: the token after each verify row, and the last committed row of each sequence
        self.next_ids, self.last = z(max_b * self.q), z(max_b)
        # size -> (graph, hidden [n, H], logits [n, V], argmax [n], log-prob of the argmax [n])
        self.target: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.draft: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def reset(self) -> None:
        self.target.clear()
        self.draft.clear()
        self.pool = None

    # ---- the captured functions ----
    def _batch(self, b: int) -> ForwardBatch:
        spec = self.spec[:b] if self.spec is not None else None
        u = UniformDecode(self.q, self.ctx[:b], self.state[:b], spec)
        return ForwardBatch.decode(u, self.tables[:b], self.slots[: b * self.q])

    def _target_fn(self, b: int) -> tuple[torch.Tensor, ...]:
        n = b * self.q
        hidden = self.model(self.ids[:n], self.pos[:n], self._batch(b))  # [n, H]
        logits = self.model.compute_logits(hidden)  # [n, V] fp32
        top, ids = logits.max(-1)  # greedy rows need only these two numbers per row (first max on ties)
        return hidden, logits, ids, top - logits.logsumexp(-1)

    def _draft_fn(self, b: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: the target graph's [b * q, H] output -> greedy drafts [b, k]."""
        m, n = self.model, b * self.q
        # step 1 over every verify row (rows past the accepted ones write MTP KV that later steps overwrite)
        h = m.mtp_forward(self.next_ids[:n], hidden, self.pos[:n], self._batch(b), 0)  # [n, H]
        last = self.last[:b]
        h = h[torch.arange(b, device=self.device) * self.q + last]  # [b, H] at the last committed position
        drafts = [m.compute_logits(h).argmax(-1)]
        base = self.ctx[:b] + last  # position of the last committed token
        tables = self.tables[:b]
        for j in range(1, self.k):
            pos = base + j  # step j + 1 feeds draft j at the next position
            slot = tables.gather(1, (pos // self.block_size)[:, None])[:, 0] * self.block_size + pos % self.block_size
            batch = ForwardBatch.decode(UniformDecode(1, pos, self.state[:b]), tables, slot)
            h = m.mtp_forward(drafts[-1], h, pos, batch, j)
            drafts.append(m.compute_logits(h).argmax(-1))
        return torch.stack(drafts, 1)

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
        n = b * self.q
        if b not in self.target:
            # capture on padded rows only (zeros: block 0, state slot 0): the eager run inside the capture must not
            # advance a real sequence's GDN state before the replay does
            for t in (self.ids, self.pos, self.slots, self.tables, self.ctx, self.state, self.spec):
                if t is not None:
                    t.zero_()
            log.info("capturing the target graph for batch %d (%d tokens)", b, n)
            g, outs = self._capture(lambda: self._target_fn(b))
            self.target[b] = (g, *outs)
        self.ids[:n].copy_(inp.input_ids, non_blocking=True)
        self.pos[:n].copy_(inp.positions, non_blocking=True)
        self.slots[:n].copy_(inp.batch.slot_mapping, non_blocking=True)
        self.tables[:b].copy_(inp.batch.block_tables, non_blocking=True)
        self.ctx[:b].copy_(u.context_lens, non_blocking=True)
        self.state[:b].copy_(u.state_slots, non_blocking=True)
        if self.spec is not None:  # a dummy rank's all-padding batch has no snapshot slots: slot 0
            if u.spec_slots is None:
                self.spec[:b].zero_()
            else:
                self.spec[:b].copy_(u.spec_slots, non_blocking=True)
        g, hidden, logits = self.target[b][:3]
        g.replay()
        return hidden, logits

    def greedy_verify(self, b: int) -> None:
        """After a target replay: greedy acceptance on the device. The drafts are the verify rows' own inputs
        (ids[1:] of each sequence); a sequence accepts while draft j equals the target argmax of row j. Sets the
        draft loop's inputs (the token after every row = that row's argmax; the last committed row = the
        accepted count) with no host round trip."""
        n, top = b * self.q, self.target[b][3]
        if self.k:
            match = top[:n].view(b, self.q)[:, : self.k] == self.ids[:n].view(b, self.q)[:, 1:]
            self.last[:b].copy_(match.long().cumprod(1).sum(1))
            self.next_ids[:n].copy_(top[:n])

    def greedy_results(self, b: int, with_drafts: bool) -> list[list[float]]:
        """One device -> host copy per step: per sequence [argmax of each row (q), log-prob of each (q),
        accepted drafts (1), next drafts (k, when the draft loop ran)] as floats (ids are exact below 2**53)."""
        n, (top, lp) = b * self.q, self.target[b][3:]
        parts = [top[:n].view(b, self.q).double(), lp[:n].view(b, self.q).double()]
        if self.k:
            parts.append(self.last[:b, None].double())
            if with_drafts:
                parts.append(self.draft[b][1].double())
        return torch.cat(parts, 1).cpu().tolist()

    def run_drafts(self, next_ids: torch.Tensor | None, last: torch.Tensor | None, b: int) -> torch.Tensor:
        """next_ids: [b * q] token after each verify row; last: [b] last committed row -> drafts [b, k] (device).
        None: the inputs are already in place (greedy_verify)."""
        if next_ids is not None and last is not None:
            self.next_ids[: b * self.q].copy_(next_ids, non_blocking=True)
            self.last[:b].copy_(last, non_blocking=True)
        if b not in self.draft:
            # the eager run inside the capture repeats this step's MTP forwards exactly (no recurrent state in the
            # MTP layer): its KV writes equal the replay's
            log.info("capturing the MTP draft-loop graph for batch %d (k=%d)", b, self.k)
            hidden = self.target[b][1]
            self.draft[b] = self._capture(lambda: self._draft_fn(b, hidden))
        g, drafts = self.draft[b]
        g.replay()
        return drafts
