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


def test_packed_metadata_views_start_on_16_byte_boundaries():
    """Triton specializes pointer arguments on 16-byte alignment: a view whose offset followed the batch size's
    parity compiled every varlen kernel again on a serving step (bench/cold_compiles.py on the GPU)."""
    from mtp_ray.engine.inputs import uniform_layout

    for n in range(1, 9):
        views = [*_batch([2 + i for i in range(n)]).device_lists(torch.device("cpu")),
                 _batch([2 + i for i in range(n)]).chunk_indices(torch.device("cpu"))]
        assert [v.data_ptr() % 16 for v in views] == [0] * 4, n
        for q_len, width, spec in ((1, 3, False), (4, 5, True), (3, 2, True)):
            flat = torch.zeros(uniform_layout(n, q_len, width, spec).total, dtype=torch.long)
            offsets = [v.data_ptr() - flat.data_ptr() for v in uniform_layout(n, q_len, width, spec).views(flat)
                       .values()]
            assert [o % 16 for o in offsets] == [0] * len(offsets), (n, q_len, width, spec)
