"""Who may call which route (serve/http/guard.py), as rules and through the FastAPI app's middleware, without Ray:
an API key on every route but the health checks; without one, no DNS-rebinding Host and no web page on the admin
routes (issue 64, item 3). tests/test_serve_admin.py sends the same requests through `serve run`'s app."""

from __future__ import annotations

import pytest

from mtp_ray.config.server import ServerConfig
from mtp_ray.serve.http.guard import Guard

LOCAL = {"host": "127.0.0.1:8000"}


def status(guard: Guard, path: str, headers: dict | None = None, client: str | None = "127.0.0.1",
           method: str = "POST") -> int:
    err = guard.check(method, path, {**LOCAL, **(headers or {})}, client)
    return 200 if err is None else err.status


@pytest.mark.parametrize("path", ["/v1/completions", "/metrics", "/get_server_info", "/get_model_info", "/version",
                                  "/load", "/v1/models", "/sleep", "/admin/health", "/tokenize", "/docs"])
def test_with_a_key_every_route_but_health_needs_it(path):
    g = Guard(api_key="sk-1")
    assert status(g, path) == 401
    assert status(g, path, {"authorization": "Bearer sk-1"}) == 200
    assert status(g, path, {"x-api-key": "sk-1"}) == 200  # (Anthropic's clients)
    assert status(g, path, {"authorization": "Bearer sk-2"}) == 401
    # the key is what counts: a keyed server's routes answer any Host or origin that sends it
    assert status(g, path, {"authorization": "Bearer sk-1", "host": "rebound.example", "origin": "http://x"},
                  client="10.1.2.3") == 200


@pytest.mark.parametrize("path", ["/health", "/ping", "/health_generate", "/health/"])
def test_health_checks_are_open_whatever_the_key_or_host(path):
    for g in (Guard(api_key="sk-1"), Guard()):
        assert status(g, path, {"host": "rebound.example", "origin": "http://x"}, client="10.1.2.3",
                      method="GET") == 200


@pytest.mark.parametrize("host,ok", [("127.0.0.1:8000", True), ("localhost:8000", True), ("LOCALHOST", True),
                                     ("[::1]:8000", True), ("10.0.0.5", True), ("::1", True),
                                     ("evil.example", False), ("evil.example:8000", False),
                                     ("localhost.evil.example", False), ("127.0.0.1.nip.io", False)])
def test_without_a_key_a_rebinding_host_is_refused(host, ok):
    err = Guard().check("POST", "/v1/completions", {"host": host}, "127.0.0.1")
    assert (err is None) == ok, (host, err)
    if err is not None:
        assert err.status == 403 and "allowed_hosts" in err.message and err.code == "host_not_allowed"


def test_allowed_hosts_names_subdomains_and_any():
    g = Guard(allowed_hosts=("my.server", ".corp.example"))
    for host, ok in (("my.server:8000", True), ("MY.SERVER", True), ("a.corp.example", True), ("corp.example", True),
                     ("xcorp.example", False), ("other.server", False)):
        assert (g.check("GET", "/v1/models", {"host": host}, "10.0.0.9") is None) == ok, host
    assert Guard(allowed_hosts=("*",)).check("GET", "/v1/models", {"host": "any.name"}, "10.0.0.9") is None


@pytest.mark.parametrize("headers", [{"origin": "http://evil.example"}, {"origin": "null"},
                                     {"origin": "http://127.0.0.1:8000"}, {"sec-fetch-site": "cross-site"},
                                     {"sec-fetch-site": "same-site"}])
@pytest.mark.parametrize("path", ["/sleep", "/wake_up", "/flush_cache", "/reset_prefix_cache", "/admin/health",
                                  "/release_memory_occupation"])
def test_without_a_key_web_pages_cannot_use_the_admin_routes(headers, path):
    """A page's no-cors POST (or an image's GET) to http://127.0.0.1:8000/sleep carries an Origin or a cross-site
    Sec-Fetch-Site: refused, so a page cannot put the groups to sleep or flush their caches."""
    err = Guard().check("POST", path, {**LOCAL, **headers}, "127.0.0.1")
    assert err is not None and err.status == 403 and err.code == "cross_site_request", err
    assert Guard().check("POST", path, LOCAL, "127.0.0.1") is None  # a local tool (curl, an RL driver)
    assert Guard().check("POST", path, {**LOCAL, "sec-fetch-site": "none"}, "::1") is None  # typed in the address bar


def test_without_a_key_the_admin_routes_answer_only_the_loopback():
    for client in ("10.0.0.7", "192.168.1.20", None, "not-an-address"):
        err = Guard().check("POST", "/sleep", {"host": "10.0.0.1:8000"}, client)
        assert err is not None and err.status == 403 and "server.api_key" in err.message, client
    # generation routes stay open to the network and to pages (CORS: any origin, as vLLM)
    assert Guard().check("POST", "/v1/chat/completions", {"host": "10.0.0.1:8000", "origin": "http://ui.example"},
                         "10.0.0.7") is None


def test_preflights_pass_to_cors():
    assert Guard(api_key="k").check("OPTIONS", "/v1/completions", {"host": "x.example"}, "10.0.0.7") is None


def test_allowed_hosts_in_the_server_config():
    assert ServerConfig.from_dict({"allowed_hosts": ["My.Host", ".example.com"]}).allowed_hosts == (
        "my.host", ".example.com")
    for bad in ("my.host", [""], [1], [" x"]):
        with pytest.raises(ValueError, match="server.allowed_hosts"):
            ServerConfig.from_dict({"allowed_hosts": bad})


def test_the_app_applies_the_guard_before_any_route_in_each_api_shape():
    """Through the FastAPI app (Starlette's test client, no Serve): a refusal answers before any route runs, with
    CORS headers (a page reads why), in Anthropic's error shape on its routes; a preflight is CORS's."""
    from starlette.testclient import TestClient

    from mtp_ray.serve.http.http_app import app

    counted: list[str] = []
    app.state.guard = Guard(api_key="sk-1", count=counted.append)
    try:
        c = TestClient(app, base_url="http://127.0.0.1:8000")
        r = c.get("/metrics", headers={"origin": "http://ui.example"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["access-control-allow-origin"] == "*"
        r = c.post("/v1/messages", json={})
        assert r.status_code == 401 and r.json()["type"] == "error", r.json()  # Anthropic's shape
        r = c.options("/v1/completions", headers={"origin": "http://ui.example",
                                                   "access-control-request-method": "POST"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert c.get("/nothing", headers={"authorization": "Bearer sk-1"}).status_code == 404
        # each refusal counts in the replica's request_failed_total{status} (the preflight and the 404 do not here)
        assert counted == ['request_failed_total{status="401"}'] * 2, counted
        app.state.guard = Guard()
        r = TestClient(app, base_url="http://rebound.example:8000").get("/nothing")
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    finally:
        del app.state.guard
