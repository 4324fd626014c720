"""Shared by the benchmarks: the machine line and the JSON result file (written, and printed)."""

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
