"""CUDA graphs for steps that admit prompts: the target forward over a general batch (prefill pieces, with decode
rows beside them in a mixed step) of short pieces, padded to a token bucket.

An eager step that prefills a few short prompts costs 14-16x a batch-1 decode step at the 35B-A3B shapes (host
launch work: bench/prefill_steps.py), and under traffic every arrival stalls every running stream that long. Every
kernel of a general batch already takes its per-sequence fields from the device (cu_seqlens, contexts, state
slots, block tables, snapshots: layers/context.py), and the GDN layers' short-piece kernel is one launch a layer;
so a batch whose pieces are all short (SHORT_PIECE) is a fixed sequence of launches once its shapes are fixed:
T tokens (the bucket), N = min(T, max_num_seqs) sequences (those past the step's own are empty), S = N x max(2, q)
snapshot entries, block tables max-blocks wide. MTP verify rows (q = k + 1 tokens, the GDN state after each of them
kept for the rollback: spec_state_slots) go in as snapshot entries after 1 .. q of their tokens. Rows past the last
sequence belong to none: no KV write (slot -1), zero outputs from the kernels that write per sequence
(ForwardBatch.padded_rows). The graph ends at the final hidden
states; the commit computes the logits of the rows it needs, as after an eager forward.

Single-rank groups only (the runner builds these graphs where the MoE exchange is local): in a DP group the
choice would have to be group-wide and the EP exchange captured (issue 63 notes). Captured at warmup, largest
first, after the decode graphs; never on first use (a bucket not captured runs eager). A step's inputs go to the
device in one copy of the layout's prefix that holds them (the block tables come last, the step's rows only).

CPU (emulated graphs in tests): the captured function reads the lists back from the static buffer, with one more
sequence for the padding rows (state slot 0, no KV write), so that the CPU's per-sequence paths run it.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable

import numpy as np
import torch

from mtp_ray.engine.graphs import Staging, capture
from mtp_ray.engine.inputs import PackedLayout, StepInputs, packed_layout
from mtp_ray.layers.context import SHORT_PIECE, ForwardBatch, SnapshotMeta, VarlenStatic
from mtp_ray.model.qwen3_5 import Qwen3_5MoeForCausalLM

log = logging.getLogger(__name__)

# token buckets when graphs.mixed_tokens is not given (capped at the step budget and at MAX_TOKENS)
DEFAULT_TOKENS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
MAX_TOKENS = 2048


def default_buckets(budget: int) -> tuple[int, ...]:
    """Token buckets up to a step's token budget (max_num_batched_tokens), at most MAX_TOKENS."""
    cap = min(budget, MAX_TOKENS)
    return tuple(sorted({min(t, cap) for t in DEFAULT_TOKENS}))


