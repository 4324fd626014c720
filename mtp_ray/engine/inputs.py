"""Flat model inputs for the target step and the MTP draft steps, built from scheduled requests (CPU tensors)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from itertools import chain
from typing import TypeVar

import numpy as np
import torch

from mtp_ray.engine.block_manager import BlockManager
from mtp_ray.engine.request import Request
from mtp_ray.engine.scheduler import Scheduled
from mtp_ray.layers.context import ForwardBatch, UniformDecode

T = TypeVar("T", torch.Tensor, np.ndarray)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    batch: ForwardBatch
    logit_rows: list[list[int]]  # per sequence: rows of the flat batch whose logits are needed
    # uniform batches: every int field above as views of this one tensor, in `uniform_layout` order, so a graph
    # replay copies a step's inputs to the device in one transfer
    packed: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class Piece:
    """One sequence's share of a forward: tokens at positions [start, start + len(tokens))."""

    req: Request
    start: int
    tokens: list[int]
    logits: str  # "none" | "last" | "all"
    spec_slots: list[int] | None = None  # GDN snapshot slot per token (verify)
    snapshots: list[tuple[int, int]] | None = None  # prefix-cache GDN snapshots: (tokens into the piece, slot)
    # the block table of a request that released its own: one that finished at this step still has its KV-only
    # MTP step 1 to run (engine/commit.py), into blocks nothing can take before the step ends. `build` only: such a
    # piece is never part of a uniform batch (build_uniform reads the request's table, per decode step)
    block_ids: list[int] | None = None


def build(pieces: list[Piece], blocks: BlockManager) -> StepInputs:
    """The general batch (prefill chunks, mixed steps): any number of tokens per piece. Vectorized like
    build_uniform: a 4096-token prefill step would otherwise spend milliseconds in per-token Python."""
    n = len(pieces)
    qlens = [len(p.tokens) for p in pieces]
    t = sum(qlens)
    q = np.array(qlens, dtype=np.int64)  # [n]
    seq = np.repeat(np.arange(n), q)  # [T] sequence of each token
    first = np.cumsum(q) - q  # [n] first flat row of each sequence
    start = np.fromiter((p.start for p in pieces), np.int64, n)
    pos = np.arange(t) - first[seq] + start[seq]  # [T]
    held = [p.req.block_ids if p.block_ids is None else p.block_ids for p in pieces]
    nb = np.fromiter(map(len, held), np.int64, n)
    tables = _tables(held, nb, int(nb.max(initial=1)))
    slots = _slots(tables, seq, pos, nb, blocks.block_size)
    ids = np.fromiter(chain.from_iterable(p.tokens for p in pieces), np.int64, t)
    rows = []
    for p, base, m in zip(pieces, first.tolist(), qlens, strict=True):
        rows.append([] if p.logits == "none" else [base + m - 1] if p.logits == "last" else list(range(base, base + m)))
    spec = [p.spec_slots or [] for p in pieces]
    batch = ForwardBatch(
        query_lens=qlens,
        context_lens=start.tolist(),
        block_tables=torch.from_numpy(tables),
        slot_mapping=torch.from_numpy(slots),
        # a released table's piece takes the dummy state slot 0: the MTP layer has no GDN state
        state_slots=[p.req.state_slots[0] if p.block_ids is None else 0 for p in pieces],
        spec_state_slots=spec if any(spec) else None,
        snapshots=[(b, j, slot) for b, p in enumerate(pieces) for j, slot in p.snapshots or ()] or None,
    )
    return StepInputs(torch.from_numpy(ids), torch.from_numpy(pos), batch, rows)


