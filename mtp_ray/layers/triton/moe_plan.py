"""The grouped MoE path's plan in one Triton launch (GPU): the (token, slot) pairs sorted by local expert (a stable
counting sort) and cut into tiles of BM rows, for the grouped GEMMs of triton/moe.py.

Torch ops did this before in ~25 launches a layer (a radix sort, scans, searchsorted, gathers: 1.1 ms of a 26 ms
step at batch 64 for the sort alone). A decode or verify step has at most a few thousand pairs: every program
counts them all (a histogram and a scan), then sorts its own block of pairs or writes its own tiles.

Keys: pair p = t * (k + SH) + j has key e - start for a routed slot whose expert e is local, E_LOCAL for the
shared expert's slot (j = k, SH = 1), E_LOCAL + SH for a foreign expert (sorted last, no tile, no row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mtp_ray.layers.triton import pdl


class Plan(NamedTuple):
    """Sorted row r (pairs grouped by key, stable) -> src[r]: the token (row of x) it reads, dst[r]: its pair id;
    tile i covers rows [r0[i], r1[i]) of expert te[i] (the shared expert: E_LOCAL); tiles past the last live one
    are empty (r0 = r1 = 0). src / dst have a row per pair (a static size); rows past the live ones are unset."""

    src: torch.Tensor  # [P] int32
    dst: torch.Tensor  # [P] int32
    te: torch.Tensor  # [NT] int32
    r0: torch.Tensor  # [NT] int32
    r1: torch.Tensor  # [NT] int32
    bm: int


@triton.jit
def _keys(ids_ptr, p, P, start, E_LOCAL, TOPK: tl.constexpr, SH: tl.constexpr, JUNK: tl.constexpr):
    """int32 key of each pair p (JUNK past the last pair)."""
    t = p // (TOPK + SH)
    j = p % (TOPK + SH)
    routed = j < TOPK
    e = tl.load(ids_ptr + t * TOPK + j, mask=(p < P) & routed, other=0) - start
    key = tl.where(routed, tl.where((e >= 0) & (e < E_LOCAL), e, E_LOCAL + SH), E_LOCAL)
    return tl.where(p < P, key, JUNK).to(tl.int32)


# batch-dependent: one compile serves every batch size. BM too (the tile rows, 16 or 64 by the batch): as a
# constexpr it made a second compile that only batches of ~500-900 tokens meet, after the warmup (1.5 s stall)
@triton.jit(do_not_specialize=["P", "NT", "NBLK", "BM"])
def _plan_kernel(ids_ptr, src_ptr, dst_ptr, te_ptr, r0_ptr, r1_ptr, P, start, E_LOCAL, NT, NBLK, BM,
                 TOPK: tl.constexpr, SH: tl.constexpr, NE: tl.constexpr, BP: tl.constexpr,
                 BH: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, NBLK) sort BP pairs each, the rest write BT tiles each; every program counts all P keys itself
    (a few thousand loads from L2), so none waits on another. NE: a power of two > E_LOCAL + SH + 1 (the last bin
    holds the junk past P)."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    bins = tl.arange(0, NE)
    first = pid * BP  # a sorting program's first pair
    counts = tl.zeros([NE], tl.int32)
    before = tl.zeros([NE], tl.int32)  # keys of the pairs before `first`
    for p0 in range(0, P, BH):
        p = p0 + tl.arange(0, BH)
        key = _keys(ids_ptr, p, P, start, E_LOCAL, TOPK, SH, NE - 1)
        counts += tl.histogram(key, NE)
        before += tl.histogram(tl.where(p < first, key, NE - 1), NE)
    seg = tl.cumsum(counts, 0) - counts  # each key's first sorted row
    if pid < NBLK:  # the counting sort: a pair's row = its key's first row + the earlier pairs of its key (stable)
        i = tl.arange(0, BP)
        p = first + i
        key = _keys(ids_ptr, p, P, start, E_LOCAL, TOPK, SH, NE - 1)
        rank = tl.sum(((key[:, None] == key[None, :]) & (i[None, :] < i[:, None])).to(tl.int32), 1)
        base = tl.where(bins == NE - 1, 0, seg + before)
        row = tl.sum(tl.where(key[:, None] == bins[None, :], base[None, :], 0), 1) + rank
        live = key < E_LOCAL + SH
        tl.store(src_ptr + row, (p // (TOPK + SH)).to(tl.int32), mask=live)
        tl.store(dst_ptr + row, p.to(tl.int32), mask=live)
    else:  # tiles: key e owns tiles [tcum[e] - ntiles[e], tcum[e]); a tile finds its key by searching tcum
        ntiles = tl.where(bins < E_LOCAL + SH, (counts + BM - 1) // BM, 0)
        tcum = tl.cumsum(ntiles, 0)
        it = (pid - NBLK) * BT + tl.arange(0, BT)
        e = tl.minimum(tl.sum((tcum[None, :] <= it[:, None]).to(tl.int32), 1), E_LOCAL + SH - 1)
        sel = e[:, None] == bins[None, :]
        tile0 = tl.sum(tl.where(sel, (tcum - ntiles)[None, :], 0), 1)
        row0 = tl.sum(tl.where(sel, seg[None, :], 0), 1)
        r0 = row0 + (it - tile0) * BM
        r1 = tl.minimum(r0 + BM, row0 + tl.sum(tl.where(sel, counts[None, :], 0), 1))
        live = it < tl.sum(ntiles, 0)
        tm = it < NT
        tl.store(te_ptr + it, e, mask=tm)
        tl.store(r0_ptr + it, tl.where(live, r0, 0), mask=tm)
        tl.store(r1_ptr + it, tl.where(live, r1, 0), mask=tm)


KERNEL_PAIRS = 8192  # up to this many pairs the one-launch plan; past it (prefill) torch's sort


def plan(ids: torch.Tensor, start: int, e_local: int, shared: bool, bm: int) -> Plan:
    """The plan of topk ids [T, k] (global expert ids) over local experts [start, start + e_local), plus the
    shared expert's T pairs (shared). Graph-safe: static sizes, no host sync."""
    t, k = ids.shape
    if t * (k + int(shared)) > KERNEL_PAIRS:
        return plan_torch(ids, start, e_local, shared, bm)
    return plan_launch(ids, start, e_local, shared, bm)


