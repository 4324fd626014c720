"""Random weights for a model built from its config alone (`load_format: dummy`, benchmarks at real shapes)."""

from __future__ import annotations

import math
import zlib

import torch

from mtp_ray.layers.fp8 import quantize
from mtp_ray.model.fp8 import SCALE_SUFFIX, fp8_weights


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights in place, on the parameters' device: N(0, 0.02) matrices, small positive norm weights and
    dt biases, GDN decays A_log in [0, log 16]; FP8-resident ones drawn in fp32 and quantized (an expert at a
    time). Each parameter's generator is seeded from its name, so the ranks of a DP group draw the same dense
    weights (each its own expert shard)."""
    fp8 = fp8_weights(model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            g = torch.Generator(p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith(SCALE_SUFFIX):
                continue  # drawn with its weight
            if name in fp8:
                sname, block = fp8[name]
                scale = params[sname]
                for pi, si in zip(p.view(-1, *p.shape[-2:]), scale.view(-1, *scale.shape[-2:])):  # per expert
                    q, s = quantize(torch.empty(pi.shape, device=p.device).normal_(0, 0.02, generator=g), block)
                    pi.copy_(q)
                    si.copy_(s)
            elif name.endswith("A_log"):
                p.uniform_(0, math.log(16), generator=g)
            elif name.endswith("dt_bias") or "norm" in name:
                p.uniform_(0, 0.1, generator=g)
            else:
                p.normal_(0, 0.02, generator=g)
