"""ServingGroupsRouter: Serve's request router for the engine-group deployment.

- It passes over a group replica whose last routing stats say it cannot serve (`GroupDeployment.record_routing_stats`:
  failed, being replaced, a rank not answering) while another can, so a failed group stops taking traffic within a
  stats period rather than after Serve's health checks replace it. With no group serving it still routes: the group
  answers GroupUnavailable at once and the ingress turns that into a 503 within its queue timeout (a router with no
  candidate would queue forever).
- It passes over the groups an admission call names in `avoid` (they refused this ingress's requests in the last
  AVOID_S, serve/cluster/admissions.py) while another can serve: a refused request sent again went back to the stuck
  group until its stats said so (a second later), each time after a back-off, and a least-requests choice favours it
  (the requests this router sent the good group meanwhile count there until its next stats).
- It sends each call to the group with the fewest requests: the group's own count from its stats (every second)
  plus the requests this router sent it since. Serve's count is of calls, and one admission call carries a burst of
  requests (serve/cluster/groups.py), so the fewest calls put a 16-request burst on one group of two and 1 on the other.
"""

from __future__ import annotations

import random
import time

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

# routing stats' keys: the group's requests in flight, when (time.time()), its group_id
IN_FLIGHT, STAMP, GROUP = "in_flight", "at", "group"
# a call sent this long before a group's count may still have been on its way (the count missed it): counted on top
TRANSIT_S = 0.5


class ServingGroupsRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self.sent: dict[str, list[tuple[float, int]]] = {}  # replica id -> (when, requests) this router sent it

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pool = serving(candidate_replicas) or list(candidate_replicas)
        avoid = set(pending_request.kwargs.get("avoid", ())) if pending_request is not None else set()
        pool = [r for r in pool if (r.routing_stats or {}).get(GROUP) not in avoid] or pool
        if len(pool) <= 1:
            return [pool]
        loads = {r.replica_id.unique_id: self._load(r) for r in pool}
        least = min(loads.values())
        best = random.choice([r for r in pool if loads[r.replica_id.unique_id] == least])
        # counted as it is chosen: the calls of a split burst are all chosen before the first is routed
        self.sent.setdefault(best.replica_id.unique_id, []).append((time.time(), requests_in(pending_request)))
        return [[best]]

    def _load(self, r: RunningReplica) -> int:
        """Its requests when it last counted them (wall clock: the group's process is another) and those this
        router sent it since, or shortly before: a call still on its way when the group counted is not in its count
        (a burst's first call and the rest then went to the same group of two: its count, stamped after the first
        was sent, said 0). Counting a request that did arrive twice for TRANSIT_S errs towards spreading."""
        stats = r.routing_stats or {}
        counted = stats.get(STAMP, 0.0)
        sent = [(t, n) for t, n in self.sent.get(r.replica_id.unique_id, []) if t > counted - 1.0]
        self.sent[r.replica_id.unique_id] = sent  # (older ones are in its count; a second of clock skew kept)
        return int(stats.get(IN_FLIGHT, 0)) + sum(n for t, n in sent if t > counted - TRANSIT_S)


def requests_in(pending: PendingRequest | None) -> int:
    """Requests a call carries: an admission call's items (GroupDeployment.admit_batch), else one."""
    if pending is None or pending.metadata.call_method != "admit_batch" or not pending.args:
        return 1
    return max(1, len(pending.args[0])) if isinstance(pending.args[0], list) else 1


def serving(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Replicas not known to be unable to serve (no stats yet counts as serving: a new replica is ready)."""
    return [r for r in replicas if (r.routing_stats or {}).get("serving", True)]
