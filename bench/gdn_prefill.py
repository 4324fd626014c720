"""GDN prefill delta rule at the Qwen3.5-35B-A3B shapes (GPU): the token-serial recurrent kernel
(`recurrent_varlen`) next to fla's chunked kernels (`chunk_varlen_fla`) over N sequences of L new tokens, to set
`layers/context.py: SHORT_PIECE` (the longest piece the recurrent kernel takes).

    python bench/gdn_prefill.py [--seqs 1 8 32] [--lens 8 16 32 64 128 256 512] [--out bench/results/gdn_prefill.json]

Per (N, L) and kernel: host us per call (the Python call alone, the device idle before it: what an eager prefill
step pays per GDN layer while host-bound), device us per call (torch.profiler: the kernels' own time), and the
largest output difference between the two (bf16 inputs, fp32 states).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mtp_ray.layers.context import fla_chunks
from mtp_ray.layers.triton.gated_delta_varlen import chunk_varlen_fla, recurrent_varlen

HK, HV, DK, DV = 16, 32, 128, 128


def inputs(n: int, length: int, dev: torch.device) -> tuple:
    t = n * length
    g = torch.Generator(device=dev).manual_seed(n * 1000 + length)
    q, k = (torch.randn(t, HK, DK, device=dev, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(t, HV, DV, device=dev, generator=g).bfloat16()
    gate = -torch.rand(t, HV, device=dev, generator=g) * 0.5
    beta = torch.rand(t, HV, device=dev, generator=g).bfloat16()
    h0 = torch.randn(n, HV, DK, DV, device=dev, generator=g) * 0.1
    cu = torch.arange(0, t + 1, length, device=dev)
    chunks = torch.tensor([x for pair in fla_chunks([length] * n) for x in pair], device=dev).view(-1, 2)
    return q, k, v, gate, beta, DK**-0.5, h0, cu, chunks


def host_us(fn, args: tuple, reps: int = 30) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def device_us(fn, args: tuple, reps: int = 10) -> float:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn(*args)
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return round(total / reps, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--lens", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--out", default="bench/results/gdn_prefill.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for n in args.seqs:
        for length in args.lens:
            a = inputs(n, length, dev)
            row: dict = {"seqs": n, "len": length}
            outs = {}
            for name, fn in (("recurrent", recurrent_varlen), ("fla", chunk_varlen_fla)):
                for _ in range(3):  # compile / autotune
                    outs[name] = fn(*a)
                row[f"{name}_host_us"] = host_us(fn, a)
                row[f"{name}_device_us"] = device_us(fn, a)
            row["max_abs_diff_out"] = float((outs["recurrent"][0].float() - outs["fla"][0].float()).abs().max())
            row["max_abs_diff_state"] = float((outs["recurrent"][1] - outs["fla"][1]).abs().max())
            rows.append(row)
            print(json.dumps(row))
    res = {"device": torch.cuda.get_device_name(), "shapes": {"hk": HK, "hv": HV, "dk": DK, "dv": DV}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