def plan_launch(ids: torch.Tensor, start: int, e_local: int, shared: bool, bm: int) -> Plan:
    """The plan in one launch, at any size (plan() takes it up to KERNEL_PAIRS pairs)."""
    t, k = ids.shape
    sh = int(shared)
    pairs = t * (k + sh)
    nt = triton.cdiv(pairs, bm) + e_local + sh  # a static bound: each key's last tile may be partial
    ne = triton.next_power_of_2(e_local + sh + 2)
    dev = ids.device
    src, dst = (torch.empty(pairs, dtype=torch.int32, device=dev) for _ in range(2))
    te, r0, r1 = (torch.empty(nt, dtype=torch.int32, device=dev) for _ in range(3))
    # [BP, NE] / [BT, NE] selections in registers: 16k elements a program
    bp, bt = (max(16, min(128, 16384 // ne)) for _ in range(2))
    nblk = triton.cdiv(pairs, bp)
    ids_arg = ids if k else src  # no routed slots (the shared expert alone): never read, but a device pointer
    _plan_kernel[(nblk + triton.cdiv(nt, bt),)](
        ids_arg, src, dst, te, r0, r1, pairs, start, e_local, nt, nblk, bm, TOPK=k, SH=sh, NE=ne, BP=bp, BH=1024,
        BT=bt, num_warps=4, **pdl.launch_args(dev))
    return Plan(src, dst, te, r0, r1, bm)


def plan_torch(ids: torch.Tensor, start: int, e_local: int, shared: bool, bm: int) -> Plan:
    """The same plan from torch ops (~25 launches; a parallel sort for the large batches of prefill)."""
    t, k = ids.shape
    sh = int(shared)
    key = torch.where((ids >= start) & (ids < start + e_local), ids - start, e_local + sh)
    if shared:
        key = torch.cat([key, torch.full((t, 1), e_local, dtype=key.dtype, device=key.device)], 1)
    key = key.reshape(-1)
    order = torch.argsort(key, stable=True)  # [P] pair ids, grouped by key
    counts = torch.zeros(e_local + sh + 1, dtype=torch.long, device=ids.device).scatter_add_(
        0, key, torch.ones_like(key))[: e_local + sh]
    seg_end = counts.cumsum(0)
    te, r0, r1 = tile_table(counts, seg_end - counts, seg_end, key.numel(), bm)
    i32 = torch.int32
    return Plan((order // (k + sh)).to(i32), order.to(i32), te, r0, r1, bm)


def tile_table(counts: torch.Tensor, seg_start: torch.Tensor, seg_end: torch.Tensor, rows: int, bm: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiles of up to bm rows over each key's rows [seg_start[e], seg_end[e]) (counts: [E]), as int32 (key, first
    row, end row) per tile, rows past `rows` cut off. Their number is a static bound, ceil(rows / bm) + E; tiles
    past the last live one are empty (r0 = r1 = 0)."""
    e = counts.shape[0]
    ntiles = (counts + bm - 1) // bm
    tile_cum = ntiles.cumsum(0)
    i = torch.arange(triton.cdiv(rows, bm) + e, device=counts.device)
    te = torch.searchsorted(tile_cum, i, right=True).clamp_max(e - 1)
    r0 = seg_start[te] + (i - (tile_cum[te] - ntiles[te])) * bm
    r1 = torch.clamp(torch.minimum(r0 + bm, seg_end[te]), max=rows)
    live = (i < tile_cum[-1]) & (r0 < r1)
    i32 = torch.int32
    return te.to(i32), torch.where(live, r0, 0).to(i32), torch.where(live, r1, 0).to(i32)
