"""A CPU stand-in for `deep_ep` (the V1 `Buffer` API as documented in DeepEP's buffer.py), built on gloo
all-gathers, so that the DeepEP backend's use of the API (layouts, local expert ids, the expert-major low-latency
layout, weights applied by the low-latency combine only, buffer cleaning) is tested without a GPU. It reproduces
the documented results, not DeepEP's kernels or its summation order. Installed with
`sys.modules["deep_ep"] = fake_deep_ep`."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _Config:
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks * 1024


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `t` (first dims may differ)."""
    world = dist.get_world_size(group)
    n = torch.tensor([t.shape[0]])
    ns = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(ns, n, group=group)
    most = int(max(ns))
    pad = t.new_zeros((most, *t.shape[1:]))
    pad[: t.shape[0]] = t
    outs = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(outs, pad, group=group)
    return [o[: int(k)] for o, k in zip(outs, ns, strict=True)]


class Buffer:
    instances: list[Buffer] = []

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 12):
        assert num_nvl_bytes > 0 and num_rdma_bytes > 0 and low_latency_mode and num_qps_per_rank > 0
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.cleaned = 0
        self.dirty = False  # normal-protocol use since the last cleaning: low-latency kernels would misbehave
        Buffer.instances.append(self)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _Config:
        return _Config()

    @staticmethod
    def get_combine_config(num_ranks: int) -> _Config:
        return _Config()

    @staticmethod
    def get_low_latency_rdma_size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return max_tokens * hidden * num_ranks * 4

    def _owner(self, idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        assert num_experts % self.world == 0, "DeepEP needs experts divisible by the ranks"
        return torch.where(idx >= 0, idx // (num_experts // self.world), -1)

    # ---- normal protocol ----
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, **_):
        assert topk_idx.dtype == torch.int64
        owner = self._owner(topk_idx, num_experts)
        in_rank = torch.stack([(owner == r).any(1) for r in range(self.world)], dim=1)  # [T, world]
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        self._num_experts = num_experts
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, **_):
        assert handle is None and topk_idx is not None and topk_weights.dtype == torch.float32
        self.dirty = True
        per = self._num_experts // self.world
        xs, ids, ws, ins = (_gather(t, self.group) for t in (x, topk_idx, topk_weights, is_token_in_rank))
        rx, ridx, rw, src = [], [], [], []
        for s in range(self.world):
            tok = torch.nonzero(ins[s][:, self.rank]).flatten()  # each token once per rank, in token order
            rx.append(xs[s][tok])
            local = ids[s][tok] - self.rank * per
            mine = (local >= 0) & (local < per) & (ids[s][tok] >= 0)
            ridx.append(torch.where(mine, local, -1))
            rw.append(torch.where(mine, ws[s][tok], 0.0))
            src += [(s, int(t)) for t in tok]
        recv_idx = torch.cat(ridx)
        counts = [int((recv_idx == e).sum()) for e in range(per)]
        return torch.cat(rx), recv_idx, torch.cat(rw), counts, ("normal", src, x.shape[0]), None

    def combine(self, x, handle, topk_weights=None, **_):
        kind, src, n_tokens = handle
        assert kind == "normal"
        ys = _gather(x, self.group)
        srcs = _gather(torch.tensor(src, dtype=torch.long).view(-1, 2), self.group)
        out = torch.zeros(n_tokens, x.shape[1], dtype=torch.float32)
        for y, sm in zip(ys, srcs, strict=True):  # the partial sums of every rank, for this rank's tokens
            for row, (s, t) in enumerate(sm.tolist()):
                if s == self.rank:
                    out[t] += y[row].float()
        return out.to(x.dtype), None, None

    # ---- low-latency protocol ----
    def clean_low_latency_buffer(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        self.cleaned += 1
        self.dirty = False

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
                             async_finish=False, return_recv_hook=False):
        assert not self.dirty, "low-latency dispatch on a buffer dirtied by the normal protocol (not cleaned)"
        assert not use_fp8 and x.shape[0] <= num_max_dispatch_tokens_per_rank and topk_idx.dtype == torch.int64
        per, m = num_experts // self.world, num_max_dispatch_tokens_per_rank * self.world
        xs, ids = _gather(x, self.group), _gather(topk_idx, self.group)
        recv = torch.full((per, m, x.shape[1]), float("nan"), dtype=x.dtype)  # unspecified past the counts
        counts = torch.zeros(per, dtype=torch.int32)
        where = {}  # (expert, source rank, token) -> slot
        for e in range(per):
            g = self.rank * per + e
            for s in range(self.world):
                for t in torch.nonzero((ids[s] == g).any(1)).flatten().tolist():
                    n = int(counts[e])
                    recv[e, n] = xs[s][t]
                    where[(g, s, t)] = n
                    counts[e] += 1
        return recv, counts, ("ll", where, per), None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **_):
        kind, where, per = handle
        assert kind == "ll" and topk_weights.dtype == torch.float32
        # each rank publishes its expert outputs keyed by (expert, source, token); sources pick theirs
        keys = torch.tensor([[g, s, t, slot] for (g, s, t), slot in where.items()], dtype=torch.long).view(-1, 4)
        rows = x.reshape(-1, x.shape[-1])[keys[:, 0] % per * x.shape[1] + keys[:, 3]] if len(keys) else \
            x.new_zeros(0, x.shape[-1])
        all_keys, all_rows = _gather(keys, self.group), _gather(rows, self.group)
        got = {}
        for ks, rs in zip(all_keys, all_rows, strict=True):
            for (g, s, t, _), r in zip(ks.tolist(), rs, strict=True):
                if s == self.rank:
                    got[(g, t)] = r.float()
        out = torch.zeros(topk_idx.shape[0], x.shape[-1], dtype=torch.float32)
        for t in range(topk_idx.shape[0]):
            for j, g in enumerate(topk_idx[t].tolist()):
                if g >= 0:
                    out[t] += topk_weights[t, j] * got[(g, t)]
        return out.to(x.dtype), None, None