def _tables(held: list[list[int]], nb: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """[n, width] block tables from each sequence's block ids (zeros past them; `out`: written in place), in one
    scatter."""
    n, total = len(held), int(nb.sum())
    tables = np.zeros((n, width), dtype=np.int64) if out is None else out
    rows = np.repeat(np.arange(n), nb)
    cols = np.arange(total) - np.repeat(np.cumsum(nb) - nb, nb)
    tables[rows, cols] = np.fromiter(chain.from_iterable(held), np.int64, total)
    return tables


def _slots(tables: np.ndarray, seq: np.ndarray, pos: np.ndarray, nb: np.ndarray, block_size: int) -> np.ndarray:
    """KV slot of each token (sequence seq at position pos): its block from the table, and the offset in it."""
    blk = pos // block_size
    assert (blk < nb[seq]).all(), "a sequence's blocks do not cover its tokens"
    return tables[seq, blk] * block_size + pos % block_size


UNIFORM_FIELDS = ("ids", "pos", "slots", "tables", "ctx", "state", "spec")


@dataclass(frozen=True)
class PackedLayout:
    """A step's int inputs packed into one int64 vector: the same layout on the host and in a CUDA graph's static
    input buffer, so a step's inputs move in one copy."""

    fields: dict[str, tuple[int, tuple[int, ...]]]  # name -> (offset, shape)
    total: int  # elements

    def views(self, flat: T) -> dict[str, T]:
        """Each field as a view of flat (a torch tensor or a numpy array: both reshape a contiguous slice in place)."""
        return {name: flat[at : at + math.prod(shape)].reshape(shape) for name, (at, shape) in self.fields.items()}


def packed_layout(shapes: dict[str, tuple[int, ...]]) -> PackedLayout:
    """The fields in the given order, each 16-byte aligned (`aligned`)."""
    fields, at = {}, 0
    for name, shape in shapes.items():
        fields[name] = (at, shape)
        at = aligned(at + math.prod(shape))
    return PackedLayout(fields, at)


@functools.lru_cache(maxsize=256)
def uniform_layout(b: int, q_len: int, width: int, spec: bool) -> PackedLayout:
    """b sequences of q_len tokens: ids, pos, slots [b * q_len]; tables [b, width]; ctx, state [b]; spec
    [b, q_len] (snapshot slots of a verify batch) or empty."""
    n = b * q_len
    shapes = {"ids": (n,), "pos": (n,), "slots": (n,), "tables": (b, width), "ctx": (b,), "state": (b,),
              "spec": (b, q_len) if spec else (0,)}
    return packed_layout({name: shapes[name] for name in UNIFORM_FIELDS})


def aligned(n: int) -> int:
    """n int64 elements rounded up to 16 bytes. Fields packed into one tensor start on 16-byte boundaries: Triton
    specializes each pointer argument on 16-byte alignment, so a field whose offset parity followed the batch size
    compiled every kernel reading it twice, the second time on a serving step (a cold server's first burst waited
    seconds: bench/cold_compiles.py)."""
    return n + (n & 1)


def build_uniform(pieces: list[Piece], blocks: BlockManager, q_len: int, size: int | None = None,
                  width: int | None = None, fed: bool = False) -> StepInputs:
    """A uniform decode / verify batch (every piece has q_len tokens), padded to `size` sequences and block tables
    `width` wide. Padded rows feed token 0 at positions 0.. into reserved block 0 and state slot 0.
    Written straight into one int64 array (`StepInputs.packed`) with a few vectorized numpy operations per step
    rather than Python work per sequence: this runs every decode step, at up to max_num_seqs sequences. With a
    size (graph steps) and q_len > 1 the snapshot slots are always present (zeros on padded rows).
    fed (graph verify steps, async verify): every piece follows a verify still in flight, whose graph replay sets
    the rows' tokens, positions and KV slots on the device from the tables, contexts and slots written here
    (engine/graph_ops.py feed_in_flight), so they are left 0: the work a k > 0 step would add on the host."""
    graph = size is not None
    n = len(pieces)
    size = n if size is None else size
    assert n <= size
    held = [p.req.block_ids for p in pieces]
    nb = np.fromiter(map(len, held), np.int64, n)  # [n] blocks per sequence
    width = width or int(nb.max(initial=1))
    has_spec = any(p.spec_slots for p in pieces) or (graph and q_len > 1)
    layout = uniform_layout(size, q_len, width, has_spec)
    flat = np.zeros(layout.total, dtype=np.int64)
    f = layout.views(flat)
    m = n * q_len
    f["pos"][m:] = np.tile(np.arange(q_len), size - n)  # padded rows: positions 0.., everything else 0
    if n:
        start = np.fromiter((p.start for p in pieces), np.int64, n)  # [n]
        assert (start > 0).all(), "a uniform batch decodes on top of a cached prefix"
        _tables(held, nb, width, out=f["tables"][:n])
        if not fed:
            pos = start[:, None] + np.arange(q_len)  # [n, q_len]
            f["slots"][:m] = _slots(f["tables"], np.repeat(np.arange(n), q_len), pos.reshape(-1), nb,
                                    blocks.block_size)
            f["ids"][:m] = np.fromiter(chain.from_iterable(p.tokens for p in pieces), np.int64, m)  # short: raises
            f["pos"][:m] = pos.reshape(-1)
        f["ctx"][:n] = start
        f["state"][:n] = np.fromiter((p.req.state_slots[0] for p in pieces), np.int64, n)
        if has_spec:
            zeros = [0] * q_len
            f["spec"][:n] = np.fromiter(chain.from_iterable(p.spec_slots or zeros for p in pieces), np.int64,
                                        m).reshape(n, q_len)
    rows_out = [list(range(b * q_len, (b + 1) * q_len)) if p.logits == "all" else [b * q_len + q_len - 1]
                for b, p in enumerate(pieces)]
    packed = torch.from_numpy(flat)
    v = layout.views(packed)
    batch = ForwardBatch.decode(UniformDecode(q_len, v["ctx"], v["state"], v["spec"] if has_spec else None),
                                v["tables"], v["slots"])
    return StepInputs(v["ids"], v["pos"], batch, rows_out, packed)


def is_uniform(sched: list[Scheduled], q_len: int) -> bool:
    """Every scheduled sequence decodes (verify with k drafts, or one token with k = 0) from a non-empty cache."""
    return bool(sched) and all(
        s.num_new == q_len and s.completes_prefill and s.req.num_computed > 0 and (q_len == 1 or s.verify)
        for s in sched)


def target_pieces(sched: list[Scheduled]) -> list[Piece]:
    out = []
    for s in sched:
        r = s.req
        if s.verify:
            toks = r.tokens(r.num_computed, r.num_computed + 1) + r.drafts
            out.append(Piece(r, r.num_computed, toks, "all", r.state_slots[1 : 2 + len(r.drafts)]))
        else:
            toks = r.tokens(r.num_computed, r.num_computed + s.num_new)
            # prompt_logprobs: every row of a piece that scores prompt tokens (Committer._score_prompts)
            scores = r.params.prompt_logprobs is not None and r.num_computed < len(r.prompt_ids) - 1
            out.append(Piece(r, r.num_computed, toks, "all" if scores else "last" if s.completes_prefill else "none",
                             snapshots=s.snapshots))
    return out


def dummy_inputs(num_tokens: int = 1, snapshot_at: int | None = None, max_len: int | None = None) -> StepInputs:
    """A padded forward for a rank with no work: reserved block 0 and state slot 0, KV writes dropped. The table
    names block 0 once per token, enough for any block size. snapshot_at (warmup): a prefix-cache snapshot after
    that many tokens, into slot 0 too. max_len (warmup): positions wrap below it, so a forward of a whole step's
    token budget, which may be longer than any sequence, reads only rope table rows that exist (the GPU table
    spans max_model_len; a position past it read out of bounds: an illegal memory access at engine start)."""
    batch = ForwardBatch(
        query_lens=[num_tokens], context_lens=[0], block_tables=torch.zeros(1, num_tokens, dtype=torch.long),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long), state_slots=[0],
        snapshots=None if snapshot_at is None else [(0, snapshot_at, 0)],
    )
    zeros = torch.zeros(num_tokens, dtype=torch.long)
    pos = torch.arange(num_tokens)
    return StepInputs(zeros, pos if max_len is None else pos % max_len, batch, [[]])
