"""EP dispatch / combine with DeepEP (`deep_ep.Buffer`, the V1 API: GPU, NVLink within a node).

Optional: chosen with `parallel.ep_backend: deepep` when `import deep_ep` works; the torch backend stays the
default. The protocol of every MoE layer comes from the gathered DPMeta (never locally), as with the torch backend:
  normal       (prefill, mixed and large decode batches; eager) get_dispatch_layout -> dispatch -> experts over
               the received tokens (each token once per rank, with its top-k ids local to this rank or -1) ->
               combine, which sums the ranks' partial outputs
  low_latency  (global decode batches of at most `ll_max_tokens` tokens per rank; graph-capturable: no host
               sync) low_latency_dispatch -> experts in DeepEP's expert-major layout [E_local, M, H] ->
               low_latency_combine, which applies the top-k weights and sums
The low-latency buffers hold `ll_max_tokens` = largest graph batch x (k + 1) tokens per rank; a global decode batch
larger than that takes the normal protocol (`Gathered.ep_mode`). DeepEP needs its low-latency buffer cleaned after
normal-protocol use: `prepare` does it before the first low-latency forward that follows a normal one, on every
rank at the same forward (it runs from `DistContext.set_forward`, also before graph replays).

Unlike the torch backend, the combine sums each token's expert outputs across ranks in DeepEP's order, so bf16
outputs of dp = N can differ from dp = 1 in the last bit (the torch backend keeps them identical).
"""

from __future__ import annotations

import torch

from mtp_ray.layers.moe import Experts
from mtp_ray.parallel.context import DistContext
from mtp_ray.parallel.dp_meta import EP_LOW_LATENCY, EP_NORMAL, Gathered


class DeepEPDispatcher:
    def __init__(self, ctx: DistContext, hidden: int, ll_max_tokens: int):
        import deep_ep

        assert ll_max_tokens > 0
        self.ctx, self.hidden, self.ll_max_tokens = ctx, hidden, ll_max_tokens
        self.num_experts = ctx.num_experts
        world = ctx.world
        Buffer = deep_ep.Buffer
        nvl = max(cfg.get_nvl_buffer_size_hint(hidden * 2, world)  # bf16 rows
                  for cfg in (Buffer.get_dispatch_config(world), Buffer.get_combine_config(world)))
        rdma = Buffer.get_low_latency_rdma_size_hint(ll_max_tokens, hidden, world, self.num_experts)
        # low-latency mode requires one queue pair per local expert
        self.buffer = Buffer(ctx.group, nvl, rdma, low_latency_mode=True,
                             num_qps_per_rank=max(1, self.num_experts // world))
        self.last_mode: int | None = None
        self.cleanings = 0
        ctx.on_forward = self.prepare

    def prepare(self, table: Gathered) -> None:
        mode = table.ep_mode
        if mode == EP_LOW_LATENCY and self.last_mode == EP_NORMAL:
            self.buffer.clean_low_latency_buffer(self.ll_max_tokens, self.hidden, self.num_experts)
            self.cleanings += 1
        self.last_mode = mode

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Experts
                 ) -> torch.Tensor:
        # x: [T, H] bf16; topk_ids / topk_w: [T, k] global expert ids and their routing weights
        mode = self.ctx.ep_mode()
        idx = topk_ids.to(torch.int64)
        self.ctx.collectives += 2
        if mode == EP_LOW_LATENCY:
            assert x.shape[0] <= self.ll_max_tokens, f"{x.shape[0]} tokens > low-latency capacity {self.ll_max_tokens}"
            recv, counts, handle, _, _ = self.buffer.low_latency_dispatch(
                x, idx, self.ll_max_tokens, self.num_experts, use_fp8=False)
            # at most every token of every rank once per top-k slot lands on this rank's experts
            y = experts.expert_major(recv, counts, recv.shape[1] * idx.shape[1])  # [E_local, M, H], unweighted
            out, _, _ = self.buffer.low_latency_combine(y, idx, topk_w.float(), handle)
            return out
        per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(idx, self.num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=topk_w.float())
        # received ids are local to this rank (-1: an expert elsewhere); the experts take global ids
        ids = torch.where(recv_idx >= 0, recv_idx + experts.start, -1)
        y = experts(recv_x, ids, recv_w.to(x.dtype))  # [N_recv, H]: weighted sum over this rank's experts
        out, _, _ = self.buffer.combine(y, handle)
        return out
