"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's kernels.

A decode step is hundreds of short launches, each bound by a memory round trip or two: between two kernels the
GPU drains one grid, then starts the next, whose first loads wait on DRAM again. With PDL a kernel launched with
`launch_pdl` may start while the one before it still runs: its programs first prefetch what does not depend on that
kernel (their weight slice, into L2: weights are read-only during a forward), then wait (`gdc_wait`) for the
kernel before them to finish and its writes to be visible, then run as before. Every kernel here lets the next
one start right after its own wait: one kernel ahead at most (triggering before the wait let a chain of waiting
kernels fill the SMs and made the batch-1 step 3.5 % slower, `bench/decode.py --pdl-ab`).

Correctness rule (why every PDL kernel waits before touching anything else): a kernel may start before the one
before it ended, so before `enter` it may read weights only, never activations, routing ids or caches, and write
nothing; a kernel that waited ended after everything before it, so the chain stays ordered. Launched without PDL
(CPU interpreter, pre-Hopper GPUs, a Triton without it, or `set_enabled(False)`), the same kernels run as before.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # a Triton without grid dependency control: PDL stays off (the stand-ins are never traced)
    _HAS_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


_forced: bool | None = None  # set_enabled: None = on wherever the device and Triton support it


def set_enabled(on: bool | None) -> bool | None:
    """Benchmarks' A/B switch: launch the decode kernels with PDL (True), without (False), or where supported
    (None, the default). Read at launch: a captured CUDA graph keeps what it was captured with. Returns the
    setting it replaced."""
    global _forced
    prev, _forced = _forced, on
    return prev


@functools.cache
def _supported(index: int) -> bool:
    return _HAS_PDL and not os.environ.get("TRITON_INTERPRET") and torch.cuda.get_device_capability(index)[0] >= 9


def launch_args(device: torch.device) -> dict:
    """The kernel's PDL constexpr and, when on, Triton's `launch_pdl` launch option."""
    on = device.type == "cuda" and _forced is not False and _supported(device.index or 0)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the kernel before this to end, then let the next one start (PDL only; nothing otherwise)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_rows(w_ptr, rows, row_ok, stride_r, K, KP: tl.constexpr):
    """Prefetch into L2 rows `rows` [R] (those with row_ok) of a row-major weight, K elements each: one prefetch
    per 128-byte line, the first KP lines of each row (a power of two; `lines` covers a whole row). For before
    `enter`: weights only."""
    line: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
    col = tl.arange(0, KP) * line
    ok = row_ok[:, None] & (col[None, :] < K)
    ptrs = tl.where(ok, w_ptr + rows[:, None].to(tl.int64) * stride_r + col[None, :], w_ptr)
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def lines(k: int, dtype: torch.dtype) -> int:
    """KP of prefetch_rows for rows of k elements of dtype: a power of two >= the 128-byte lines of a row."""
    return triton.next_power_of_2(max(1, triton.cdiv(k * dtype.itemsize, 128)))
