"""Typed messages between an engine group and its rank workers.

Group -> rank: `AddRequest` (validated at admission; its SamplingParams travel as the object, no dict round trip and no
second validation), `AbortRequest`, `GroupCommand` (run on every rank at the same step). Rank -> group: one msgpack
message per engine step holding every request's `StepOutput` (versioned, like vLLM's engine-core outputs), never one
Ray object per token. A request the rank refused carries `StepOutput.error` and ends its caller with `RequestError`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

import msgpack

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.engine.sampling_params import SamplingParams

VERSION = 6
# a StepOutput on the wire: its fields as a msgpack array in declaration order (one schema on both ends)
_FIELDS = tuple(f.name for f in fields(StepOutput))
_ROW = attrgetter(*_FIELDS)  # ~0.3 us a row (dataclasses.astuple deep-copies: ~16 us)


class RequestError(ValueError):
    """A request a rank refused (the engine's admission check raised): the caller's error, not the group's."""


class ModelError(RuntimeError):
    """A request the model could not go on with (its logits were not finite): the model's error, not the caller's;
    the group serves on."""


def request_error(out: StepOutput) -> Exception:
    """The exception a request that ended with `out.error` raises for its caller."""
    return ModelError(out.error) if out.model_fault else RequestError(out.error)


@dataclass(frozen=True)
class AdmitItem:
    """One request of an ingress's batched admission (`EngineGroup.admit_batch`), params validated there."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    subscriber: str = ""  # who pulls its outputs from the rank (an ingress replica); "" the group's poll


@dataclass(frozen=True)
class Admission:
    """A request a group admitted for a subscriber: the rank that holds it, whose `pull` carries its outputs."""

    request_id: str
    group_id: str
    epoch: int  # the group's start count: a restarted group's ranks are other actors
    rank: int
    worker: Any  # the rank's actor handle

    @property
    def source(self) -> str:
        """Names the rank actor (one pull loop per source)."""
        return f"{self.group_id}/e{self.epoch}/r{self.rank}"


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class GroupCommand:
    seq: int  # the group's command number: every rank runs command `seq` at the same step, in order
    name: str  # a name runtime/rank_commands.py knows (sleep, wake_up, update_weights, ...)
    args: tuple[Any, ...] = ()


def pack_step(step: int, outs: list[StepOutput]) -> bytes:
    return msgpack.packb({"v": VERSION, "step": step, "fields": len(_FIELDS), "outs": [_ROW(o) for o in outs]},
                         use_bin_type=True)


def unpack_step(data: bytes) -> tuple[int, list[StepOutput]]:
    """The step number and its outputs (top log-prob maps keep their int token ids)."""
    msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if msg.get("v") != VERSION or msg.get("fields") != len(_FIELDS):
        raise ValueError(f"rank output message version {msg.get('v')} ({msg.get('fields')} fields) != {VERSION} "
                         f"({len(_FIELDS)} fields): ranks and group run different code")
    return msg["step"], [StepOutput(*row) for row in msg["outs"]]
