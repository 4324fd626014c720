"""Per-forward batch metadata, built by the engine for each forward and read only by attention and GDN layers.

A forward runs over a flat token batch: sequence b owns tokens [cu_seqlens[b], cu_seqlens[b+1]). Its KV lives
in paged blocks (block_tables[b]); its Gated DeltaNet conv/recurrent state in one state slot.

Three forms: the general one (Python lists, per-sequence loops: prefill chunks, mixed steps); the uniform decode
form (`uniform` set): every sequence feeds the same q_len tokens and every field is a device tensor, so the forward
is a fixed sequence of batched kernels that a CUDA graph can capture and replay; and the static general form
(`static` set, engine/varlen_graphs.py): a general batch of short pieces padded to a token bucket, its per-sequence
fields device tensors of fixed shape (N sequences, the unused ones empty; rows past the last sequence belong to
none), so that a CUDA graph can capture a step that admits prompts as well.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate

import torch

FLA_CHUNK = 64  # the chunk length of fla's chunked gated delta rule (its default)
# GDN prefill: a batch of pieces of at most SHORT_PIECE new tokens, SHORT_TOKENS in all, takes the token-serial
# recurrent kernel (one launch a layer; device time ~1.3 us a token of the longest piece at 1 sequence, growing
# with the sequences) instead of fla's chunked kernels (0.75-1.5 ms of host time a layer through their Python
# launchers). At the 35B-A3B shapes on the H200 (bench/gdn_prefill.py) the recurrent kernel's device time stays
# under fla's host time up to 128 tokens x 8 sequences or 32 x 32 (519 / 469 us against 756 / 900)
SHORT_PIECE = 128
SHORT_TOKENS = 1024


def fla_chunks(lens: list[int]) -> list[tuple[int, int]]:
    """(sequence, chunk within it) of every FLA_CHUNK-token chunk of sequences of `lens` tokens: fla's layout."""
    return [(b, c) for b, n in enumerate(lens) for c in range(-(-n // FLA_CHUNK))]


@dataclass
class UniformDecode:
    """Decode (q_len = 1) or MTP verify (q_len = k + 1) batch; padded rows point at block 0 / state slot 0."""

    q_len: int
    context_lens: torch.Tensor  # [B] int64 tokens already cached before this forward
    state_slots: torch.Tensor  # [B] int64 GDN state slot: read at start, written at the end
    spec_slots: torch.Tensor | None = None  # [B, q_len] int64 GDN state after token j (verify rollback)


@dataclass(frozen=True)
class SnapshotMeta:
    """ForwardBatch.snapshots on the device, ordered by (sequence, j); S snapshots, R = the sum of their j."""

    ptr: torch.Tensor  # [N + 1] int64 sequence b's snapshots are ptr[b] .. ptr[b + 1] (the kernels' view)
    seq: torch.Tensor  # [S] int64 the sequence each snapshot is taken from
    offset: torch.Tensor  # [S] int64 j: the state after that sequence's first j new tokens
    slots: torch.Tensor  # [S] int64 state slot receiving the snapshot
    rows: torch.Tensor  # [R] int64 batch rows of the appended sequences (each snapshot's first j rows)
    cu_seqlens: torch.Tensor  # [N + S + 1] the batch's sequences, then the appended ones
    chunk_indices: torch.Tensor  # [NC, 2] fla's chunk layout of that extended batch


@dataclass(frozen=True)
class VarlenStatic:
    """A general batch's per-sequence fields on the device at fixed shapes (a CUDA graph's static inputs): N
    sequences, those past the step's own empty (cu_seqlens repeats; state slot 0, context 0); rows from cu[N] to the
    batch's end are padding that no sequence owns (no KV write, zero outputs from attention and the delta rule).
    Snapshots: at most S, always passed to the GDN kernels (ptr ranges empty where none)."""

    cu_seqlens: torch.Tensor  # [N + 1] int64
    context_lens: torch.Tensor  # [N] int64
    state_slots: torch.Tensor  # [N] int64
    snapshots: SnapshotMeta  # ptr [N + 1], offset / slots [S]; the fla-path fields unused (short pieces only)
    no_chunks: torch.Tensor  # [0, 2] int64: chunk_indices (the short-piece kernel reads none)


@dataclass
class ForwardBatch:
    query_lens: list[int]  # new tokens of each sequence in this forward
    context_lens: list[int]  # tokens already in the KV cache / folded into the state before this forward
    block_tables: torch.Tensor  # [B, max_blocks] int64, KV block ids (covering context + new tokens)
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot (block * block_size + offset) per token; -1: not written
    state_slots: list[int]  # GDN state slot per sequence: read at start, written at the end
    # Speculative verify: spec_state_slots[b][j] receives the GDN conv + recurrent state after token j of
    # sequence b, so that the engine can commit the state at the accepted length (rollback).
    spec_state_slots: list[list[int]] | None = None
    uniform: UniformDecode | None = None  # set: the batched decode form (lists above unused, may be empty)
    # Prefix-cache snapshots inside a prefill piece (design.md 10.1): (sequence b, j, slot) asks every GDN layer
    # for b's conv + recurrent state after its first j new tokens, written to state slot `slot`
    snapshots: list[tuple[int, int, int]] | None = None
    # RoPE cos / sin of this forward's positions, computed by the first attention layer and shared by the rest
    rope_cache: dict = field(default_factory=dict, repr=False)
    static: VarlenStatic | None = None  # set: the static general form (the lists above unused, empty)

    def __post_init__(self) -> None:
        if self.static is not None:
            assert self.uniform is None and not self.query_lens and not self.snapshots
            self.cu_seqlens = []
            self.short_pieces = True  # the only kind a static batch holds (engine/varlen_graphs.py)
            return
        if self.uniform is None:
            assert len(self.query_lens) == len(self.context_lens) == len(self.state_slots)
        assert self.slot_mapping.numel() == sum(self.query_lens)
        assert not self.snapshots or self.uniform is None and all(
            0 < j < self.query_lens[b] for b, j, _ in self.snapshots), "a snapshot lies inside a prefill piece"
        self.cu_seqlens = [0]
        for q in self.query_lens:
            self.cu_seqlens.append(self.cu_seqlens[-1] + q)
        # the GDN layers' prefill kernel: token-serial for short pieces (SHORT_PIECE; a uniform batch has its own)
        self.short_pieces = (self.uniform is None and max(self.query_lens, default=0) <= SHORT_PIECE
                             and self.cu_seqlens[-1] <= SHORT_TOKENS)

    @classmethod
    def decode(cls, u: UniformDecode, block_tables: torch.Tensor, slot_mapping: torch.Tensor) -> ForwardBatch:
        b = u.context_lens.shape[0]
        return cls([u.q_len] * b, [], block_tables, slot_mapping, [], None, u)

    @classmethod
    def graphed(cls, static: VarlenStatic, block_tables: torch.Tensor, slot_mapping: torch.Tensor) -> ForwardBatch:
        return cls([], [], block_tables, slot_mapping, [], static=static)

    @property
    def num_seqs(self) -> int:
        return self.static.state_slots.shape[0] if self.static is not None else len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel() if self.static is not None else self.cu_seqlens[-1]

    @property
    def has_snapshots(self) -> bool:
        """The GDN layers take prefix-cache snapshots in this forward (a static batch: always passed, maybe none)."""
        return self.static is not None or bool(self.snapshots)

    @property
    def padded_rows(self) -> bool:
        """Rows that no sequence owns may follow the sequences' (static form): kernels that write per sequence
        leave those rows of their output zero, not whatever the memory held."""
        return self.static is not None

    def seq_range(self, b: int) -> tuple[int, int]:
        return self.cu_seqlens[b], self.cu_seqlens[b + 1]

    def device_lists(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cu_seqlens [B + 1], context_lens [B], state_slots [B] (int64) on `device`, for the varlen kernels of a
        general batch: one host -> device copy per forward, cached here and shared by every attention and GDN
        layer ("cuda" and "cuda:0" are one device here). The same tensor objects on every call: fla caches what it
        derives from cu_seqlens by identity."""
        return self._device_meta(device)[:3]

    def chunk_indices(self, device: torch.device) -> torch.Tensor:
        """[num_chunks, 2] int64 (sequence, chunk within it) over FLA_CHUNK-token chunks of the new tokens: fla's
        chunk_indices, built on the host and copied with device_lists, so that no GDN layer derives it on the
        device (a device sync per layer: a repeat_interleave of device-side counts)."""
        return self._device_meta(device)[3]

    def snapshot_meta(self, device: torch.device) -> SnapshotMeta:
        """The snapshots for the GDN kernels: per sequence its (j, slot) list (the conv kernel and the short-piece
        recurrence write them in the same launch), and as one more varlen batch for a delta rule that cannot (fla):
        each a copy of its sequence's first j rows appended after the batch's own sequences, so one chunked call
        yields its state exactly as a piece ending there. One host -> device copy, cached for every layer."""
        if self.static is not None:
            return self.static.snapshots
        cached = self.rope_cache.get("snapshots")
        if cached is None or cached.seq.device.type != torch.device(device).type:
            assert self.snapshots, "no snapshots in this batch"
            snaps = sorted(self.snapshots)
            lens = list(self.query_lens) + [j for _, j, _ in snaps]
            cu = self.cu_seqlens + list(accumulate((j for _, j, _ in snaps), initial=self.cu_seqlens[-1]))[1:]
            rows = [r for b, j, _ in snaps for r in range(self.cu_seqlens[b], self.cu_seqlens[b] + j)]
            seq = [b for b, _, _ in snaps]
            ptr = [bisect_left(seq, b) for b in range(self.num_seqs + 1)]
            p, s, o, sl, r, c, ch = _packed([ptr, seq, [j for _, j, _ in snaps], [x for _, _, x in snaps], rows, cu,
                                             [x for pair in fla_chunks(lens) for x in pair]], device)
            cached = SnapshotMeta(ptr=p, seq=s, offset=o, slots=sl, rows=r, cu_seqlens=c, chunk_indices=ch.view(-1, 2))
            self.rope_cache["snapshots"] = cached
        return cached

    def _device_meta(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if self.static is not None:
            st = self.static
            return st.cu_seqlens, st.context_lens, st.state_slots, st.no_chunks
        cached = self.rope_cache.get("varlen")
        if cached is None or cached[0].device.type != torch.device(device).type:
            views = _packed([self.cu_seqlens, list(self.context_lens), list(self.state_slots),
                             [x for pair in fla_chunks(self.query_lens) for x in pair]], device)
            cached = (*views[:3], views[3].view(-1, 2))
            self.rope_cache["varlen"] = cached
        return cached


def _packed(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 lists -> views of one tensor on `device` (one host -> device copy), each starting on a 16-byte boundary
    (an even offset): Triton specializes pointers on 16-byte alignment, and offsets that followed the batch size's
    parity made every varlen kernel compile again on the first serving step of the other parity
    (bench/cold_compiles.py)."""
    flat: list[int] = []
    starts = []
    for part in parts:
        flat += [0] * (len(flat) & 1)
        starts.append(len(flat))
        flat += part
    meta = torch.tensor(flat, dtype=torch.long).to(device)
    return [meta[a : a + len(p)] for a, p in zip(starts, parts, strict=True)]
