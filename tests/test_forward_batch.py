"""ForwardBatch's per-forward device metadata (CPU): one cached copy, stable tensor identities, fla's chunk layout."""

from __future__ import annotations

import torch

from mtp_ray.layers.context import FLA_CHUNK, ForwardBatch


def _batch(lens: list[int]) -> ForwardBatch:
    return ForwardBatch(query_lens=lens, context_lens=[5 * i for i in range(len(lens))],
                        block_tables=torch.zeros(len(lens), 1, dtype=torch.long),
                        slot_mapping=torch.zeros(sum(lens), dtype=torch.long),
                        state_slots=[9 - i for i in range(len(lens))])


def test_device_lists_are_one_cached_copy_with_stable_identities():
    b = _batch([3, 1, 70])
    cu, ctx, slots = b.device_lists(torch.device("cpu"))
    assert cu.tolist() == [0, 3, 4, 74] and ctx.tolist() == [0, 5, 10] and slots.tolist() == [9, 8, 7]
    again = b.device_lists(torch.device("cpu"))
    assert all(x is y for x, y in zip((cu, ctx, slots), again, strict=True))  # fla caches by identity
    assert b.chunk_indices(torch.device("cpu")) is b.chunk_indices(torch.device("cpu"))


def test_chunk_indices_follow_the_query_lengths_in_fla_chunks():
    lens = [1, FLA_CHUNK, FLA_CHUNK + 1, 2 * FLA_CHUNK + 2, 3]
    ci = _batch(lens).chunk_indices(torch.device("cpu"))
    assert ci.dtype == torch.long and ci.shape[1] == 2
    assert ci.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2], [4, 0]]
