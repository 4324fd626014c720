"""What an engine-side failure is, as the Serve side sees it: a group that cannot serve right now, and an exception
raised in the group replica read back to its cause (the refusal it becomes: serve/openai/errors.py)."""

from __future__ import annotations

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from mtp_ray.runtime.group_monitor import GroupFailed, GroupUnavailable

# a group that cannot serve right now: failed or restarting, a rank or the group replica gone, Serve without a replica
UNAVAILABLE = (GroupFailed, GroupUnavailable, RayActorError, ActorUnavailableError, DeploymentUnavailableError,
               ReplicaUnavailableError)


def cause_of(e: BaseException) -> BaseException:
    """An exception raised in the group replica arrives as a RayTaskError whose `cause` is the original."""
    return e.cause if isinstance(e, RayTaskError) and e.cause is not None else e


def first_line(e: BaseException) -> str:
    """The cause in one line (a group failure's first line names the rank and what happened; the lines after it
    are the per-rank report, which goes to the logs and /health)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def unavailable(e: BaseException) -> bool:
    return isinstance(cause_of(e), UNAVAILABLE)
