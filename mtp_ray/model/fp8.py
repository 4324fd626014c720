"""FP8 block-quantized checkpoints, as Qwen publishes them for Qwen3 / Qwen3.5 (`-FP8` repositories).

config.json carries `quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128], modules_to_not_convert: [...]}`; each quantized linear weight `X.weight` is stored
as float8_e4m3fn with `X.weight_scale_inv` (fp32, one per weight block): the real weight is q * scale_inv over each
block (the name is historical: it multiplies). Modules left out of the conversion are stored in bf16 and load as
usual. Fused expert tensors [E, N, K] carry [E, N / bn, K / bk] scales, so an expert slice reads its own scales.

With block scales, the projections (layers.linear.Linear) and routed experts (layers.moe.Experts) whose checkpoint
tensors are FP8 keep them in FP8 (layers/fp8.py, `make_fp8`: half the bytes a step reads); every other FP8 tensor
(per-tensor scales, qwen3_next's grouped GDN projections, anything outside those modules) is dequantized on load
(fp32 arithmetic, then the model's dtype). Either way the model serves exactly what the dequantized checkpoint
would. An FP8 weight without its scale, a scale of the wrong shape, another quantization method or a static
activation scheme is an error naming the tensor or field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mtp_ray.layers.fp8 import Fp8Block, expand, scale_shape
from mtp_ray.layers.linear import Linear
from mtp_ray.layers.moe import Experts
from mtp_ray.model.files import open_tensors

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv


@dataclass(frozen=True)
class Fp8Format:
    """The checkpoint's quantization_config, validated."""

    block: tuple[int, int] | None  # (rows, cols) a scale covers; None: one scale per tensor
    not_convert: tuple[str, ...] = ()  # modules_to_not_convert: names (or parts of names) stored unquantized

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
        skip = raw.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
            raise ValueError(f"quantization_config.modules_to_not_convert must be a list of names, got {skip!r}")
        return cls(tuple(block) if block is not None else None, tuple(skip))

    @property
    def fp8_block(self) -> Fp8Block | None:
        return Fp8Block(*self.block) if self.block is not None else None

    def scale_shape(self, shape: list[int]) -> list[int]:
        """The scale tensor's shape for a weight of `shape` ([..., N, K])."""
        return [1] if self.block is None else scale_shape(shape, self.fp8_block)

    def check_scale(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        if q.dim() < 2:
            raise ValueError(f"FP8 tensor {name!r} has shape {list(q.shape)}; block scales need [..., N, K]")
        want = self.scale_shape(list(q.shape))
        if list(scale.shape) != want and not (self.block is None and scale.numel() == 1):
            raise ValueError(f"{name}{SCALE_SUFFIX} has shape {list(scale.shape)}, expected {want}")

    def dequantize(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """q [..., N, K] float8, scale as scale_shape -> fp32 [..., N, K]."""
        self.check_scale(name, q, scale)
        s = scale.float() if self.block is None else expand(scale, q.shape, self.fp8_block)  # [..., N, K]
        return q.float() * s


def fp8_format(path: str | Path) -> Fp8Format | None:
    """The checkpoint directory's FP8 format (top-level or text_config quantization_config), or None."""
    raw = json.loads((Path(path) / "config.json").read_text())
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    return Fp8Format.from_config(q) if q else None


def fp8_weights(model: nn.Module) -> dict[str, tuple[str, Fp8Block]]:
    """Every FP8-resident weight parameter's name -> (its scale parameter's name, block)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.fp8_block is not None:
            out[f"{name}.weight"] = (f"{name}.weight{SCALE_SUFFIX}", m.fp8_block)
        elif isinstance(m, Experts) and m.fp8_blocks is not None:
            for proj, block in zip(("gate_up_proj", "down_proj"), m.fp8_blocks):
                out[f"{name}.{proj}"] = (f"{name}.{proj}{SCALE_SUFFIX}", block)
    return out


def make_fp8(model: nn.Module, fmt: Fp8Format, quantized: Callable[[str], bool]) -> None:
    """Before the weights are filled: each bias-free projection and each MoE layer's experts whose weights
    `quantized(name)` says the checkpoint holds in FP8 keep them in FP8 (`name`: the projection's `X.weight`, the
    experts' `X.experts`). Block-scaled checkpoints only (a per-tensor scale is dequantized on load)."""
    block = fmt.fp8_block
    if block is None:
        return
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.bias is None and quantized(f"{name}.weight"):
            m.make_fp8(block)
        elif isinstance(m, Experts) and quantized(name):
            m.make_fp8(block)


def checkpoint_fp8(index: dict[str, str], canonical: Callable[[str], str]) -> Callable[[str], bool]:
    """quantized(name) for make_fp8 from a checkpoint's tensor dtypes (index: name -> safetensors dtype): a
    projection's weight stored FP8; a MoE layer whose every expert tensor is."""
    fp8 = {canonical(n) for n, dt in index.items() if dt.startswith("F8")}
    experts: dict[str, bool] = {}
    for n in index:
        c = canonical(n)
        if ".mlp.experts." in c and not c.endswith(SCALE_SUFFIX):
            prefix = c.split(".mlp.experts.")[0] + ".mlp.experts"
            experts[prefix] = experts.get(prefix, True) and c in fp8
    return lambda name: name in fp8 or experts.get(name, False)


def config_fp8(fmt: Fp8Format) -> Callable[[str], bool]:
    """quantized(name) for random weights (load_format dummy) of an FP8 checkpoint's config: everything but the
    modules_to_not_convert, as the checkpoint would hold it."""
    return lambda name: not any(skip in name for skip in fmt.not_convert)


def checkpoint_dtypes(path: str | Path) -> dict[str, str]:
    """Every tensor name in the directory's files -> its safetensors dtype name ("BF16", "F8_E4M3", ...)."""
    with ExitStack() as stack:
        return {name: h.get_slice(name).get_dtype() for name, h in open_tensors(path, stack).items()}


class Fp8Reader:
    """An FP8 checkpoint tensor and its scale: called, the dequantized tensor (a Reader); raw(), as stored."""

    def __init__(self, name: str, sl, index: dict, fmt: Fp8Format | None, path: str | Path):
        if fmt is None:
            raise ValueError(f"checkpoint tensor {name!r} is {sl.get_dtype()} but {path}/config.json has no "
                             "quantization_config")
        if sl.get_dtype() != "F8_E4M3":
            raise ValueError(f"checkpoint tensor {name!r} is {sl.get_dtype()}; FP8 checkpoints store F8_E4M3")
        scale_name = name + SCALE_SUFFIX
        if scale_name not in index:
            raise ValueError(f"FP8 weight {name!r} has no {scale_name!r} in the checkpoint")
        self.name, self.sl, self.fmt = name, sl, fmt
        self.scale = index[scale_name].get_slice(scale_name)
        self.block = fmt.fp8_block

    def raw(self, rows: slice | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(q e4m3, scale), the scale's shape checked (fused experts: the rows' own scales)."""
        q = self.sl[...] if rows is None else self.sl[rows]  # (...: a 0-dim tensor too)
        scale = self.scale[...] if rows is None or self.block is None else self.scale[rows]
        self.fmt.check_scale(self.name, q, scale)
        return q, scale

    def __call__(self, rows: slice | None) -> torch.Tensor:
        return self.fmt.dequantize(self.name, *self.raw(rows))
