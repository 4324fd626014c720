"""Tile sweep for the bandwidth-bound decode kernels at Qwen3.5-35B-A3B shapes (GPU), next to cuBLAS.

    python bench/kernels.py [--out bench/results/kernels.json] [--rows 1 4]

For each shape and tile config: the time of one launch inside a CUDA graph of 20 launches (the launch gap
included, as in a decode step), and the bandwidth that implies. The launches cycle through enough weight copies
(dense) or expert choices (MoE) to read > 2x the L2 cache per cycle, so a small weight is timed from memory, as in
a decode step, not from L2 (sweeps before 2026-11-30 lacked this and flattered shapes under ~50 MB). Also the
time of an empty kernel in a graph (the per-launch floor). The JSON lists every config and the best per shape,
to set the heuristics in layers/triton/linear.py and layers/triton/moe_small.py.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mtp_ray.layers.fp8 import Fp8Block, Fp8Weight, quantize, scale_shape
from mtp_ray.layers.triton.linear import _gemv_kernel, _gemv_row_kernel, gemv, tiles
from mtp_ray.layers.triton.moe_small import _gate_up_kernel, down_sum

H, INTER, EXPERTS, TOPK = 2048, 512, 256, 8
# (name, N, K): the dense projections of one layer (fused GDN input, fused attention q/k/v, outputs, router)
DENSE = [("gdn_in_fused", 12352, 2048), ("gdn_qkv", 8192, 2048), ("gdn_z", 4096, 2048),
         ("attn_qkv_fused", 9216, 2048), ("out_proj", 2048, 4096), ("o_proj", 2048, 4096), ("router", 256, 2048),
         ("gdn_a", 32, 2048)]


@triton.jit
def _empty_kernel(x_ptr):
    tl.store(x_ptr + tl.program_id(0), 1.0)


L2_BYTES = 50 * 2**20  # H200


def graph_time(fn, launches: int = 20, reps: int = 10, variants: int = 1) -> float:
    """Seconds per launch of fn(i) replayed inside a CUDA graph of `launches` launches, i cycling through
    `variants` input sets (median of reps)."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            fn(i % variants)
    times = []
    for _ in range(reps + 2):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / launches)
    t = sorted(times[2:])
    return t[len(t) // 2]


def _copies(nbytes: int, launches: int = 20) -> int:
    """Weight copies to cycle through so one cycle reads more than twice the L2 cache."""
    return max(1, min(launches, -(-2 * L2_BYTES // nbytes) + 1))


def _gemv(x, ws, y, bn, bk, warps, stages, i) -> None:
    w = ws[i]
    m, k = x.shape
    n = w.shape[0]
    _gemv_kernel[(1, triton.cdiv(n, bn), 1)](x, w, x, y, y, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), 0,
                                             BM=16, BN=bn, BK=bk, SUB=1, IEEE=False, FP8=False, TILE_SCALE=False,
                                             SN=1, SK=1, KP=1, SPLIT=1, PDL=False, num_warps=warps, num_stages=stages)


def _row(x, ws, y, bn, bk, warps, stages, i) -> None:
    w = ws[i]
    n, k = w.shape
    _gemv_row_kernel[(triton.cdiv(n, bn),)](x, w, x, y, n, k, w.stride(0), 0, BN=bn, BK=bk,
                                            K_TILES=triton.cdiv(k, bk), SUB=1, FP8=False, TILE_SCALE=False,
                                            ROW_SCALE=False, SN=1, SK=1, KP=1, PDL=False,
                                            num_warps=warps, num_stages=stages)


def _up(x, idss, gv, uv, sg, act, bn, bk, warps, i) -> None:
    # routed pairs + one shared-expert pair per token (SH = 1), as a decode step without EP runs them
    ids = idss[i]
    _gate_up_kernel[(act.shape[0], triton.cdiv(INTER, bn))](
        x, ids, gv, uv, sg[:INTER], sg[INTER:], gv, gv, gv, act, 0, EXPERTS, H, INTER, INTER, x.stride(0),
        gv.stride(0), gv.stride(1), sg.stride(0), act.stride(0), 0, 0, 0, TOPK=TOPK, SH=1, BN=bn, BK=bk,
        H_TILES=triton.cdiv(H, bk), FP8=False, TILE_SCALE=False, SN=1, SK=1, PDL=False, num_warps=warps)


def _down(act, idss, tw, down, x, sd, gw, y, bn, bk, warps, i) -> None:
    # bk, warps: fixed by down_sum (one I tile of up to 512, 4 warps); the sweep varies BN
    down_sum(act, idss[i], tw, down, 0, x, (sd, gw), y, TOPK, 1, INTER, INTER, bn)


def sweep_gemv(rows: int, dev: torch.device) -> list[dict]:
    out = []
    for name, n, k in DENSE:
        x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
        nbytes = n * k * 2
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * k**-0.5 for _ in range(_copies(nbytes))]
        y = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
        timed = functools.partial(graph_time, variants=len(ws))
        res = {"shape": name, "rows": rows, "N": n, "K": k, "weight_copies": len(ws),
               "cublas_us": round(timed(lambda i, x=x, ws=ws: F.linear(x, ws[i])) * 1e6, 2)}
        kind, *cur = tiles(rows, n, k, fp32=False)
        res["current"] = {"kernel": kind, "BN": cur[0], "BK": cur[1], "warps": cur[2], "stages": cur[3],
                          "split": cur[4]}
        cfgs = []
        space = [("dot", *c) for c in itertools.product((16, 32, 64), (128, 512), (4,), (3, 4))]
        if rows == 1:  # the one-row kernel: small BN, no tensor cores
            space += [("row", *c) for c in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8), (1, 3))]
        for kind, bn, bk, warps, stages in space:
            cfg = {"kernel": kind, "BN": bn, "BK": bk, "warps": warps, "stages": stages, "split": 1}
            fn = _gemv if kind == "dot" else _row
            try:
                t = timed(functools.partial(fn, x, ws, y, bn, bk, warps, stages))
            except Exception as e:  # a config the compiler rejects (shared memory): recorded, skipped
                cfgs.append({**cfg, "error": str(e)[:80]})
                continue
            cfgs.append({**cfg, "us": round(t * 1e6, 2), "GBps": round(nbytes / t / 1e9, 1)})
        ok = [c for c in cfgs if "us" in c]
        res["best"] = min(ok, key=lambda c: c["us"]) if ok else None
        now = [c["us"] for c in ok if {key: c[key] for key in res["current"]} == res["current"]]
        res["current"]["us"] = now[0] if now else None  # None: the current tile is outside the swept space
        res["configs"] = cfgs
        out.append(res)
        print(f"gemv {name} rows={rows}: cuBLAS {res['cublas_us']} us, current {res['current']}, best {res['best']}")
    return out


