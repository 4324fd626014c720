"""Autoscaling of engine groups on requests, not calls.

Serve's default policy compares its count of ongoing calls per replica with `target_ongoing_requests`. The ingress
admits a burst of requests in one call (serve/cluster/groups.py), so that count would see one request where a group runs
many. Each group reports its own count (`GroupDeployment.record_autoscaling_stats`); `group_policy` is Serve's
default policy with that count (plus what waits at the handles) in place of Serve's. Everything else of the YAML's
autoscaling_config (target, delays, look-back, bounds) means what it means for any Serve deployment.
"""

from __future__ import annotations

from typing import Any

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingContext

REQUESTS_IN_FLIGHT = "requests_in_flight"
POLICY = "mtp_ray.serve.cluster.scaling:group_policy"


def group_policy(ctx: AutoscalingContext) -> tuple[int | float, dict[str, Any]]:
    counts = (ctx.aggregated_metrics or {}).get(REQUESTS_IN_FLIGHT)
    if counts:  # (none yet from a new replica: Serve's own count)
        # total_num_requests is a cached property: the instance attribute set here is what the policy reads
        ctx.total_num_requests = sum(counts.values()) + (ctx.total_queued_requests or 0.0)
    return replica_queue_length_autoscaling_policy(ctx)


def with_group_policy(opts: dict[str, Any]) -> dict[str, Any]:
    """The group deployment's Serve options with `group_policy` in an autoscaling_config that names no policy."""
    auto = opts.get("autoscaling_config")
    if isinstance(auto, dict) and "policy" not in auto:
        opts = {**opts, "autoscaling_config": {**auto, "policy": {"policy_function": POLICY}}}
    return opts
