"""The torch EP backend on 3 gloo ranks (no Ray): every forward gives each rank's tokens what all experts computed in
one place give them, through the protocol the table picks: gathered (all-gather + reduce-scatter: 3 collectives, no
header) for every forward whose padding is bounded, the normal all-to-all (header + 3) for uneven eager forwards, and
the header then the gathered exchange for an uneven decode batch."""

from __future__ import annotations

import torch

from mtp_ray.parallel.dp_meta import DPMeta, Gathered
from tests.ep_ranks import rank_setup, run_ranks

# (tokens per rank, decode?) -> collectives one MoE layer issues on every rank
STEPS = [((3, 4, 2), False, 3), ((9, 1, 1), False, 4), ((2, 2, 2), True, 3), ((6, 1, 1), True, 4),
         ((1, 1, 1), False, 3), ((5, 0, 4), False, 3)]


def table(tokens: tuple[int, ...], decoding: bool) -> Gathered:
    return Gathered(tuple(DPMeta(num_tokens=max(t, 1), batch_size=t, is_decoding=int(decoding), is_dummy=int(not t))
                          for t in tokens))


def _rank_main(rank: int, world: int, port: int, queue) -> None:
    try:
        from mtp_ray.parallel.ep.torch_a2a import TorchAllToAll

        e, h, inter, k = 9, 16, 8, 3
        ctx, full, mine = rank_setup(rank, world, port, e, h, inter)
        disp = TorchAllToAll(ctx)
        counts, errs = [], []
        for i, (tokens, decoding, _) in enumerate(STEPS):
            ctx.set_forward(table(tokens, decoding))
            gi = torch.Generator().manual_seed(100 * i + rank)
            t = tokens[rank]
            x = torch.randn(t, h, generator=gi)
            ids = torch.stack([torch.randperm(e, generator=gi)[:k] for _ in range(t)]) if t else torch.zeros(
                0, k, dtype=torch.long)
            w = torch.softmax(torch.randn(t, k, generator=gi), -1)
            before = ctx.collectives
            with torch.no_grad():
                out, ref = disp(x, ids, w, mine), full.per_slot(x, ids, w).sum(1)
            counts.append(ctx.collectives - before)
            errs.append(float((out - ref).abs().max()) if t else 0.0)
            ctx.forward = None
        queue.put((rank, counts, errs, None))
        ctx.shutdown()
    except Exception as ex:  # reported to the test, which would otherwise wait for a rank that died
        queue.put((rank, None, None, repr(ex)))


def test_torch_ep_protocols_on_three_ranks():
    results = run_ranks(_rank_main, 3)
    for rank, counts, errs, err in results:
        assert err is None, f"rank {rank}: {err}"
        assert counts == [c for _, _, c in STEPS], counts
        assert max(errs) < 1e-6, errs