def tiles_before_split(m: int, n: int, k: int, fp32: bool, fp8: bool = False) -> tuple:
    """layers/triton/linear.py's GEMV tiles before split-K (2-16 bf16 rows: no split, 128- or 512-wide K steps);
    everything else as `tiles` (the function imported here: unchanged while bench/decode.py's A/B swaps it)."""
    t = tiles(m, n, k, fp32, fp8)
    if fp32 or fp8 or t[0] == "row":
        return t
    return ("dot", 32, 128, 4, 4, 1) if n > 4096 else ("dot", 16 if n <= 2048 else 32, 512, 4, 3, 1)


def sweep_split(rows: int, dev: torch.device) -> list[dict]:
    """The dot GEMV of `rows` rows with split-K (SPLIT programs a tile, each over K / SPLIT, the tile's last one
    summing the fp32 partials in split order) over (BN, BK, stages, SPLIT), launched as the engine launches it
    (`gemv`, PDL where supported); then the current tile, the tile before split-K and the five best again without
    PDL (launched back to back, a PDL GEMV prefetches its weight while the one before still streams its own)."""
    from mtp_ray.layers.triton import pdl

    out = []
    for name, n, k in DENSE:
        x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
        nbytes = n * k * 2
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * k**-0.5 for _ in range(_copies(nbytes))]

        def us(tile, x=x, ws=ws):
            return graph_time(lambda i: gemv(x, ws[i], tile), variants=len(ws)) * 1e6

        cur = tiles(rows, n, k, fp32=False)
        before = tiles_before_split(rows, n, k, False)
        res = {"shape": name, "rows": rows, "N": n, "K": k, "current": list(cur), "current_us": round(us(cur), 2),
               "before": list(before), "before_us": round(us(before), 2)}
        space = list(itertools.product(("dot",), (16, 32, 64), (128, 256, 512), (4,), (3, 4), (1, 2, 4, 8)))
        res.update(_tile_sweep(space, lambda t: us(t) / 1e6))
        top = sorted((c for c in res["configs"] if "us" in c), key=lambda c: c["us"])[:5]
        prev = pdl.set_enabled(False)
        try:
            res["without_pdl"] = [{"tile": list(t), "us": round(us(t), 2)}
                                  for t in dict.fromkeys([cur, before, *(tuple(c["tile"]) for c in top)])]
        finally:
            pdl.set_enabled(prev)
        out.append(res)
        print(f"split {name} rows={rows}: current {cur} {res['current_us']} us, before {res['before_us']} us, "
              f"best {res['best']}; without PDL {[(w['tile'][1:], w['us']) for w in res['without_pdl']]}")
    return out


