"""layers/triton/pdl.py on the CPU: which launches get programmatic dependent launch (the GPU side is
tests/test_gpu.py::test_pdl_launches_equal_plain_launches and the sm90 compile check of tests/kernel_check.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (CPU torch): the GPU tests cover PDL")
from mtp_ray.layers.triton import pdl  # noqa: E402


def test_pdl_only_on_cuda_and_the_switch_turns_it_off():
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False}
    pdl.set_enabled(False)
    try:  # forced off: no launch option, and the device is not even asked (none here)
        assert pdl.launch_args(torch.device("cuda", 0)) == {"PDL": False}
    finally:
        pdl.set_enabled(None)


def test_prefetch_lines_cover_a_row():
    assert pdl.lines(2048, torch.bfloat16) == 32  # 4096 bytes = 32 lines of 128
    assert pdl.lines(4096, torch.float8_e4m3fn) == 32
    assert pdl.lines(100, torch.bfloat16) == 2  # 200 bytes: 2 lines
    assert pdl.lines(1, torch.float32) == 1
