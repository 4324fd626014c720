"""Pure-PyTorch gated delta rule kernels for one sequence (fp32). GPU kernels (fla) plug in behind the same calls.

Recurrence per value head h, token t (S: [dk, dv]):
    S <- exp(g_t) * S;  delta = beta_t * (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
q and k arrive L2-normalised, q already scaled by dk^-0.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtp_ray.layers.context import fla_chunks


def recurrent_gated_delta(
    q: torch.Tensor,  # [n, Hv, dk]
    k: torch.Tensor,  # [n, Hv, dk]
    v: torch.Tensor,  # [n, Hv, dv]
    g: torch.Tensor,  # [n, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [n, Hv]
    state: torch.Tensor,  # [Hv, dk, dv]
    snapshots: list[torch.Tensor] | None = None,  # receives a copy of the state after every token
) -> tuple[torch.Tensor, torch.Tensor]:  # o: [n, Hv, dv], final state: [Hv, dk, dv]
    s = state.clone()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
        if snapshots is not None:
            snapshots.append(s.clone())
    return out, s


def chunk_gated_delta(
    q: torch.Tensor,  # [n, Hv, dk]
    k: torch.Tensor,  # [n, Hv, dk]
    v: torch.Tensor,  # [n, Hv, dv]
    g: torch.Tensor,  # [n, Hv]
    beta: torch.Tensor,  # [n, Hv]
    state: torch.Tensor,  # [Hv, dk, dv]
    chunk: int = 64,
    kept: dict[int, torch.Tensor | None] | None = None,  # c -> filled with the state after the first c chunks
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY) form: within a chunk the deltas solve one unit-lower-triangular system
    (I + L) D = V*beta - (K*beta*Gamma) S0, with L_tj = beta_t Gamma_t/Gamma_j k_t.k_j for j < t."""
    n = q.shape[0]
    pad = (-n) % chunk
    # padded tokens have beta = 0 and g = 0: they neither write nor decay the state
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    nc = (n + pad) // chunk
    # -> [Hv, nc, C, d]
    q, k, v = (x.view(nc, chunk, *x.shape[1:]).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.view(nc, chunk, -1).permute(2, 0, 1) for x in (g, beta))  # [Hv, nc, C]
    gc = g.cumsum(-1)
    diff = gc[..., :, None] - gc[..., None, :]  # [Hv, nc, C, C]: log(Gamma_t / Gamma_j)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, diff, float("-inf")).exp()  # incl. diagonal, 0 above
    strict = decay.masked_fill(torch.eye(chunk, dtype=torch.bool, device=q.device), 0.0)
    kb = k * beta[..., None]
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    m = eye + (kb @ k.transpose(-1, -2)) * strict
    u = torch.linalg.solve_triangular(m, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(m, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay  # [Hv, nc, C, C]
    q_dec = q * gc.exp()[..., None]
    k_tail = k * (gc[..., -1:] - gc).exp()[..., None]
    out = torch.empty_like(v)
    s = state.clone()
    if kept is not None and 0 in kept:
        kept[0] = s
    for c in range(nc):
        delta = u[:, c] - w[:, c] @ s  # [Hv, C, dv]
        out[:, c] = q_dec[:, c] @ s + qk[:, c] @ delta
        s = s * gc[:, c, -1].exp()[:, None, None] + k_tail[:, c].transpose(-1, -2) @ delta
        if kept is not None and c + 1 in kept:
            kept[c + 1] = s
    out = out.permute(1, 2, 0, 3).reshape(nc * chunk, -1, v.shape[-1])[:n]
    return out, s


def causal_conv1d(
    x: torch.Tensor,  # [n, C]
    conv_state: torch.Tensor,  # [C, K-1]: the last K-1 inputs before x
    weight: torch.Tensor,  # [C, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # silu(conv) [n, C], the extended input [C, K-1+n]
    full = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)
    out = F.conv1d(full[None], weight[:, None, :].to(x.dtype), groups=full.shape[0])[0]  # [C, n]
    return F.silu(out).t(), full


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_varlen(
    q: torch.Tensor,  # [T, Hk, dk] raw (L2-normed and scaled here)
    k: torch.Tensor,  # [T, Hk, dk] raw
    v: torch.Tensor,  # [T, Hv, dv]
    g: torch.Tensor,  # [T, Hv] log decay, fp32
    beta: torch.Tensor,  # [T, Hv]
    scale: float,
    initial_state: torch.Tensor,  # [N, Hv, dk, dv] fp32
    cu_seqlens: torch.Tensor,  # [N + 1]: sequence b owns rows cu[b] .. cu[b + 1]
    chunk_indices: torch.Tensor,  # [NC, 2] (sequence, chunk) of each fla chunk (context.fla_chunks)
) -> tuple[torch.Tensor, torch.Tensor]:  # o: [T, Hv, dv] in v's dtype, final states [N, Hv, dk, dv] fp32
    """Reference for the varlen (fla) contract: the sequences one by one through chunk_gated_delta. The chunk
    indices are not needed here; they are checked against cu_seqlens (what fla would derive from it)."""
    rep = v.shape[1] // q.shape[1]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    final = torch.empty_like(initial_state, dtype=torch.float32)
    cu = cu_seqlens.tolist()
    want = fla_chunks([e - s for s, e in zip(cu[:-1], cu[1:], strict=True)])
    assert [tuple(x) for x in chunk_indices.tolist()] == want, "chunk_indices do not match cu_seqlens"
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        qb = l2norm(q[s:e].float()).repeat_interleave(rep, dim=1) * scale
        kb = l2norm(k[s:e].float()).repeat_interleave(rep, dim=1)
        out[s:e], final[b] = chunk_gated_delta(qb, kb, v[s:e].float(), g[s:e].float(), beta[s:e].float(),
                                               initial_state[b].float())
    return out.to(v.dtype), final
