"""Weight updates on a rank: named tensors (host tensors or Ray object refs) into a rank's model, and a weight-update
process group between a trainer (rank 0) and the engine ranks (rank_offset + r), as verl / OpenRLHF use it.

Every update is validated in full (names, shapes, dtypes) before any tensor is copied, so a bad update raises
an error naming the tensor and leaves the old weights serving, on every rank: the ranks agree on the outcome of
their checks before any copies (a rank that does not fetch another rank's expert cannot check its shape). Expert
tensors given as object refs of their own are fetched only by their owner.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mtp_ray.engine.rollout_checks import check_backend
from mtp_ray.model.loader import WeightLoader

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}


def resolve(items: Any, owns: Callable[[str], bool] = lambda name: True) -> list[tuple[str, torch.Tensor | None]]:
    """(name, tensor) pairs from a dict, a list of pairs, or Ray object refs of either (refs resolved here). A
    tensor given as its own object ref whose name `owns` refuses (another EP rank's expert) is not fetched: its
    pair comes back as (name, None)."""
    import ray

    if isinstance(items, ray.ObjectRef):
        items = ray.get(items)
    if isinstance(items, dict):
        items = list(items.items())
    out: list[tuple[str, torch.Tensor | None]] = []
    for pair in items:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError("weights must be (name, tensor) pairs, a {name: tensor} dict, or object refs of them")
        name, t = pair
        if isinstance(t, ray.ObjectRef):
            if not owns(name):
                out.append((name, None))
                continue
            t = ray.get(t)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"weight {name!r} is a {type(t).__name__}, not a torch.Tensor")
        out.append((name, t))
    return out


def check_update(loader: WeightLoader, items: list[tuple[str, torch.Tensor | None]]) -> None:
    """Every tensor validated (names only for those not fetched) before any is copied."""
    for name, t in items:
        loader.check(name, list(t.shape) if t is not None else None, t.dtype if t is not None else None)


def apply_update(loader: WeightLoader, items: list[tuple[str, torch.Tensor | None]]) -> int:
    """Copy a checked update in; returns the tensors this rank fetched and loaded."""
    n = 0
    for name, t in items:
        if t is None:
            continue
        t = t.detach()
        loader.load(name, list(t.shape), lambda rows, t=t: t if rows is None else t[rows])
        n += 1
    return n


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (one of {sorted(_DTYPES)})")
    return _DTYPES[name]


def make_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float = 300.0):
    """A process group of its own (trainer + engine ranks), independent of the ranks' DP group."""
    check_backend(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "nccl":
        return store, dist.ProcessGroupNCCL(prefixed, rank, world_size)
    return store, dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def receive(pg, names: list[str], dtypes: list, shapes: list, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Receive every broadcast (always all of them, so the trainer never hangs), then hand them back."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must have the same length")
    out = []
    for name, dt, shape in zip(names, dtypes, shapes):
        t = torch.empty(list(shape), dtype=dtype_of(dt), device=device)
        pg.broadcast(t, root=0).wait()
        out.append((name, t))
    return out
