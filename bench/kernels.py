"""Tile sweep for the bandwidth-bound decode kernels at Qwen3.5-35B-A3B shapes (GPU), next to cuBLAS.

    python bench/kernels.py [--out bench/results/kernels.json] [--rows 1 4] [--grouped-rows 2 4 8 16 32]

For each shape and tile config: the time of one launch inside a CUDA graph of 20 launches (the launch gap
included, as in a decode step), and the bandwidth that implies. The launches cycle through enough weight copies
(dense) or expert choices (MoE) to read > 2x the L2 cache per cycle, so a small weight is timed from memory, as in
a decode step, not from L2 (sweeps before 2026-11-30 lacked this and flattered shapes under ~50 MB). Also the
time of an empty kernel in a graph (the per-launch floor). The JSON lists every config and the best per shape,
to set the heuristics in layers/triton/linear.py and layers/triton/moe_small.py. And a whole small-batch MoE
layer per (token, slot) pair against each expert read once for its tokens (layers/triton/moe_grouped.py).
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

from mtp_ray.layers.triton.linear import _gemv_kernel, _gemv_row_kernel, tiles
from mtp_ray.layers.triton.moe_grouped import grouped_experts
from mtp_ray.layers.triton.moe_small import SharedWeights, _gate_up_kernel, down_sum, pair_experts

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
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BM=16, BN=bn, BK=bk,
                                        IEEE=False, num_warps=warps, num_stages=stages)


def _row(x, ws, y, bn, bk, warps, stages, i) -> None:
    w = ws[i]
    n, k = w.shape
    _gemv_row_kernel[(triton.cdiv(n, bn),)](x, w, y, n, k, w.stride(0), BN=bn, BK=bk, K_TILES=triton.cdiv(k, bk),
                                            num_warps=warps, num_stages=stages)


def _up(x, idss, gv, uv, sg, act, bn, bk, warps, i) -> None:
    # routed pairs + one shared-expert pair per token (SH = 1), as a decode step without EP runs them
    ids = idss[i]
    _gate_up_kernel[(act.shape[0], triton.cdiv(INTER, bn))](
        x, ids, gv, uv, sg[:INTER], sg[INTER:], act, 0, EXPERTS, H, INTER, INTER, x.stride(0), gv.stride(0),
        gv.stride(1), sg.stride(0), act.stride(0), TOPK=TOPK, SH=1, BN=bn, BK=bk, H_TILES=triton.cdiv(H, bk),
        num_warps=warps)


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
        res["current"] = {"kernel": kind, "BN": cur[0], "BK": cur[1], "warps": cur[2], "stages": cur[3]}
        cfgs = []
        space = [("dot", *c) for c in itertools.product((16, 32, 64), (128, 512), (4,), (3, 4))]
        if rows == 1:  # the one-row kernel: small BN, no tensor cores
            space += [("row", *c) for c in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8), (1, 3))]
        for kind, bn, bk, warps, stages in space:
            cfg = {"kernel": kind, "BN": bn, "BK": bk, "warps": warps, "stages": stages}
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


def grouped_vs_pairs(rows: int, dev: torch.device) -> dict:
    """A whole small-batch MoE layer (routed + shared experts) with each token routed on its own (so tokens share
    experts as a verify's do), per (token, slot) pair (`pair_experts`) against each expert's weights read once
    for its tokens (`grouped_experts`, incl. its sort): us per layer, distinct experts, equal outputs."""
    g = torch.Generator(device=dev).manual_seed(1)
    gate_up = torch.randn(EXPERTS, 2 * INTER, H, dtype=torch.bfloat16, device=dev, generator=g) * H**-0.5
    down = torch.randn(EXPERTS, H, INTER, dtype=torch.bfloat16, device=dev, generator=g) * INTER**-0.5
    shared = SharedWeights(*(torch.randn(*shape, dtype=torch.bfloat16, device=dev, generator=g) * shape[1]**-0.5
                             for shape in ((INTER, H), (INTER, H), (H, INTER), (1, H))))
    x = torch.randn(rows, H, dtype=torch.bfloat16, device=dev, generator=g)
    idss = [torch.stack([torch.randperm(EXPERTS, device=dev, generator=g)[:TOPK] for _ in range(rows)])
            for _ in range(20)]
    tw = torch.rand(rows, TOPK, dtype=torch.bfloat16, device=dev, generator=g)
    timed = functools.partial(graph_time, variants=len(idss))
    pair = timed(lambda i: pair_experts(x, idss[i], tw, gate_up, down, 0, shared))
    grouped = timed(lambda i: grouped_experts(x, idss[i], tw, gate_up, down, 0, shared))
    same = all(torch.equal(pair_experts(x, ids, tw, gate_up, down, 0, shared),
                           grouped_experts(x, ids, tw, gate_up, down, 0, shared)) for ids in idss)
    res = {"rows": rows, "pairs_us": round(pair * 1e6, 2), "grouped_us": round(grouped * 1e6, 2),
           "distinct_experts": round(sum(int(ids.unique().numel()) for ids in idss) / len(idss), 1),
           "bitwise_equal": same}
    print(f"experts rows={rows}: pairs {res['pairs_us']} us, grouped {res['grouped_us']} us, "
          f"{res['distinct_experts']} distinct of {rows * TOPK}, equal {same}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kernels.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--grouped-rows", type=int, nargs="*", default=[2, 4, 8, 16, 32])
    args = ap.parse_args()
    dev = torch.device("cuda")
    flag = torch.zeros(1024, device=dev)
    floor = graph_time(lambda i: _empty_kernel[(1,)](flag), launches=100)
    print(f"empty kernel in a graph: {floor * 1e6:.2f} us per launch")
    result = {"device": torch.cuda.get_device_name(), "empty_kernel_us": round(floor * 1e6, 2),
              "gemv": [r for rows in args.rows for r in sweep_gemv(rows, dev)],
              "experts": [r for rows in args.rows for r in sweep_experts(rows, dev)],
              "grouped_vs_pairs": [grouped_vs_pairs(rows, dev) for rows in args.grouped_rows]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