def sweep_experts(rows: int, dev: torch.device) -> list[dict]:
    """The routed experts of `rows` tokens (top 8 of 256) + the shared expert: gate_up (+ SwiGLU) and down
    (+ weighted sum, shared gate)."""
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, H, dtype=torch.bfloat16, device=dev, generator=g) * H**-0.5
    down = torch.randn(EXPERTS, H, INTER, dtype=torch.bfloat16, device=dev, generator=g) * INTER**-0.5
    x = torch.randn(rows, H, dtype=torch.bfloat16, device=dev)
    idss = []  # one expert choice per launch of the graph: a cycle reads far more than the L2 cache holds
    for _ in range(20):
        if rows * TOPK <= EXPERTS:  # distinct experts, as a decode step mostly sees
            idss.append(torch.randperm(EXPERTS, device=dev)[: rows * TOPK].view(rows, TOPK).contiguous())
        else:
            idss.append(torch.randint(0, EXPERTS, (rows, TOPK), device=dev))
    timed = functools.partial(graph_time, variants=len(idss))
    tw = torch.rand(rows, TOPK, dtype=torch.bfloat16, device=dev)
    sg = torch.randn(2 * INTER, H, dtype=torch.bfloat16, device=dev) * H**-0.5  # shared gate | up
    sd = torch.randn(H, INTER, dtype=torch.bfloat16, device=dev) * INTER**-0.5
    gw = torch.randn(1, H, dtype=torch.bfloat16, device=dev) * H**-0.5
    act = torch.empty(rows * (TOPK + 1), INTER, dtype=torch.bfloat16, device=dev)
    y = torch.empty(rows, H, dtype=torch.bfloat16, device=dev)
    gv, uv = gate_up[:, :INTER], gate_up[:, INTER:]
    up_bytes, down_bytes = rows * (TOPK + 1) * 2 * INTER * H * 2, rows * (TOPK + 1) * H * INTER * 2
    res: dict = {"rows": rows, "gate_up": [], "down": []}
    for bn, bk, warps in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4,)):
        cfg = {"BN": bn, "BK": bk, "warps": warps}
        t = timed(functools.partial(_up, x, idss, gv, uv, sg, act, bn, bk, warps))
        res["gate_up"].append({**cfg, "us": round(t * 1e6, 2), "GBps": round(up_bytes / t / 1e9, 1)})
        if bk <= INTER:
            t = timed(functools.partial(_down, act, idss, tw, down, x, sd, gw, y, bn, bk, warps))
            res["down"].append({**cfg, "us": round(t * 1e6, 2), "GBps": round(down_bytes / t / 1e9, 1)})
    for part in ("gate_up", "down"):
        res[f"best_{part}"] = min(res[part], key=lambda c: c["us"])
        print(f"experts rows={rows} {part}: best {res[f'best_{part}']}")
    return [res]


