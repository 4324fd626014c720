"""What the rollout APIs (the offline LLM and the RolloutEngine actor handle) check before any rank is asked: vLLM's
wake_up tags and the weight-update group's backend. No torch here: the processes that only route requests (a Serve
group replica, the HTTP ingress) import it."""

from __future__ import annotations

WAKE_TAGS = frozenset({"weights", "kv_cache"})  # vLLM's wake_up tags


def woken_by(tags: list[str] | None) -> set[str]:
    """The tags one wake_up call names (None: all of them); ValueError naming `tags` for anything else."""
    if tags is not None and not (isinstance(tags, list) and set(tags) <= WAKE_TAGS):
        raise ValueError(f"tags must be None or a list of {sorted(WAKE_TAGS)}, got {tags!r}")
    return set(WAKE_TAGS if tags is None else tags)


def check_backend(backend: str) -> None:
    """Before any rendezvous: a store waits for every rank (300 s), so a backend none could join must fail first."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
