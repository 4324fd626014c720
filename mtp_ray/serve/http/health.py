"""A group's health as the HTTP routes answer it: /health (load balancers: healthy or not, and the state) and
/admin/health (operators: the whole report, with ?stats=1 each rank's engine counters as they are now)."""

from __future__ import annotations

import asyncio
import logging

from fastapi.responses import JSONResponse

from mtp_ray.serve.cluster.failures import cause_of, first_line

log = logging.getLogger("mtp_ray.ingress")


async def group_health(group, live: bool | None = None) -> JSONResponse:
    """live None: the public answer (a load balancer's probe waits ~5 s: while no group replica exists, the 503
    comes before that; asleep: 503, state "asleep"); else the whole report (`sleeping` in it), live: with the ranks'
    counters."""
    try:
        h = await asyncio.wait_for(group.health.remote(bool(live)), 3 if live is None else 10)
    except Exception as e:
        why = first_line(cause_of(e))
        log.warning("health: no group answered: %s", why)
        return JSONResponse({"healthy": False, "state": "unavailable", **(  # (the public answer: no internals)
            {"detail": "no engine group answered: starting, or being replaced"} if live is None else {"error": why})},
            status_code=503)
    if live is None and h["healthy"] and h.get("sleeping"):  # (POST /sleep: every group asleep, every request a
        # 503 until /wake_up; a load balancer must read that as not ready, not "ready")
        return JSONResponse({"healthy": False, "state": "asleep"}, status_code=503, headers={"Retry-After": "5"})
    body = {"healthy": h["healthy"], "state": h["state"]} if live is None else h
    return JSONResponse(body, status_code=200 if h["healthy"] else 503)