def sweep_gemv_fp8(shapes: list[str], dev: torch.device) -> list[dict]:
    """One-row GEMV tiles for FP8-resident weights (e4m3, 128 x 128 block scales) through `gemv`, next to the bf16
    weight at the current tile: us and GB/s of weight bytes (scales included)."""
    out = []
    block = Fp8Block(128, 128)
    for name, n, k in (d for d in DENSE if d[0] in shapes):
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        nbytes = n * k + scale_shape((n, k), block)[0] * scale_shape((n, k), block)[1] * 4
        qs = [quantize(torch.randn(n, k, device=dev) * k**-0.5, block) for _ in range(_copies(nbytes))]
        fs = [(q, Fp8Weight(sc, block)) for q, sc in qs]
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * k**-0.5 for _ in range(_copies(n * k * 2))]
        cur = tiles(1, n, k, fp32=False, fp8=True)
        res = {"shape": name, "N": n, "K": k, "current": list(cur),
               "bf16_us": round(graph_time(lambda i, x=x, ws=ws, cur=cur: gemv(x, ws[i], cur), variants=len(ws))
                                * 1e6, 2)}
        cfgs = []
        space = [("row", *c, 1, 1) for c in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8))]
        space += [("dot", bn, bk, 4, st, 1) for bn in (16, 32, 64) for bk in (128, 256, 512) for st in (3, 4)]
        for tile in space:
            try:
                t = graph_time(lambda i, x=x, fs=fs, tile=tile: gemv(x, fs[i][0], tile, fp8=fs[i][1]),
                               variants=len(fs))
            except Exception as e:  # a config the compiler rejects: recorded, skipped
                cfgs.append({"tile": list(tile), "error": str(e)[:80]})
                continue
            cfgs.append({"tile": list(tile), "us": round(t * 1e6, 2), "GBps": round(nbytes / t / 1e9, 1)})
        ok = [c for c in cfgs if "us" in c]
        res["best"] = min(ok, key=lambda c: c["us"]) if ok else None
        res["at_current"] = next((c["us"] for c in ok if c["tile"] == list(cur)), None)
        res["configs"] = cfgs
        out.append(res)
        print(f"fp8 gemv {name}: bf16 {res['bf16_us']} us, fp8 at the current tile {res['at_current']} us, "
              f"best {res['best']}")
    return out


