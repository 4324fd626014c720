"""mtp-ray: Qwen3.5-MoE serving with MTP speculative decoding under DP attention + EP MoE, on Ray.

The public names load on first use (PEP 562): `import mtp_ray.serve...` in an HTTP ingress replica or the `serve run`
CLI does not import torch and the engine with them (torch alone: 2.5 s and ~180 MB of a process on the 2-core CI
machine)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtp_ray.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from mtp_ray.engine.sampling_params import SamplingParams
    from mtp_ray.llm import LLM
    from mtp_ray.request_output import CompletionOutput, Logprob, RequestOutput

_WHERE = {"LLM": "mtp_ray.llm", "SamplingParams": "mtp_ray.engine.sampling_params",
          "RequestOutput": "mtp_ray.request_output", "CompletionOutput": "mtp_ray.request_output",
          "Logprob": "mtp_ray.request_output", "BeamSearchParams": "mtp_ray.beam_search",
          "BeamSearchOutput": "mtp_ray.beam_search", "BeamSearchSequence": "mtp_ray.beam_search"}
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mtp_ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
