"""CUDA graphs for uniform decode / verify steps: the target forward (B x q_len tokens -> hidden, logits) and the
greedy MTP draft loop (k chained MTP forwards with the argmax on the device), and (k > 0) both in one fused graph,
per batch size.

Inputs live in one static int64 buffer: the graph of size b reads it in `uniform_layout(b)` order, the order in which
`build_uniform` packs a step's inputs on the host, so a replay copies them in with one transfer and runs the graph
of the step's padded size (the DP-wide size from the gathered DPMeta). The graphs also end with what a greedy step
needs on the host: the target graph with the device acceptance (accepted count, the draft loop's inputs) and the
argmax / log-prob per row, the draft-loop graph with the drafts, all packed into one float64 block per graph, so a
plain-greedy step is one replay (k > 0: the fused graph, whose draft loop reads the device acceptance) and one
device -> host copy, with no eager kernels in between; a step with a sampled row replays the target graph, then
the draft-loop graph from the host's acceptance. A size without graphs is captured when first used (all three
together): every size at engine warmup, and again on first use after `reset()` (sleep frees the tensors the graphs
point at). In a DP group every rank reaches a capture at the same step (the size is a function of the gathered
table) and captures behind a barrier, so captures happen in the same order everywhere.

Async scheduling: inputs go through pinned staging buffers and results come back into pinned ones, both
non-blocking and fenced by events, so the host can build step N + 1 while step N runs. A row of step N + 1 whose
inputs depend on step N (still on the device) names its row of step N in `src`. k = 0: the target graph reads the
token from `next_ids`, where every k = 0 target graph leaves its argmax. k > 0 (async verify): the target graph
first moves the row by step N's accepted count (engine/graph_ops.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtp_ray.engine.graph_ops import argmax_ids, draft_rows, feed_in_flight, greedy_block
from mtp_ray.engine.inputs import PackedLayout, StepInputs, uniform_layout
from mtp_ray.layers.context import ForwardBatch, UniformDecode
from mtp_ray.model.qwen3_5 import Qwen3_5MoeForCausalLM

log = logging.getLogger(__name__)


@dataclass
class Fetched:
    """A greedy block on its way to pinned host memory (non-blocking copy, then the event)."""

    host: torch.Tensor  # [b, cols] view of a staging buffer
    event: torch.cuda.Event | None  # None on CPU (emulated graphs): the copy is already done

    def wait(self) -> list[list[float]]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class Staging:
    """Two host buffers used in turn, each fenced by an event recorded after its last copy, so the host never
    rewrites (or reads) a buffer a copy on the stream has not finished with. Pinned on a GPU: a copy between pageable
    memory and the device would make the host wait for the stream."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.cuda = device.type == "cuda"
        self.bufs = [torch.empty(numel, dtype=dtype, pin_memory=self.cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.turn = 0

    def next(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        self.turn ^= 1
        ev = self.events[self.turn]
        if ev is not None:
            ev.synchronize()  # its previous copy is done (normally long since)
        return self.bufs[self.turn], ev


def capture(fn: Callable[[], object], device: torch.device, barrier: Callable[[], None], pool
            ) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn captured into a new graph (in `pool`, a memory pool handle, or a new one when None) between barriers (every
    rank captures at the same step), after an eager run: kernel compilation, autotuning and library handles stay out
    of the capture -> (the graph, fn's outputs: the graph's static outputs)."""
    barrier()
    fn()
    torch.cuda.synchronize(device)
    barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out


class CudaGraphs:
    def __init__(self, model: Qwen3_5MoeForCausalLM, sizes: tuple[int, ...], k: int, width: int, block_size: int,
                 device: torch.device, barrier: Callable[[], None] | None = None, async_verify: bool = False,
                 draft_vocab: int = 0):
        self.model, self.sizes, self.k, self.q = model, sizes, k, k + 1
        self.draft_vocab = draft_vocab  # the draft loop's argmax covers ids [0, draft_vocab) (0: all)
        self.feed = k > 0 and async_verify  # the k > 0 graphs take in-flight rows from the device (graph_ops.py)
        self.width, self.block_size, self.device = width, block_size, device
        self.barrier = barrier or (lambda: None)
        max_b = max(sizes)
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        # target step inputs, packed (the draft loop reads them too: same positions, slots, tables)
        self.inputs = z(self.layout(max_b).total)
        # draft loop inputs: the token after each verify row, and the last committed row of each sequence
        self.next_ids, self.last = z(max_b * self.q), z(max_b)
        # per row of the next replay, its sequence's row in the previous replay when that step is still in flight (-1:
        # the host's inputs are exact); set by every replay. k = 0: the token is that row's argmax; k > 0: see
        # graph_ops.py. The drafts the last draft loop left, kept across graph sizes for the next verify
        self.src = torch.full((max_b,), -1, dtype=torch.long, device=device)
        self.drafts = z(max_b, max(self.k, 1))
        self.in_stage = Staging(self.layout(max_b).total + max_b, torch.long, device)
        self.out_stage = Staging(max_b * (2 * self.q + 1 + self.k), torch.float64, device)
        # size -> (graph, hidden [n, H], logits [n, V], greedy block [b, 2q (+ 1 accepted count when k)])
        self.target: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # size -> (graph, drafts [b, k], greedy block [b, 2q + 1 + k])
        self.draft: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        # size -> (graph, hidden [n, H], greedy block [b, 2q + 1 + k]): the target forward and the draft loop in one
        # graph, for steps whose every row is plain greedy (k > 0): one launch a step instead of two
        self.fused: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.block: torch.Tensor | None = None  # the greedy block the last replay wrote (what fetch copies)
        self.pool = None

    def layout(self, b: int) -> PackedLayout:
        return uniform_layout(b, self.q, self.width, spec=self.k > 0)

    def views(self, b: int) -> dict[str, torch.Tensor]:
        """The static input views the graphs of size b read (ids, pos, slots [b*q]; tables [b, W]; ctx, state
        [b]; spec [b, q] or empty)."""
        return self.layout(b).views(self.inputs)

    def reset(self) -> None:
        self.target.clear()
        self.draft.clear()
        self.fused.clear()
        self.block = None
        self.pool = None

    # ---- the captured functions ----
    def _batch(self, v: dict[str, torch.Tensor]) -> ForwardBatch:
        u = UniformDecode(self.q, v["ctx"], v["state"], v["spec"] if self.k else None)
        return ForwardBatch.decode(u, v["tables"], v["slots"])

    def _target_fn(self, b: int, logits_out: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """-> hidden [n, H], logits [n, V], greedy block [b, 2q (+ 1)]: argmax and its log-prob per row (first
        max on ties), and with k the accepted drafts: a sequence accepts while draft j (input j + 1 of its verify
        rows) equals the argmax of row j. The draft loop's inputs are set on the device too (the token after every
        row = its argmax; the last committed row = the accepted count); a host-path step overwrites them.
        logits_out: [n, V] fp32 to write the logits into (the fused graph: the target graph's, not a second one)."""
        v = self.views(b)
        inp = v["ids"]  # [n]
        if not self.k:  # rows whose token is the previous replay's argmax, still on the device (async scheduling)
            src = self.src[:b]
            inp = torch.where(src >= 0, self.next_ids[src.clamp(min=0)], inp)
        elif self.feed:  # rows following a verify still in flight move by its accepted count
            feed_in_flight(v, self.src[:b], self.last, self.next_ids, self.drafts, self.q, self.k, self.block_size)
        hidden = self.model(inp, v["pos"], self._batch(v))  # [n, H]
        logits = self.model.compute_logits(hidden, out=logits_out)  # [n, V] fp32
        return hidden, logits, greedy_block(logits, v["ids"], self.q, self.k, self.last, self.next_ids)

    def _draft_fn(self, b: int, hidden: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the target graph's [b * q, H] output; greedy: its greedy block -> drafts [b, k], and the greedy
        block with the drafts appended [b, 2q + 1 + k]."""
        m, n, v = self.model, b * self.q, self.views(b)
        # step 1 over every verify row (rows past the accepted ones write MTP KV that later steps overwrite)
        h = m.mtp_forward(self.next_ids[:n], hidden, v["pos"], self._batch(v), 0)  # [n, H]
        # rows [b]: the last committed verify row; pos, slots [k - 1, b]: where step j + 1 feeds draft j
        rows, pos, slots = draft_rows(v["ctx"], self.last, v["tables"], self.q, self.k, self.block_size)
        h = h.index_select(0, rows)  # [b, H] at the last committed position
        # the argmax of the model-dtype logits: the fp32 cast compute_logits adds is exact and keeps the order (same
        # ids, first max on ties) but writes [b, V] fp32 per draft step (~1.5 MB a row at a 248k vocabulary)
        drafts = [argmax_ids(m.draft_logits(h, self.draft_vocab))]
        for j in range(1, self.k):
            batch = ForwardBatch.decode(UniformDecode(1, pos[j - 1], v["state"]), v["tables"], slots[j - 1])
            h = m.mtp_forward(drafts[-1], h, pos[j - 1], batch, j)
            drafts.append(argmax_ids(m.draft_logits(h, self.draft_vocab)))
        out = torch.stack(drafts, 1)
        if self.feed:
            self.drafts[:b].copy_(out)  # what the next verify of these sequences feeds if this step is left in flight
        return out, torch.cat([greedy, out.double()], 1)

    def _fused_fn(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target forward, then the draft loop from its device acceptance -> hidden [n, H], greedy block with
        the drafts [b, 2q + 1 + k]."""
        hidden, _, greedy = self._target_fn(b, logits_out=self.target[b][2])
        return hidden, self._draft_fn(b, hidden, greedy)[1]

    def _capture(self, fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        g, out = capture(fn, self.device, self.barrier, self.pool)
        self.pool = self.pool or g.pool()
        return g, out

    def _capture_size(self, b: int) -> None:
        """The graphs of size b, on padded rows only (as build_uniform pads: positions 0..q-1, everything else 0:
        block 0, state slot 0), so the eager runs inside the captures advance no real sequence's GDN state. k > 0:
        the target graph is replayed first, so that the draft-loop capture reads real numbers (a capture only
        records; its outputs hold whatever the memory held, and a NaN hidden row drafts an id out of range), from
        the rows a warmup draft loop starts from (next ids and last rows 0)."""
        self.inputs.zero_()
        self.views(b)["pos"].copy_(torch.arange(self.q, device=self.device).repeat(b))
        self.src.fill_(-1)
        log.info("capturing the target graph for batch %d (%d tokens)", b, b * self.q)
        g, outs = self._capture(lambda: self._target_fn(b))
        self.target[b] = (g, *outs)
        if not self.k:
            return
        # the draft loop's graphs with it: every rank captures all three at this same step, in this order
        log.info("capturing the MTP draft-loop graphs for batch %d (k=%d)", b, self.k)
        g.replay()
        self.next_ids.zero_()
        self.last.zero_()
        hidden, greedy = self.target[b][1], self.target[b][3]
        g, outs = self._capture(lambda: self._draft_fn(b, hidden, greedy))
        self.draft[b] = (g, *outs)
        g, outs = self._capture(lambda: self._fused_fn(b))
        self.fused[b] = (g, *outs)

    # ---- replay ----
    def run_target(self, inp: StepInputs, b: int, src: list[int] | None = None, fused: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the target graph of size b on inp (built with size b and this width) -> hidden, logits.
        src: per live row, its sequence's row in the previous replay when that step is still in flight, or -1 (inp
        is exact); k = 0 takes the token from there, k > 0 everything that step's acceptance moves (graph_ops.py).
        fused (k > 0): the fused graph, the draft loop from the device acceptance in the same launch (the step's
        rows are all plain greedy, so nothing on the host comes between the two)."""
        u = inp.batch.uniform
        assert u is not None and u.context_lens.shape[0] == b and inp.batch.block_tables.shape[1] == self.width
        total = self.layout(b).total
        if b not in self.target:
            # a capture rewrites next_ids, which rows of the next step may still read: never with a step in flight
            # (every size is captured at warmup, and again only after a reset, which a drained group command does)
            assert not src or max(src) < 0, "a graph capture while a step is in flight"
            self._capture_size(b)
        assert inp.packed is not None and inp.packed.numel() == total, "graph inputs come packed (build_uniform)"
        assert src is None or (len(src) <= b and (not self.k or self.feed or max(src, default=-1) < 0))
        stage, ev = self.in_stage.next()
        stage[:total].copy_(inp.packed)
        stage[total : total + b].fill_(-1)
        if src:
            stage[total : total + len(src)].copy_(torch.tensor(src, dtype=torch.long))
        self.inputs[:total].copy_(stage[:total], non_blocking=True)  # one transfer
        self.src[:b].copy_(stage[total : total + b], non_blocking=True)
        if ev is not None:
            ev.record()
        if fused:
            assert self.k, "the fused graph runs the draft loop"
            (g, hidden, self.block), logits = self.fused[b], self.target[b][2]
        else:
            g, hidden, logits, self.block = self.target[b]
        g.replay()
        return hidden, logits

    def fetch(self, b: int, with_drafts: bool) -> Fetched:
        """Start the one device -> host copy of the last replays' greedy block: per sequence [argmax of each row (q),
        log-prob of each (q), accepted drafts (1, with k), next drafts (k, when the draft loop ran)] as floats (ids
        are exact below 2**53). `wait()` on the result blocks until it has landed."""
        block = self.block
        assert block is not None and block.shape[0] == b and (block.shape[1] > 2 * self.q + 1) == with_drafts, \
            "fetch follows the replay whose block it copies"
        stage, ev = self.out_stage.next()
        host = stage[: block.numel()].view(block.shape)
        host.copy_(block, non_blocking=True)
        if ev is not None:
            ev.record()
        return Fetched(host, ev)

    def ready_size(self, n: int) -> int:
        """The smallest size >= n whose target and draft-loop graphs are both captured (0: none)."""
        return next((b for b in sorted(self.sizes) if b >= n and b in self.target and b in self.draft), 0)

    def run_drafts_after_eager(self, inp: StepInputs, hidden: torch.Tensor, next_ids: torch.Tensor,
                               last: torch.Tensor, b: int) -> torch.Tensor:
        """The draft-loop graph after an eager target forward: the rows it starts from (inp: build_uniform of size
        b; hidden [b * q, H]) go where the target graph of size b leaves them, then the loop runs as after a
        verify -> drafts [b, k]. Nothing is in flight: an eager step resolves the step before it."""
        assert b in self.target and b in self.draft and inp.packed is not None
        self.inputs[: self.layout(b).total].copy_(inp.packed)
        self.target[b][1].copy_(hidden)
        return self.run_drafts(next_ids, last, b)

    def run_drafts(self, next_ids: torch.Tensor | None, last: torch.Tensor | None, b: int) -> torch.Tensor:
        """next_ids: [b * q] token after each verify row; last: [b] last committed row -> drafts [b, k] (device).
        None: the inputs are already in place (the target graph's device acceptance)."""
        if next_ids is not None and last is not None:
            self.next_ids[: b * self.q].copy_(next_ids, non_blocking=True)
            self.last[:b].copy_(last, non_blocking=True)
        assert b in self.draft, "the draft-loop graph is captured with the target graph of its size"
        g, drafts, self.block = self.draft[b]
        g.replay()
        return drafts