def sweep_experts_fp8(rows: int, dev: torch.device) -> dict:
    """pair_experts with e4m3 experts (128 x 128 blocks) + the shared expert over tiles (gate_up BN, BK, down BN),
    next to the bf16 experts at their tiles; one launch pair = gate_up + down + slot sum."""
    from mtp_ray.layers.triton.moe_small import SharedWeights, expert_tiles, pair_experts
    block = Fp8Block(128, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    gu = torch.randn(EXPERTS, 2 * INTER, H, device=dev, generator=g) * H**-0.5
    dn = torch.randn(EXPERTS, H, INTER, device=dev, generator=g) * INTER**-0.5
    qgu, sgu = quantize(gu, block)
    qdn, sdn = quantize(dn, block)
    sh = [torch.randn(INTER, H, device=dev) * H**-0.5 for _ in range(2)] + [torch.randn(H, INTER, device=dev)
                                                                           * INTER**-0.5]
    qsh = [quantize(w, block) for w in sh]
    gw = torch.randn(1, H, dtype=torch.bfloat16, device=dev) * H**-0.5
    shared8 = SharedWeights(*(q for q, _ in qsh), gw, tuple(Fp8Weight(sc, block) for _, sc in qsh))
    shared16 = SharedWeights(*(w.bfloat16() for w in sh), gw)
    fp8 = (Fp8Weight(sgu, block), Fp8Weight(sdn, block))
    gu16, dn16 = gu.bfloat16(), dn.bfloat16()
    del gu, dn
    x = torch.randn(rows, H, dtype=torch.bfloat16, device=dev)
    idss = [torch.randperm(EXPERTS, device=dev)[: rows * TOPK].view(rows, TOPK).contiguous() if rows * TOPK
            <= EXPERTS else torch.randint(0, EXPERTS, (rows, TOPK), device=dev) for _ in range(20)]
    tw = torch.rand(rows, TOPK, dtype=torch.bfloat16, device=dev)
    timed = functools.partial(graph_time, variants=len(idss))
    res = {"rows": rows, "bf16_tile": list(expert_tiles(H, False)), "fp8_default": list(expert_tiles(H, True)),
           "bf16_us": round(timed(lambda i: pair_experts(x, idss[i], tw, gu16, dn16, 0, shared16)) * 1e6, 2)}
    cfgs = []
    for tile in itertools.product((4, 8, 16), (1024, 2048), (16, 32, 64)):
        t = timed(lambda i, tile=tile: pair_experts(x, idss[i], tw, qgu, qdn, 0, shared8, fp8, tile))
        cfgs.append({"tile": list(tile), "us": round(t * 1e6, 2)})
    res["configs"] = cfgs
    res["best"] = min(cfgs, key=lambda c: c["us"])
    res["at_default"] = next(c["us"] for c in cfgs if c["tile"] == res["fp8_default"])
    print(f"fp8 experts rows={rows}: bf16 {res['bf16_us']} us; fp8 default {res['fp8_default']} "
          f"{res['at_default']} us; best {res['best']}")
    return res


def _tile_sweep(space: list[tuple], seconds) -> dict:
    """{"best", "configs"}: seconds(tile) for every tile of the space, in us; a tile the compiler rejects (shared
    memory) is recorded with its error and skipped."""
    cfgs = []
    for tile in space:
        try:
            cfgs.append({"tile": list(tile), "us": round(seconds(tile) * 1e6, 2)})
        except Exception as e:
            cfgs.append({"tile": list(tile), "error": str(e)[:80]})
    ok = [c for c in cfgs if "us" in c]
    return {"best": min(ok, key=lambda c: c["us"]) if ok else None, "configs": cfgs}


def sweep_gemm_fp8(rows: int, shapes: list[str], dev: torch.device) -> list[dict]:
    """Dense FP8 projections past the GEMV's 16 rows (`gemv`'s dot kernel in M tiles) over (BN, BK, warps,
    stages), next to cuBLAS on the bf16 weight."""
    return [_gemm_shape(name, n, k, rows, dev) for name, n, k in DENSE if name in shapes]


def _gemm_shape(name: str, n: int, k: int, rows: int, dev: torch.device) -> dict:
    block = Fp8Block(128, 128)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
    qs = [quantize(torch.randn(n, k, device=dev) * k**-0.5, block) for _ in range(_copies(n * k))]
    fs = [(q, Fp8Weight(sc, block)) for q, sc in qs]
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * k**-0.5 for _ in range(_copies(n * k * 2))]
    res = {"shape": name, "rows": rows, "N": n, "K": k, "default": list(tiles(rows, n, k, False, True)),
           "cublas_bf16_us": round(graph_time(lambda i: F.linear(x, ws[i]), variants=len(ws)) * 1e6, 2),
           "at_default": round(graph_time(lambda i: gemv(x, fs[i][0], fp8=fs[i][1]), variants=len(fs)) * 1e6, 2)}
    space = [("dot", *c, 1) for c in itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4))]
    res.update(_tile_sweep(space, lambda tile: graph_time(lambda i: gemv(x, fs[i][0], tile, fp8=fs[i][1]),
                                                          variants=len(fs))))
    print(f"fp8 gemm {name} rows={rows}: cuBLAS bf16 {res['cublas_bf16_us']} us, fp8 default {res['at_default']} "
          f"us, best {res['best']}")
    return res


