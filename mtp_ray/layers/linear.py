"""Linear layer: nn.Linear (same parameter names) with a bandwidth-bound Triton GEMV for a few rows on the GPU.

At decode batch sizes a projection multiplies a handful of rows by a large weight: the step is bound by reading
the weight once. cuBLAS picks tile shapes for large M; the GEMV below reads the weight with many programs and
deep pipelining instead. Rows <= GEMV_ROWS, no bias, same dtype: the Triton path; anything else: F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GEMV_ROWS = 16


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = x.dim() == 2 and x.shape[0] <= GEMV_ROWS
        if x.is_cuda and small and self.bias is None and x.dtype == self.weight.dtype:
            from mtp_ray.layers.linear_triton import gemv

            return gemv(x, self.weight)
        return F.linear(x, self.weight, self.bias)
