"""A checkpoint directory's tensor files, opened lazily: safetensors (`*.safetensors`), or, where a directory has
none, PyTorch's pickled shards (`pytorch_model*.bin`, as `save_pretrained(safe_serialization=False)` and older
checkpoints write them; loaded with weights_only and memory-mapped). Either way every tensor name maps to a handle
whose `get_slice(name)` reads like a safetensors slice: get_dtype() (safetensors' names), get_shape(), [rows]."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

# torch dtype -> the safetensors dtype name the loader and model/fp8.py test for
_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
                torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class _TensorSlice:
    def __init__(self, t: torch.Tensor):
        self.t = t

    def get_dtype(self) -> str:
        return _DTYPE_NAMES.get(self.t.dtype, str(self.t.dtype))

    def get_shape(self) -> list[int]:
        return list(self.t.shape)

    def __getitem__(self, rows: Any) -> torch.Tensor:
        return self.t[rows]


class _TorchShard:
    """One pytorch_model*.bin file, as safe_open's handle is used here."""

    def __init__(self, path: Path):
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # a pickle of anything but tensors, a truncated file
            raise ValueError(f"{path}: not a loadable state dict of tensors ({type(e).__name__}: {e})") from e
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ValueError(f"{path}: expected a dict of tensor name -> tensor")
        self.sd = sd

    def keys(self) -> list[str]:
        return list(self.sd)

    def get_slice(self, name: str) -> _TensorSlice:
        return _TensorSlice(self.sd[name])


def _indexed(path: Path, files: list[Path], index_name: str) -> list[Path]:
    """With an index (`*.index.json`, as save_pretrained writes for shards), only the files its weight_map names,
    as transformers and vLLM read them (a stale file beside them is not part of the checkpoint); every one of them
    must exist."""
    index = path / index_name
    if not index.is_file():
        return files
    try:
        listed = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a weight index (a JSON object with a weight_map): {e}") from e
    absent = sorted(listed - {f.name for f in files})
    if absent:
        raise FileNotFoundError(f"{index} names file(s) missing from {path}: {', '.join(absent)}")
    return [f for f in files if f.name in listed]


def _open_safetensors(f: Path, stack: ExitStack) -> Any:
    try:
        return stack.enter_context(safe_open(str(f), framework="pt"))
    except Exception as e:  # a truncated or corrupt file: safetensors' message does not say which
        raise ValueError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from e


def open_tensors(path: str | Path, stack: ExitStack) -> dict[str, Any]:
    """Tensor name -> the open handle of the file holding it (closed with `stack`)."""
    path = Path(path)
    files = _indexed(path, sorted(path.glob("*.safetensors")), "model.safetensors.index.json")
    if files:
        handles = [_open_safetensors(f, stack) for f in files]
    else:
        bins = _indexed(path, sorted(path.glob("pytorch_model*.bin")), "pytorch_model.bin.index.json")
        handles = [_TorchShard(f) for f in bins]
    if not handles:
        raise FileNotFoundError(f"no *.safetensors (or pytorch_model*.bin) files in {path}")
    index: dict[str, Any] = {}
    for h in handles:
        for name in h.keys():
            if name in index:
                raise ValueError(f"{path}: tensor {name!r} is in more than one file")
            index[name] = h
    return index
