"""Shared by the benchmarks: the machine line, the JSON result file (written, and printed), a local Ray."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine() -> str:
    return f"{platform.machine()} {os.cpu_count()} cores"


def write_json(out: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


def start_ray(num_cpus: int, **kw) -> None:
    """A local Ray for one benchmark: explicit logical CPUs, no dashboard, token auth off (Ray 2.60 turns it on by
    default, and the CLI calls a benchmark's actors make would then need the token)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **kw)
