"""EP dispatch / combine with torch.distributed.all_to_all_single (gloo on CPU, NCCL on GPU).

Every (token, expert) pair travels to the expert's owner, is weighted there, and returns to be summed.
Two protocols, chosen only from the gathered DPMeta of the forward (never locally):
  normal       exchange row counts, then variable-size rows: 4 collectives per MoE layer
  low_latency  fixed capacity per rank pair (max tokens over the group x top_k), padded rows marked with
               expert id -1, no count exchange: 3 collectives per MoE layer (global decode batches)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtp_ray.dist.context import DistContext
from mtp_ray.dist.dp_meta import EP_LOW_LATENCY
from mtp_ray.layers.moe import Experts


class TorchAllToAll:
    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.owner = ctx.owner_table().to(ctx.device)

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.ctx.group)
        self.ctx.collectives += 1

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Experts
                 ) -> torch.Tensor:
        if self.ctx.ep_mode() == EP_LOW_LATENCY:
            return self._low_latency(x, topk_ids, topk_w, experts)
        return self._normal(x, topk_ids, topk_w, experts)

    def _normal(self, x, topk_ids, topk_w, experts):
        t, k = topk_ids.shape
        world = self.ctx.world
        ids = topk_ids.reshape(-1)  # [T*k]
        dest = self.owner[ids]
        order = torch.argsort(dest, stable=True)
        token = (torch.arange(t * k, device=x.device) // k)[order]  # source token of each sent row
        send_counts = torch.bincount(dest, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        self._a2a(recv_counts, send_counts)
        send_n, recv_n = send_counts.tolist(), recv_counts.tolist()
        x_recv = x.new_empty(sum(recv_n), x.shape[1])
        self._a2a(x_recv, x[token].contiguous(), recv_n, send_n)
        # expert id and weight travel together; float64 holds both exactly
        meta = torch.stack([ids[order].double(), topk_w.reshape(-1)[order].double()], dim=1)
        meta_recv = meta.new_empty(sum(recv_n), 2)
        self._a2a(meta_recv, meta, recv_n, send_n)
        y = experts(x_recv, meta_recv[:, :1].long(), meta_recv[:, 1:].to(x.dtype))  # [N_recv, H], weighted
        back = x.new_empty(t * k, x.shape[1])
        self._a2a(back, y, send_n, recv_n)
        return torch.zeros_like(x).index_add_(0, token, back)

    def _low_latency(self, x, topk_ids, topk_w, experts):
        t, k = topk_ids.shape
        world, h = self.ctx.world, x.shape[1]
        assert self.ctx.forward is not None
        cap = self.ctx.forward.max_num_tokens * k  # same on every rank: from the gathered table
        ids = topk_ids.reshape(-1)
        dest = self.owner[ids]
        order = torch.argsort(dest, stable=True)
        counts = torch.bincount(dest, minlength=world)
        starts = torch.cumsum(counts, 0) - counts
        # slot of each sorted row inside its destination's block of `cap` rows
        pos = torch.arange(t * k, device=x.device) - starts[dest[order]]
        slot = dest[order] * cap + pos
        token = (torch.arange(t * k, device=x.device) // k)[order]
        x_send = x.new_zeros(world * cap, h)
        x_send[slot] = x[token]
        meta = torch.full((world * cap, 2), -1.0, dtype=torch.float64, device=x.device)
        meta[slot, 0] = ids[order].double()
        meta[slot, 1] = topk_w.reshape(-1)[order].double()
        x_recv, meta_recv = torch.empty_like(x_send), torch.empty_like(meta)
        self._a2a(x_recv, x_send)
        self._a2a(meta_recv, meta)
        valid = meta_recv[:, 0] >= 0
        y = torch.zeros_like(x_recv)
        if valid.any():
            y[valid] = experts(x_recv[valid], meta_recv[valid, :1].long(), meta_recv[valid, 1:].to(x.dtype))
        back = torch.empty_like(y)
        self._a2a(back, y)
        return torch.zeros_like(x).index_add_(0, token, back[slot])