def sweep_grouped(rows: int, dev: torch.device, fp8: bool, tiles: bool = True) -> dict:
    """The engine's grouped MoE path for `rows` tokens (fused_experts with the shared expert: plan, gate_up, down,
    slot sum) with bf16 or e4m3 experts, next to the per-pair GEMVs (moe_small.pair_experts, what SparseMoE takes
    up to 256 pairs) and the plan launch alone; `tiles`: the gate_up tiles swept with down at its default, then
    down's with gate_up at its default."""
    from mtp_ray.layers.triton.moe import _row_tile, fused_experts, gemm_tiles
    from mtp_ray.layers.triton.moe_common import SharedWeights
    from mtp_ray.layers.triton.moe_plan import plan, plan_launch, plan_torch
    from mtp_ray.layers.triton.moe_small import pair_experts

    block = Fp8Block(128, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    gu = torch.randn(EXPERTS, 2 * INTER, H, device=dev, generator=g) * H**-0.5
    dn = torch.randn(EXPERTS, H, INTER, device=dev, generator=g) * INTER**-0.5
    sh = [torch.randn(*s, device=dev, generator=g) * s[1] ** -0.5 for s in ((INTER, H), (INTER, H), (H, INTER))]
    gw = torch.randn(1, H, device=dev, generator=g).bfloat16()
    if fp8:
        (gu, sgu), (dn, sdn) = quantize(gu, block), quantize(dn, block)
        qsh = [quantize(w, block) for w in sh]
        scales = (Fp8Weight(sgu, block), Fp8Weight(sdn, block))
        shared = SharedWeights(*(q for q, _ in qsh), gw, tuple(Fp8Weight(sc, block) for _, sc in qsh))
    else:
        gu, dn, scales = gu.bfloat16(), dn.bfloat16(), None
        shared = SharedWeights(*(w.bfloat16() for w in sh), gw)
    x = torch.randn(rows, H, dtype=torch.bfloat16, device=dev)
    ids = torch.randint(0, EXPERTS, (rows, TOPK), device=dev)
    tw = torch.rand(rows, TOPK, dtype=torch.bfloat16, device=dev)
    d_gu, d_dn = gemm_tiles(False, fp8)
    bm = _row_tile(rows * TOPK, EXPERTS)  # the plan's rows a tile, as fused_experts picks them

    def step(tiles):
        return graph_time(lambda i: fused_experts(x, ids, tw, gu, dn, 0, fp8=scales, tiles=tiles, shared=shared))

    res = {"rows": rows, "fp8": fp8, "default": [list(d_gu), list(d_dn)], "at_default_us": round(step(None) * 1e6, 2),
           "pairs_us": (round(graph_time(lambda i: pair_experts(x, ids, tw, gu, dn, 0, shared, scales)) * 1e6, 2)
                        if rows <= 256 else None),  # (an expert's weights read once per pair: hopeless past that)
           "plan_us": round(graph_time(lambda i: plan(ids, 0, EXPERTS, True, bm)) * 1e6, 2),
           # the plan's two forms at this size, whichever plan() takes (KERNEL_PAIRS): where they cross
           "plan_kernel_us": round(graph_time(lambda i: plan_launch(ids, 0, EXPERTS, True, bm)) * 1e6, 2),
           "plan_torch_us": round(graph_time(lambda i: plan_torch(ids, 0, EXPERTS, True, bm)) * 1e6, 2)}
    print(f"grouped experts rows={rows} fp8={fp8}: grouped {res['at_default_us']} us (plan {res['plan_us']}: "
          f"one launch {res['plan_kernel_us']}, torch {res['plan_torch_us']}), per-pair GEMVs {res['pairs_us']} us")
    if not tiles:
        return res
    bk = (128, 256) if fp8 else (64, 128)
    res["gate_up"] = _tile_sweep(list(itertools.product((16, 32, 64), bk, (4,), (3, 4))),
                                 lambda tile: step((tile, d_dn)))
    res["down"] = _tile_sweep(list(itertools.product((32, 64, 128), bk, (4,), (3, 4))),
                              lambda tile: step((d_gu, tile)))
    print(f"  best gate_up {res['gate_up']['best']}, best down {res['down']['best']}")
    return res


def sweep_recurrent(batch: int, q_len: int, dev: torch.device) -> dict:
    """The GDN recurrence of a decode (q_len 1) or verify (q_len k + 1) step at the 35B-A3B shapes (32 value heads
    of 128 x 128 fp32 state, 16 key heads) over (BV, warps), next to the state's bytes at the measured copy
    bandwidth: at batch 256 the recurrence is up to ~30 % of the step (<= 10.1 ms for 7.8 ms of state traffic)."""
    from mtp_ray.layers.triton.gated_delta import recurrent_decode

    hk, hv, dk, dv = 16, 32, 128, 128
    slots = 2 * batch * (q_len + 1)  # as many state slots as the step touches, twice: the cycle reads past L2
    state = torch.randn(slots, hv, dk, dv, device=dev) * 0.1
    conv = torch.randn(batch * q_len, 2 * hk * dk + hv * dv, dtype=torch.bfloat16, device=dev)
    a, b = (torch.randn(batch * q_len, hv, dtype=torch.bfloat16, device=dev) for _ in range(2))
    a_log, dt_bias = torch.randn(hv, device=dev), torch.randn(hv, device=dev)
    base = [torch.randperm(slots, device=dev)[: batch * (q_len + 1)] for _ in range(2)]
    main = [s[:batch].contiguous() for s in base]
    spec = [s[batch:].contiguous() if q_len > 1 else None for s in base]

    def run(tile):
        return graph_time(lambda i: recurrent_decode(conv, a, b, a_log, dt_bias, state, main[i], spec[i], q_len, hk,
                                                     dk, torch.bfloat16, tile), variants=2)

    nbytes = batch * hv * dk * dv * 4 * (2 + (q_len if q_len > 1 else 0))  # read + write, + a snapshot per token
    res = {"batch": batch, "q_len": q_len, "state_MB": round(nbytes / 1e6, 1), "default_us": round(run(None) * 1e6, 2)}
    res.update(_tile_sweep(list(itertools.product((16, 32, 64, 128), (2, 4, 8))), run))
    res["default_GBps"] = round(nbytes / res["default_us"] / 1e3, 1)
    print(f"recurrent batch={batch} q_len={q_len}: {res['state_MB']} MB, default {res['default_us']} us "
          f"({res['default_GBps']} GB/s), best {res['best']}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kernels.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--fp8", nargs="*", default=None, metavar="SHAPE",
                    help="only the FP8 sweeps: one-row GEMV on these DENSE shapes (default: all), experts, GEMM")
    ap.add_argument("--fp8-parts", nargs="+", default=["gemv", "experts", "gemm", "grouped"])
    ap.add_argument("--gemm-rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--split", action="store_true", help="only the dot GEMV with split-K at --rows rows")
    ap.add_argument("--recurrent", action="store_true",
                    help="only the GDN recurrence at --gemm-rows sequences, q_len 1 and 4: (BV, warps)")
    ap.add_argument("--grouped", action="store_true",
                    help="only the grouped MoE path (bf16 and FP8) at --gemm-rows tokens next to the per-pair GEMVs; "
                         "at 64 and 256 rows also its gate_up and down tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flag = torch.zeros(1024, device=dev)
    floor = graph_time(lambda i: _empty_kernel[(1,)](flag), launches=100)
    print(f"empty kernel in a graph: {floor * 1e6:.2f} us per launch")
    if args.fp8 is not None:
        shapes = args.fp8 or [d[0] for d in DENSE]
        result = {"device": torch.cuda.get_device_name(), "empty_kernel_us": round(floor * 1e6, 2)}
        if "experts" in args.fp8_parts:
            result["experts_fp8"] = [sweep_experts_fp8(r, dev) for r in args.rows]
        if "gemm" in args.fp8_parts:
            result["gemm_fp8"] = [r for rows in args.gemm_rows for r in sweep_gemm_fp8(rows, shapes, dev)]
        if "grouped" in args.fp8_parts:
            result["grouped_fp8"] = [sweep_grouped(rows, dev, True) for rows in args.gemm_rows]
        if "gemv" in args.fp8_parts:
            result["gemv_fp8"] = sweep_gemv_fp8(shapes, dev)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return
    if args.split:
        result = {"device": torch.cuda.get_device_name(), "split": [r for rows in args.rows for r in
                                                                     sweep_split(rows, dev)]}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return
    if args.recurrent:
        result = {"device": torch.cuda.get_device_name(),
                  "recurrent": [sweep_recurrent(b, q, dev) for b in args.gemm_rows for q in (1, 4)]}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return
    if args.grouped:
        result = {"device": torch.cuda.get_device_name(),
                  "grouped": [sweep_grouped(rows, dev, fp8, rows in (64, 256)) for fp8 in (False, True)
                              for rows in args.gemm_rows]}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return
    result = {"device": torch.cuda.get_device_name(), "empty_kernel_us": round(floor * 1e6, 2),
              "gemv": [r for rows in args.rows for r in sweep_gemv(rows, dev)],
              "experts": [r for rows in args.rows for r in sweep_experts(rows, dev)]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
