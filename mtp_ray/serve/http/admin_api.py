"""The admin routes that act on every engine group of the server (serve/cluster/broadcast.py posts them through the
hub): vLLM's POST /sleep?level=1|2&mode=abort|wait, POST /wake_up, GET /is_sleeping and POST /reset_prefix_cache (its
dev-mode routes, which RL loops call between rollouts); SGLang's GET|POST /flush_cache and POST
/release_memory_occupation / /resume_memory_occupation (sleep level 1 / wake_up). Behind the API key when one is set;
`server.admin_routes: false` turns them off (404). A part of the memory alone (vLLM's wake_up tags, SGLang's tags)
cannot be released or resumed here: such a request is a 400 naming the tags."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from mtp_ray.serve.cluster.broadcast import broadcast
from mtp_ray.serve.http.intake import check_content_type, read_json_object
from mtp_ray.serve.openai.errors import ApiError, bad

ROUTES = ("sleep", "wake_up", "is_sleeping", "reset_prefix_cache", "flush_cache", "release_memory_occupation",
          "resume_memory_occupation")
BODY_BYTES = 1 << 16  # an admin body holds a few tags at most
WHOLE = {"kv_cache", "weights"}  # the parts sleep releases together (SGLang adds cuda_graph: freed with them)
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")  # SGLang's answer


async def answer(route: str, request: Request, hub) -> Response:
    """The route's answer once every group has done it (ApiError: bad input, or the groups' failure)."""
    if route == "is_sleeping":
        view = await hub.view.remote()
        levels = [snap.get("gauges", {}).get("group_sleep_level", 0) for snap in view["live"]["group"].values()]
        return JSONResponse({"is_sleeping": any(levels)})  # (a group asleep: the server does not serve whole)
    check_content_type(request)  # a web page's cross-site form POST (no preflight) must not put the server to sleep
    name, args = await command(route, request)
    try:
        await broadcast(hub, name, args)
    except ApiError as e:
        if route == "flush_cache":  # SGLang answers a flush it did not do with its text and a 400
            return PlainTextResponse(f"{FLUSHED}{e.message}\n", status_code=400)
        raise
    return PlainTextResponse(FLUSHED) if route == "flush_cache" else Response(status_code=200)


async def command(route: str, request: Request) -> tuple[str, dict[str, Any]]:
    """The group command a route asks for and its arguments, checked (400 naming the parameter)."""
    q = request.query_params
    if route == "sleep":
        level, mode = q.get("level", "1"), q.get("mode", "abort")
        if level not in ("1", "2"):
            raise bad(f"level must be 1 or 2, got {level!r}", "level")
        if mode not in ("abort", "wait"):
            raise bad(f"mode must be 'abort' (requests in flight end as aborted) or 'wait' (they finish first), "
                      f"got {mode!r}", "mode")
        return "sleep", {"level": int(level), "in_flight": mode}
    if route == "wake_up":
        _whole(q.getlist("tags") or None, "tags")
        return "wake_up", {}
    if route in ("release_memory_occupation", "resume_memory_occupation"):
        _whole((await read_json_object(request, BODY_BYTES, optional=True))[0].get("tags"), "tags")
        return ("sleep", {"level": 1, "in_flight": "abort"}) if route.startswith("release") else ("wake_up", {})
    return "reset_prefix_cache", {}  # reset_prefix_cache, flush_cache


def _whole(tags: Any, param: str) -> None:
    """None (everything) or tags naming every part: the groups sleep and wake whole."""
    if tags is None:
        return
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise bad(f"{param} must be a list of strings", param)
    if not WHOLE <= set(tags):
        raise bad(f"{param}={tags!r}: only the whole memory ({sorted(WHOLE)} together, or no {param}) can be released "
                  "or resumed", param)
