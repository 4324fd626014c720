"""FP8 block-quantized checkpoints, as Qwen publishes them for Qwen3 / Qwen3.5 (`-FP8` repositories).

config.json carries `quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128], modules_to_not_convert: [...]}`; each quantized linear weight `X.weight` is stored
as float8_e4m3fn with `X.weight_scale_inv` (fp32, one per weight block): the real weight is q * scale_inv over each
block (the name is historical: it multiplies). Modules left out of the conversion are stored in bf16 and load as
usual. Fused expert tensors [E, N, K] carry [E, N / bn, K / bk] scales, so an expert slice reads its own scales.

Here every FP8 weight is dequantized on load (fp32 arithmetic, then the model's dtype): the model serves exactly
what the dequantized checkpoint would. An FP8 weight without its scale, a scale of the wrong shape, another
quantization method or a static activation scheme is an error naming the tensor or field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv


@dataclass(frozen=True)
class Fp8Format:
    """The checkpoint's quantization_config, validated."""

    block: tuple[int, int] | None  # (rows, cols) a scale covers; None: one scale per tensor

    @classmethod
    def from_config(cls, raw: dict) -> Fp8Format:
        method = raw.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported (fp8 block-quantized "
                             "checkpoints are)")
        if raw.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt {raw['fmt']!r} is not supported (e4m3 is)")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme {raw['activation_scheme']!r} is not supported "
                             "(dynamic is: activations are not quantized with stored scales)")
        block = raw.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2
                                  or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
        return cls(tuple(block) if block is not None else None)

    def scale_shape(self, shape: list[int]) -> list[int]:
        """The scale tensor's shape for a weight of `shape` ([..., N, K])."""
        if self.block is None:
            return [1]
        bn, bk = self.block
        return [*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk)]

    def dequantize(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """q [..., N, K] float8, scale as scale_shape -> fp32 [..., N, K]."""
        if q.dim() < 2:
            raise ValueError(f"FP8 tensor {name!r} has shape {list(q.shape)}; block scales need [..., N, K]")
        want = self.scale_shape(list(q.shape))
        if list(scale.shape) != want and not (self.block is None and scale.numel() == 1):
            raise ValueError(f"{name}{SCALE_SUFFIX} has shape {list(scale.shape)}, expected {want}")
        s = scale.float()
        if self.block is not None:
            bn, bk = self.block
            n, k = q.shape[-2:]
            s = s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]  # [..., N, K]
        return q.float() * s


def fp8_format(path: str | Path) -> Fp8Format | None:
    """The checkpoint directory's FP8 format (top-level or text_config quantization_config), or None."""
    raw = json.loads((Path(path) / "config.json").read_text())
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    return Fp8Format.from_config(q) if q else None
