"""EP dispatch / combine with torch.distributed.all_to_all_single (gloo on CPU, NCCL on GPU).

Two protocols, chosen only from the gathered DPMeta of the forward (never locally):
  gathered  every rank's tokens, padded to one size the table fixes (the graph's, or the largest over the group),
            are all-gathered once with their top-k; each rank computes its own experts' weighted output per
            (token, slot), zero for foreign experts, and a reduce-scatter hands each rank its tokens' slots. Each
            slot has exactly one non-zero term, so the sum is exact and the top-k sum after it is the one a single
            rank's grouped GEMM computes (dp = 2 equals dp = 1 bit for bit where dp = 1 takes that kernel; its
            small-batch pair kernel and the CPU path sum in another order). 3 collectives, no sizes on the host
            (no sync: CUDA graphs capture it, and an eager forward's host runs ahead of the device), a token crosses
            the link once on its way out. Taken by every graph and by eager forwards whose padding is bounded (the
            group's tokens fill at least half of the padded size, and the per-slot buffer stays under
            GATHERED_MAX_BYTES).
  normal    every (token, expert) pair travels to the expert's owner, is weighted there and comes back to be summed:
            a header (mode, row count) per rank pair read on the host, then variable-size rows: 4 collectives.
The gathered protocol issues the same collectives whatever EP mode a rank took, so a rank on the wrong mode cannot
corrupt an exchange; the mode each rank used is compared at the next DPMeta gather, which names it. Before the normal
protocol the header checks the mode in-band (a wrong protocol there would mean size-mismatched exchanges).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtp_ray.layers.moe import Experts
from mtp_ray.parallel.context import DistContext
from mtp_ray.parallel.dp_meta import EP_LOW_LATENCY, EP_MODE_NAMES, LockstepError

GATHERED_MAX_BYTES = 1 << 29  # one MoE layer's per-(token, slot) outputs on a rank; larger eager forwards: normal


class TorchAllToAll:
    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.owner = ctx.owner_table().to(ctx.device)

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.ctx.group)
        self.ctx.collectives += 1

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Experts
                 ) -> torch.Tensor:
        mode = self.ctx.ep_mode()
        fwd = self.ctx.forward
        if fwd.graph_size or self._gathered_fits(topk_ids.shape[1], x.shape[1] * x.element_size()):
            return self._gathered(x, topk_ids, topk_w, experts)
        dest = self.owner[topk_ids.reshape(-1)]  # [T*k] owning rank of each (token, expert) pair
        counts = torch.zeros(self.ctx.world, dtype=torch.long, device=x.device).scatter_add_(
            0, dest, torch.ones_like(dest))
        splits = self._header(mode, counts)
        if mode == EP_LOW_LATENCY:  # a decode batch too uneven or too large to gather: the same exchange
            return self._gathered(x, topk_ids, topk_w, experts)
        return self._normal(x, topk_ids, topk_w, experts, dest, *splits)

    def _gathered_fits(self, k: int, row_bytes: int) -> bool:
        """An eager forward's padding is bounded: the group's tokens fill at least half of world x the largest
        count (always with 2 ranks), and the per-(token, slot) output buffer stays under GATHERED_MAX_BYTES. A
        function of the table: the same answer on every rank."""
        fwd = self.ctx.forward
        padded = fwd.world * fwd.max_num_tokens
        total = sum(m.num_tokens for m in fwd.ranks)
        return padded <= 2 * total and padded * k * row_bytes <= GATHERED_MAX_BYTES

    def _header(self, mode: int, counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """Exchange (mode, rows) with every rank; every rank checks that all took the gathered mode. Returns the
        (send, receive) row counts per rank on the host, fetched in one copy: each device -> host read is a sync
        that drains the launch queue, so a MoE layer in the normal protocol pays exactly one."""
        world = self.ctx.world
        send = torch.stack([torch.full_like(counts, mode), counts], dim=1)  # [world, 2]
        recv = torch.empty_like(send)
        self._a2a(recv, send)
        host = torch.cat([recv.reshape(-1), counts]).tolist()  # [world*2 received (mode, rows) | world sent rows]
        modes, recv_n, send_n = host[0 : 2 * world : 2], host[1 : 2 * world : 2], host[2 * world :]
        decided = self.ctx.forward.ep_mode
        bad = [r for r, m in enumerate(modes) if m != decided]
        if bad:
            raise LockstepError(
                f"EP mode disagreement seen by rank {self.ctx.rank}: the gathered DPMeta decided "
                f"{EP_MODE_NAMES[decided]}, but " + ", ".join(f"rank {r} used {EP_MODE_NAMES[modes[r]]}" for r in bad)
                + f"\n{self.ctx.forward.describe()}")
        return send_n, recv_n

    def _normal(self, x, topk_ids, topk_w, experts, dest, send_n: list[int], recv_n: list[int]):
        t, k = topk_ids.shape
        ids = topk_ids.reshape(-1)  # [T*k]
        order = torch.argsort(dest, stable=True)
        token = (torch.arange(t * k, device=x.device) // k)[order]  # source token of each sent row
        x_recv = x.new_empty(sum(recv_n), x.shape[1])
        self._a2a(x_recv, x[token].contiguous(), recv_n, send_n)
        # expert id and weight travel together; float64 holds both exactly
        meta = torch.stack([ids[order].double(), topk_w.reshape(-1)[order].double()], dim=1)
        meta_recv = meta.new_empty(sum(recv_n), 2)
        self._a2a(meta_recv, meta, recv_n, send_n)
        y = experts(x_recv, meta_recv[:, :1].long(), meta_recv[:, 1:].to(x.dtype))  # [N_recv, H], weighted
        back = x.new_empty(t * k, x.shape[1])
        self._a2a(back, y, send_n, recv_n)
        return _combine(back, order, t, k)

    def _gathered(self, x, topk_ids, topk_w, experts):
        t, k = topk_ids.shape
        world, h = self.ctx.world, x.shape[1]
        fwd = self.ctx.forward
        # same on every rank: the graph's padded token count (identical by construction) or the gathered maximum
        n = t if fwd.graph_size else fwd.max_num_tokens
        assert t <= n, f"{t} tokens in a low-latency forward sized for {n}"
        if t < n:  # padded tokens route to expert -1, which no rank owns: their slots stay zero
            x = torch.cat([x, x.new_zeros(n - t, h)])
            topk_ids = torch.cat([topk_ids, topk_ids.new_full((n - t, k), -1)])
            topk_w = torch.cat([topk_w, topk_w.new_zeros(n - t, k)])
        xs = x.new_empty(world * n, h)
        self._gather(xs, x.contiguous())
        # expert id and weight travel together; float64 holds both exactly
        meta = torch.cat([topk_ids.double(), topk_w.double()], 1)  # [n, 2k]
        ms = meta.new_empty(world * n, 2 * k)
        self._gather(ms, meta)
        y = experts.per_slot(xs, ms[:, :k].long(), ms[:, k:].to(x.dtype))  # [world*n, k, H], 0 where foreign
        mine = y.new_empty(n, k, h)
        self._scatter_sum(mine, y)
        return mine[:t].sum(1)  # [t, H]: the top-k sum in slot order, as one rank sums its own experts

    def _gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        _all_gather(out, inp, group=self.ctx.group)
        self.ctx.collectives += 1

    def _scatter_sum(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        _reduce_scatter(out, inp, group=self.ctx.group)
        self.ctx.collectives += 1


# torch >= 2.13 names them *_single (the *_tensor names are deprecated there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _combine(back: torch.Tensor, order: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """back: [T*k, H] weighted expert outputs in sorted pair order -> [T, H] summed over each token's k pairs
    (put back in pair order and reduced: no atomics, so the sum is deterministic)."""
    return torch.empty_like(back).index_copy_(0, order, back).view(t, k, back.shape[-1]).sum(1)
