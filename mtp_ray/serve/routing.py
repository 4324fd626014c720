"""ServingGroupsRouter: Serve's request router for the engine-group deployment. It passes over a group replica
whose last routing stats say it cannot serve (`GroupDeployment.record_routing_stats`: failed, or being replaced)
while another can, so a failed group stops taking traffic within a stats period rather than after Serve's
health checks replace it. With no group serving it still routes: the group answers GroupUnavailable at once and
the ingress turns that into a 503 within its queue timeout (a router with no candidate would queue forever)."""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class ServingGroupsRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pool = serving(candidate_replicas) or list(candidate_replicas)
        # power of two choices among them: the router sends to the one with the shorter queue
        return [random.sample(pool, 2) if len(pool) > 2 else pool]


def serving(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Replicas not known to be unable to serve (no stats yet counts as serving: a new replica is ready)."""
    return [r for r in replicas if (r.routing_stats or {}).get("serving", True)]
