"""Prefill forward time on the GPU: the varlen kernels (Triton paged prefill attention, varlen GDN conv + fla's
chunked delta rule) side by side with the per-sequence PyTorch path they replaced, in one run, at several
(sequences x prompt length) shapes; random bf16 weights with the Qwen3.5-35B-A3B shapes cut to --layers layers.

    python bench/prefill.py [--layers 4] [--shapes 1x4096 16x256 128x32] [--out bench/results/prefill.json]

A "forward" is the target model over fresh sequences (no cached context) plus the lm_head on each sequence's last
row, timed with CUDA events (median of 5 after 2 warm-ups; the first call of each shape also compiles / autotunes).
The per-sequence path is restored by swapping two functions (the GDN layers see no fla; the attention layers call
the PyTorch loop), so the rest of the model is the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import BLOCK, config, random_model, timed  # noqa: E402

from mtp_ray.engine.cache import CacheShape, bind_caches  # noqa: E402
from mtp_ray.layers import gated_delta
from mtp_ray.layers.attention import paged_attention  # noqa: E402
from mtp_ray.layers.context import ForwardBatch  # noqa: E402
from mtp_ray.layers.linear import fuse_projections  # noqa: E402
from mtp_ray.layers.rope import bind_rope_tables  # noqa: E402
from mtp_ray.layers.triton import attention_prefill as attention_prefill_triton  # noqa: E402


def batch(n: int, length: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    """n fresh sequences of `length` tokens: ids, positions, the general (prefill) batch."""
    tables = 1 + torch.arange(n * width, device=device).view(n, width)  # block 0 stays reserved
    pos = torch.arange(length, device=device).repeat(n)  # [n * length]
    slots = (tables.repeat_interleave(length, 0).gather(1, (pos // BLOCK)[:, None])[:, 0] * BLOCK + pos % BLOCK)
    fb = ForwardBatch(query_lens=[length] * n, context_lens=[0] * n, block_tables=tables, slot_mapping=slots,
                      state_slots=list(range(1, n + 1)))
    return torch.randint(0, 1000, (n * length,), device=device), pos, fb


def _per_sequence_attention(q, kv_cache, block_tables, cu_seqlens, context_lens, scale, gate=None):
    """The PyTorch loop the Triton prefill kernel replaced (same signature), gate applied as the layer did."""
    cu = cu_seqlens.tolist()
    fb = ForwardBatch(query_lens=[b - a for a, b in zip(cu, cu[1:], strict=False)], context_lens=context_lens.tolist(),
                      block_tables=block_tables, slot_mapping=torch.zeros(cu[-1], dtype=torch.long),
                      state_slots=[0] * (len(cu) - 1))
    out = paged_attention(q, kv_cache, fb, scale)
    return out * torch.sigmoid(gate) if gate is not None else out


def _cpu_timed(fn) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@contextlib.contextmanager
def per_sequence_path():
    fla, attn = gated_delta._fla, attention_prefill_triton.paged_prefill_attention
    gated_delta._fla = lambda: None
    attention_prefill_triton.paged_prefill_attention = _per_sequence_attention
    try:
        yield
    finally:
        gated_delta._fla, attention_prefill_triton.paged_prefill_attention = fla, attn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shapes", nargs="+", default=["1x4096", "16x256", "128x32"])
    ap.add_argument("--out", default="bench/results/prefill.json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (both paths are the same there)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    cfg = config(args.layers)
    model = random_model(cfg, dev)
    width = max(length for _, length in shapes) // BLOCK + 2
    max_n = max(n for n, _ in shapes)
    bind_caches(model, CacheShape(1 + max_n * width, BLOCK, 1 + max_n), torch.bfloat16, dev)
    bind_rope_tables(model, width * BLOCK, torch.bfloat16, dev)
    fuse_projections(model)
    rows = []
    for n, length in shapes:
        ids, pos, fb = batch(n, length, width, dev)
        last = torch.arange(n, device=dev) * length + length - 1

        def forward(ids=ids, pos=pos, fb=fb, last=last):
            fb.rope_cache.clear()  # per-forward metadata, as the runner builds a fresh batch each step
            return model.compute_logits(model(ids, pos, fb)[last])

        row = {"sequences": n, "prompt_len": length, "tokens": n * length}
        with torch.inference_mode():
            for name, ctx in (("varlen", contextlib.nullcontext()), ("per_sequence", per_sequence_path())):
                with ctx:
                    t = timed(forward, 5) if dev.type == "cuda" else _cpu_timed(forward)
                row[f"{name}_ms"] = round(t * 1e3, 3)
                row[f"{name}_tokens_per_s"] = round(n * length / t, 1)
        row["speedup"] = round(row["per_sequence_ms"] / row["varlen_ms"], 2)
        rows.append(row)
        print(row, flush=True)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "model": f"random bf16, Qwen3.5-35B-A3B shapes, {args.layers} layers (of 40)", "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
