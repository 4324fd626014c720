"""Per-forward batch metadata, built by the engine for each forward and read only by attention and GDN layers.

A forward runs over a flat token batch: sequence b owns tokens [cu_seqlens[b], cu_seqlens[b+1]). Its KV lives
in paged blocks (block_tables[b]); its Gated DeltaNet conv/recurrent state in one state slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def __post_init__(self) -> None:
        assert len(self.query_lens) == len(self.context_lens) == len(self.state_slots)
        assert self.slot_mapping.numel() == sum(self.query_lens)
        self.cu_seqlens = [0]
        for q in self.query_lens:
            self.cu_seqlens.append(self.cu_seqlens[-1] + q)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    def seq_range(self, b: int) -> tuple[int, int]:
        return self.cu_seqlens[b], self.cu_seqlens[b + 1]
