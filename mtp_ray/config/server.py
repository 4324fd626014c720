"""ServerConfig: the HTTP front door's settings (the YAML's `args.server`): authentication and request limits."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

API_KEY_ENV = "MTP_RAY_API_KEY"  # as vLLM's VLLM_API_KEY: used when the YAML sets no api_key


@dataclass(frozen=True)
class ServerConfig:
    # clients must send `Authorization: Bearer <api_key>` on every /v1 and /admin route (401 otherwise); None: open
    api_key: str | None = None
    max_body_bytes: int = 16 << 20  # a larger request body is a 413, refused before it is read whole
    max_n: int = 64  # choices per request (n); each is a request of its own on the engine
    max_stop: int = 64  # stop strings per request
    max_prompts: int = 256  # prompts in one completions request (a batch)

    def __post_init__(self) -> None:
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("server.api_key must be a non-empty string")
        for f in fields(self):
            if f.name != "api_key":
                v = getattr(self, f.name)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"server.{f.name} must be an integer >= 1, got {v!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> ServerConfig:
        raw = dict(raw or {})
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(f'server.{u}' for u in unknown)}")
        if raw.get("api_key") is None and os.environ.get(API_KEY_ENV):
            raw["api_key"] = os.environ[API_KEY_ENV]
        return cls(**raw)