class VarlenGraphs:
    def __init__(self, model: Qwen3_5MoeForCausalLM, buckets: tuple[int, ...], max_seqs: int, width: int,
                 device: torch.device, barrier: Callable[[], None] | None = None, q: int = 1):
        assert buckets and min(buckets) > 0
        self.per_seq = max(2, q)  # snapshot entries a sequence may have: a verify's q, a prefill piece's few
        self.model, self.buckets, self.width, self.device = model, tuple(sorted(set(buckets))), width, device
        self.max_seqs = max_seqs
        self.barrier = barrier or (lambda: None)
        top = self.layout(self.buckets[-1]).total  # (the largest layout: it grows with the bucket)
        self.inputs = torch.zeros(top, dtype=torch.long, device=device)
        self.stage = Staging(top, torch.long, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, hidden [T, H])
        self.pool = None

    def seqs(self, t: int) -> int:
        return min(t, self.max_seqs)

    def layout(self, t: int) -> PackedLayout:
        """ids, pos, slots [T]; cu [N + 1]; ctx, state [N]; snapshot ptr [N + 1], j and slot [S]; tables [N, W]
        last, so that a step copies only the prefix up to its own sequences' rows."""
        n = self.seqs(t)
        return packed_layout({"ids": (t,), "pos": (t,), "slots": (t,), "cu": (n + 1,), "ctx": (n,), "state": (n,),
                              "snap_ptr": (n + 1,), "snap_j": (self.per_seq * n,), "snap_slot": (self.per_seq * n,),
                              "tables": (n, self.width)})

    def reset(self) -> None:
        """Sleep frees the caches and weights the graphs point at: captured again at the next warmup."""
        self.graphs.clear()
        self.pool = None

    # ---- which steps ----
    def bucket_for(self, inp: StepInputs) -> int:
        """The smallest captured bucket that holds this general batch (0: it runs eager): short pieces only,
        within the bucket's sequences and snapshot entries."""
        b = inp.batch
        if b.uniform is not None or b.static is not None or not b.query_lens:
            return 0
        if max(b.query_lens) > SHORT_PIECE or b.block_tables.shape[1] > self.width:
            return 0
        s = len(b.snapshots or ()) + sum(map(len, b.spec_state_slots or ()))  # its snapshot entries
        t, n = b.num_tokens, b.num_seqs
        return next((x for x in self.buckets if x >= t and x in self.graphs and self.seqs(x) >= n
                     and self.per_seq * self.seqs(x) >= s), 0)

    # ---- the captured function ----
    def _batch(self, v: dict[str, torch.Tensor], t: int) -> ForwardBatch:
        if self.device.type == "cuda":
            none = torch.zeros(0, dtype=torch.long, device=self.device)
            snaps = SnapshotMeta(ptr=v["snap_ptr"], seq=none, offset=v["snap_j"], slots=v["snap_slot"], rows=none,
                                 cu_seqlens=v["cu"], chunk_indices=none.view(0, 2))
            return ForwardBatch.graphed(VarlenStatic(v["cu"], v["ctx"], v["state"], snaps, none.view(0, 2)),
                                        v["tables"], v["slots"])
        return _as_lists(v, t)

    def _fn(self, t: int) -> torch.Tensor:
        v = self.layout(t).views(self.inputs)
        return self.model(v["ids"], v["pos"], self._batch(v, t))  # [T, H]

    def capture(self, t: int) -> None:
        """Bucket t's graph on empty inputs (no sequence: every row padding, nothing written but state slot 0)."""
        lay = self.layout(t)
        self.inputs.zero_()
        lay.views(self.inputs)["slots"].fill_(-1)
        log.info("capturing the mixed-step graph for %d tokens", t)
        self.graphs[t] = self._capture(lambda: self._fn(t))

    def _capture(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        g, out = capture(fn, self.device, self.barrier, self.pool)
        self.pool = self.pool or g.pool()
        return g, out  # (out: a tensor)

    # ---- replay ----
    def run(self, inp: StepInputs, t: int) -> torch.Tensor:
        """Replay bucket t (from bucket_for) on this general batch -> hidden [T_step, H] (a view of the graph's
        static output: read it before the next replay)."""
        lay = self.layout(t)
        flat, used = pack(inp, lay, self.seqs(t), self.width)
        stage, ev = self.stage.next()
        stage[:used].copy_(torch.from_numpy(flat))
        self.inputs[:used].copy_(stage[:used], non_blocking=True)  # one transfer
        if ev is not None:
            ev.record()
        g, hidden = self.graphs[t]
        g.replay()
        return hidden[: inp.num_tokens]


def pack(inp: StepInputs, lay: PackedLayout, n_max: int, width: int) -> tuple[np.ndarray, int]:
    """A general batch (engine/inputs.py build) in `lay`'s order, padded: rows past its tokens feed token 0 at
    position 0 and write no KV; sequences past its own are empty (state slot 0). -> (the layout's prefix that
    holds the step, its length)."""
    b = inp.batch
    n, t = b.num_seqs, b.num_tokens
    assert n <= n_max and b.block_tables.shape[1] <= width
    used = lay.fields["tables"][0] + n * width  # the copy stops after the step's own table rows
    flat = np.zeros(lay.total, dtype=np.int64)  # (calloc: the pages past `used` are never touched)
    v = lay.views(flat)
    v["ids"][:t] = inp.input_ids.numpy()
    v["pos"][:t] = inp.positions.numpy()
    v["slots"][:t] = b.slot_mapping.numpy()
    v["slots"][t:] = -1
    v["cu"][: n + 1] = b.cu_seqlens
    v["cu"][n + 1 :] = t
    v["ctx"][:n] = b.context_lens
    v["state"][:n] = b.state_slots
    snaps = snapshot_entries(b)
    seq = [x for x, _, _ in snaps]
    v["snap_ptr"][:] = [bisect_left(seq, i) for i in range(n_max + 1)]
    v["snap_j"][: len(snaps)] = [j for _, j, _ in snaps]
    v["snap_slot"][: len(snaps)] = [slot for _, _, slot in snaps]
    v["tables"][:n, : b.block_tables.shape[1]] = b.block_tables.numpy()
    return flat[:used], used


def snapshot_entries(b: ForwardBatch) -> list[tuple[int, int, int]]:
    """(sequence, tokens in, state slot) for the GDN kernels, ordered: the prefix-cache snapshots inside prefill
    pieces (0 < j < piece), and each verify row's state after each of its tokens (j = 1 .. q: the rollback's)."""
    spec = [(i, j + 1, slot) for i, slots in enumerate(b.spec_state_slots or ()) for j, slot in enumerate(slots)]
    return sorted([*(b.snapshots or ()), *spec])


def _as_lists(v: dict[str, torch.Tensor], t: int) -> ForwardBatch:
    """CPU (emulated graphs): the static buffer read back as a list-form batch, its padding rows one more sequence
    (context 0, state slot 0, KV writes dropped) so that the CPU's per-sequence paths compute them too."""
    cu = v["cu"].tolist()
    real = [i for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]
    lens = [cu[i + 1] - cu[i] for i in real]
    ctx = [int(v["ctx"][i]) for i in real]
    slots = [int(v["state"][i]) for i in real]
    ptr, js, dst = v["snap_ptr"].tolist(), v["snap_j"].tolist(), v["snap_slot"].tolist()
    snaps = [(row, js[s], dst[s]) for row, i in enumerate(real) for s in range(ptr[i], ptr[i + 1])]
    # a sequence with an entry at its last token is a verify (a prefix snapshot lies inside its piece): its
    # entries are the rollback states, spec_state_slots in the list form
    verify = {row for row, j, _ in snaps if j == lens[row]}
    spec = [[slot for r, _, slot in snaps if r == row] if row in verify else [] for row in range(len(real))]
    snaps = [x for x in snaps if x[0] not in verify]
    tables = v["tables"][real] if real else v["tables"][:0]
    if cu[-1] < t:
        lens, ctx, slots, spec = lens + [t - cu[-1]], ctx + [0], slots + [0], spec + [[]]
        tables = torch.cat([tables, torch.zeros_like(v["tables"][:1])])
    return ForwardBatch(lens, ctx, tables, v["slots"], slots, spec if verify else None, snapshots=snaps or None)
