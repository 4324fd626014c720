"""Gated DeltaNet token mixer (Qwen3.5 linear-attention layers) with per-sequence conv + recurrent state slots."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mtp_ray.config.model import ModelConfig
from mtp_ray.layers.context import FLA_CHUNK, ForwardBatch
from mtp_ray.layers.gated_delta_ops import causal_conv1d, chunk_gated_delta, l2norm, recurrent_gated_delta
from mtp_ray.layers.linear import FusedProjections, Linear
from mtp_ray.layers.norm import GatedRMSNorm


def _fla() -> Callable | None:
    from mtp_ray.layers.triton.gated_delta_varlen import fla_chunk

    return fla_chunk()


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.in_proj_qkv = Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = Linear(h, self.value_dim, bias=False)
        self.in_proj_b = Linear(h, self.hv, bias=False)
        self.in_proj_a = Linear(h, self.hv, bias=False)
        # HF keeps nn.Conv1d's [C, 1, K] weight; we keep that shape so checkpoints load as they are
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)
        self.in_proj = FusedProjections(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        # bound by the engine: conv_state [slots, conv_dim, K-1] (model dtype), ssm_state [slots, Hv, dk, dv] fp32
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, H]
        assert self.conv_state is not None and self.ssm_state is not None, "GDN state not bound"
        t = x.shape[0]
        mixed, z, b_raw, a_raw = self.in_proj(x)  # [T, conv_dim], [T, value_dim], [T, Hv], [T, Hv]
        z = z.view(t, self.hv, self.dv)
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        u = batch.uniform
        if u is not None and x.is_cuda:  # two fused kernels (conv, recurrence), no per-token launches
            from mtp_ray.layers.triton.gated_delta import conv_decode, recurrent_decode

            conv = conv_decode(mixed, self.conv_state, weight, u.state_slots, u.spec_slots, u.q_len)
            core = recurrent_decode(conv, a_raw, b_raw, self.A_log, self.dt_bias, self.ssm_state, u.state_slots,
                                    u.spec_slots, u.q_len, self.hk, self.dk, x.dtype)
        elif x.is_cuda and batch.spec_state_slots is None and batch.short_pieces:
            from mtp_ray.layers.triton.gated_delta_varlen import recurrent_varlen

            core = self._varlen(mixed, a_raw, b_raw, weight, batch, recurrent_varlen, snapshots_in_kernel=True)
        elif x.is_cuda and x.dtype != torch.float32 and batch.spec_state_slots is None and _fla() is not None:
            from mtp_ray.layers.triton.gated_delta_varlen import chunk_varlen_fla

            core = self._varlen(mixed, a_raw, b_raw, weight, batch, chunk_varlen_fla)
        else:
            beta = b_raw.float().sigmoid()  # [T, Hv]
            g = -self.A_log.float().exp() * F.softplus(a_raw.float() + self.dt_bias.float())  # [T, Hv]
            if u is not None:
                core = self._uniform(mixed, g, beta, weight, batch)
            else:
                core = self._per_sequence(mixed, g, beta, weight, batch)
        out = self.norm(core.to(x.dtype), z)  # [T, Hv, dv]
        return self.out_proj(out.reshape(t, self.value_dim))

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # conv_out: [..., C] -> q, k: [..., Hv, dk] (L2-normed, q scaled), v: [..., Hv, dv], fp32
        q, k, v = conv_out.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead, rep = conv_out.shape[:-1], self.hv // self.hk
        # each key head serves `rep` consecutive value heads
        q = l2norm(q.view(*lead, self.hk, self.dk)).repeat_interleave(rep, dim=-2) * self.dk**-0.5
        k = l2norm(k.view(*lead, self.hk, self.dk)).repeat_interleave(rep, dim=-2)
        return q, k, v.view(*lead, self.hv, self.dv)

    def _uniform(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
                 batch: ForwardBatch) -> torch.Tensor:
        """Uniform decode / verify batch: batched over sequences, a static loop over the q_len tokens."""
        u = batch.uniform
        assert u is not None
        ql, kern = u.q_len, self.kernel
        bsz = u.state_slots.shape[0]
        conv_state = self.conv_state.index_select(0, u.state_slots)  # [B, C, K-1]
        ssm = self.ssm_state.index_select(0, u.state_slots)  # [B, Hv, dk, dv] fp32
        full = torch.cat([conv_state.to(mixed.dtype), mixed.view(bsz, ql, -1).transpose(1, 2)], -1)  # [B, C, K-1+ql]
        # accumulate in fp32 and round once, as conv1d does
        conv = (full.unfold(-1, kern, 1).float() * weight[:, None, :].float()).sum(-1).to(mixed.dtype)  # [B, C, ql]
        q, k, v = self._qkv(F.silu(conv).transpose(1, 2))  # [B, ql, Hv, d]
        g, beta = g.view(bsz, ql, -1), beta.view(bsz, ql, -1)
        out = torch.empty(bsz, ql, self.hv, self.dv, dtype=torch.float32, device=mixed.device)
        cdt = self.conv_state.dtype
        for j in range(ql):
            ssm = ssm * g[:, j].exp()[:, :, None, None]
            delta = (v[:, j] - torch.einsum("bhkv,bhk->bhv", ssm, k[:, j])) * beta[:, j, :, None]
            ssm = ssm + k[:, j, :, :, None] * delta[:, :, None, :]
            out[:, j] = torch.einsum("bhkv,bhk->bhv", ssm, q[:, j])
            if u.spec_slots is not None:
                self.ssm_state.index_copy_(0, u.spec_slots[:, j], ssm)
                self.conv_state.index_copy_(0, u.spec_slots[:, j], full[:, :, j + 1 : j + kern].to(cdt))
        self.ssm_state.index_copy_(0, u.state_slots, ssm)
        self.conv_state.index_copy_(0, u.state_slots, full[:, :, -(kern - 1) :].to(cdt))
        return out.view(bsz * ql, self.hv, self.dv)

    def _varlen(self, mixed: torch.Tensor, a_raw: torch.Tensor, b_raw: torch.Tensor, weight: torch.Tensor,
                batch: ForwardBatch, chunk_fn: Callable, snapshots_in_kernel: bool = False) -> torch.Tensor:
        """Prefill / mixed batch without verify rows: one conv launch over all sequences and one varlen delta rule
        (`chunk_fn`: the recurrent kernel for short pieces, fla's chunked one else; injectable so the CPU can check
        this path with the reference). fp32 models take fla's path never (its chunk kernels use TF32 dots inside):
        past short pieces they keep the per-sequence path. Prefix-cache snapshots: the conv kernel writes their
        conv states; the delta rule their recurrent states, in its own launch where it can (`snapshots_in_kernel`:
        the recurrent kernel), else from each snapshot's rows appended as a sequence of its own."""
        from mtp_ray.layers.triton.gated_delta_varlen import conv_varlen

        cu, ctx, slots = batch.device_lists(mixed.device)  # [N + 1], [N], [N]; ctx 0: a fresh sequence, zero states
        t, n = mixed.shape[0], batch.num_seqs
        snaps = batch.snapshot_meta(mixed.device) if batch.has_snapshots else None
        conv = conv_varlen(mixed, self.conv_state, weight, cu, slots, ctx, snaps)  # [T, C], conv states updated
        g = -self.A_log.float().exp() * F.softplus(a_raw.float() + self.dt_bias.float())  # [T, Hv] fp32
        beta = b_raw.sigmoid()  # [T, Hv] in the model dtype, as fla's own GDN layer passes it
        h0 = self.ssm_state.index_select(0, slots)  # [N, Hv, dk, dv] fp32
        h0 = torch.where(ctx[:, None, None, None] > 0, h0, torch.zeros((), dtype=h0.dtype, device=h0.device))
        chunks = batch.chunk_indices(mixed.device)
        rows_for_snaps = snaps is not None and not snapshots_in_kernel
        extra = {"snapshots": snaps, "states": self.ssm_state} if snaps is not None and snapshots_in_kernel else {}
        if batch.padded_rows:  # (only the short-piece kernel meets a static batch)
            extra["zero_rows"] = True
        if rows_for_snaps:  # the snapshots' rows again, as sequences of their own after the batch's
            conv, g, beta = (torch.cat([x, x.index_select(0, snaps.rows)]) for x in (conv, g, beta))
            h0 = torch.cat([h0, h0.index_select(0, snaps.seq)])
            cu, chunks = snaps.cu_seqlens, snaps.chunk_indices
        rows = conv.shape[0]
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        core, final = chunk_fn(q.view(rows, self.hk, self.dk), k.view(rows, self.hk, self.dk),
                               v.view(rows, self.hv, self.dv), g, beta, self.dk**-0.5, h0, cu, chunks, **extra)
        final = final.to(self.ssm_state.dtype)
        self.ssm_state.index_copy_(0, slots, final[:n])
        if rows_for_snaps:
            self.ssm_state.index_copy_(0, snaps.slots, final[n:])
        return core[:t]  # [T, Hv, dv]

    def _per_sequence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
                      batch: ForwardBatch) -> torch.Tensor:
        t = mixed.shape[0]
        core = torch.empty(t, self.hv, self.dv, dtype=torch.float32, device=mixed.device)
        prefix_snaps: dict[int, list[tuple[int, int]]] = {}
        for b, j, dst in batch.snapshots or ():
            prefix_snaps.setdefault(b, []).append((j, dst))
        for b in range(batch.num_seqs):
            s, e = batch.seq_range(b)
            slot = batch.state_slots[b]
            fresh = batch.context_lens[b] == 0
            conv_state = torch.zeros_like(self.conv_state[slot]) if fresh else self.conv_state[slot]
            ssm = torch.zeros_like(self.ssm_state[slot]) if fresh else self.ssm_state[slot]
            conv_out, full = causal_conv1d(mixed[s:e], conv_state, weight)  # [n, C]
            q, k, v = self._qkv(conv_out)  # [n, Hv, d]
            spec = batch.spec_state_slots[b] if batch.spec_state_slots is not None else None
            if spec or e - s == 1:
                snaps: list[torch.Tensor] | None = [] if spec else None
                o, ssm = recurrent_gated_delta(q, k, v, g[s:e], beta[s:e], ssm, snaps)
                for j, dst in enumerate(spec or []):
                    # state after token j: recurrent snapshot and the K-1 inputs ending at token j
                    self.ssm_state[dst] = snaps[j]
                    self.conv_state[dst] = full[:, j + 1 : j + self.kernel]
            else:
                snaps_b = prefix_snaps.get(b, ())
                # prefix-cache snapshots after j tokens, as a piece ending there would leave them: the state after
                # the whole chunks before j comes from this run; only the partial chunk up to j runs again
                kept: dict[int, torch.Tensor | None] = {j // FLA_CHUNK: None for j, _ in snaps_b}
                o, ssm = chunk_gated_delta(q, k, v, g[s:e], beta[s:e], ssm, FLA_CHUNK, kept)
                for j, dst in snaps_b:
                    a = j // FLA_CHUNK * FLA_CHUNK
                    base = kept[j // FLA_CHUNK]
                    if j > a:
                        _, base = chunk_gated_delta(q[a:j], k[a:j], v[a:j], g[s + a : s + j], beta[s + a : s + j],
                                                    base)
                    self.ssm_state[dst] = base
                    self.conv_state[dst] = full[:, j : j + self.kernel - 1]
            core[s:e] = o
            self.conv_state[slot] = full[:, -(self.kernel - 1) :]
            self.ssm_state[slot] = ssm
        return core
