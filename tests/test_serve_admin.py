"""The admin routes over HTTP, on a server of two engine groups: vLLM's /sleep, /wake_up, /is_sleeping,
/reset_prefix_cache and SGLang's /flush_cache, /release_memory_occupation, /resume_memory_occupation act on every
group (a Serve handle call reaches one), bad parameters get a 400 naming them, and the output after a sleep and a
wake-up equals the output before."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.test_serve_faults import BASE, app, scrape, serve_app  # noqa: F401 (app, serve_app: fixtures)

pytestmark = pytest.mark.serve  # (Ray Serve: its own worker and cluster under -n 2, conftest.worker_of)


def sleep_levels() -> dict[str, float]:
    """group id -> its sleep level, from /metrics (every group's report, whichever ingress answers)."""
    return {s.split('group="')[1].split('"')[0]: v for s, v in scrape().items()
            if s.startswith("mtp_ray:group_sleep_level") and 'group="retired"' not in s}


def until_reported(levels: set[float]) -> dict[str, float]:
    """Sleep levels once both groups' reports show one of `levels` (reports come once a second)."""
    deadline = time.monotonic() + 10
    while True:
        seen = sleep_levels()
        if len(seen) == 2 and set(seen.values()) <= levels or time.monotonic() > deadline:
            return seen
        time.sleep(0.3)


def greedy(prompt: str) -> str:
    r = requests.post(f"{BASE}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def is_sleeping() -> bool:
    r = requests.get(f"{BASE}/is_sleeping", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


@pytest.mark.parametrize("app", [2], indirect=True)
def test_admin_routes_act_on_every_group(app):  # noqa: F811 (the fixture)
    before = [greedy(f"def f{i}(x):") for i in range(4)]  # (spread over both groups by the router)
    assert len(until_reported({0})) == 2 and not is_sleeping()
    for path, param in (("/sleep?level=3", "level"), ("/sleep?mode=keep", "mode"), ("/wake_up?tags=weights", "tags")):
        r = requests.post(BASE + path, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    r = requests.post(f"{BASE}/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
    assert r.status_code == 400 and "tags" in r.json()["error"]["message"], r.text
    r = requests.post(f"{BASE}/sleep", data={"level": "1"}, timeout=30)  # a form, as a cross-site page could post
    assert r.status_code == 415 and not is_sleeping(), r.text

    with ThreadPoolExecutor(2) as pool:  # two at once: one sleeps, the other finds the groups asleep
        codes = [f.result().status_code for f in [pool.submit(requests.post, f"{BASE}/sleep?level=1", timeout=120)
                                                  for _ in range(2)]]
    assert codes == [200, 200], codes
    assert is_sleeping() and until_reported({1}) == dict.fromkeys(sleep_levels(), 1.0)  # both groups asleep
    assert requests.post(f"{BASE}/sleep", timeout=120).status_code == 200  # asleep already: nothing to do
    h = requests.get(f"{BASE}/health", timeout=30)  # a load balancer reads "not ready" while every group sleeps
    assert (h.status_code, h.json(), bool(h.headers.get("Retry-After"))) == (503, {"healthy": False,
                                                                                 "state": "asleep"}, True), h.text
    t0 = time.monotonic()  # a request while every group sleeps: held, then a 503 within the queue timeout
    r = requests.post(f"{BASE}/v1/completions", timeout=60, json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.headers.get("Retry-After") and time.monotonic() - t0 < 20, r.text
    assert "asleep" in r.json()["error"]["message"], r.text
    r = requests.post(f"{BASE}/wake_up", timeout=120)
    assert r.status_code == 200, r.text
    assert not is_sleeping() and set(until_reported({0}).values()) == {0}
    assert requests.get(f"{BASE}/health", timeout=30).json() == {"healthy": True, "state": "ready"}
    assert [greedy(f"def f{i}(x):") for i in range(4)] == before

    assert requests.post(f"{BASE}/reset_prefix_cache", timeout=120).status_code == 200
    r = requests.get(f"{BASE}/flush_cache", timeout=120)
    assert r.status_code == 200 and r.text.startswith("Cache flushed"), r.text

    r = requests.post(f"{BASE}/release_memory_occupation", json={}, timeout=120)  # SGLang's: sleep level 1
    assert r.status_code == 200, r.text
    assert is_sleeping() and set(until_reported({1}).values()) == {1}
    r = requests.post(f"{BASE}/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]}, timeout=120)
    assert r.status_code == 200, r.text
    assert not is_sleeping() and [greedy(f"def f{i}(x):") for i in range(4)] == before


@pytest.mark.parametrize("app", [2], indirect=True)
def test_an_open_server_keeps_web_pages_and_rebinding_hosts_out(app):  # noqa: F811 (the fixture)
    """No API key (this app's): a page's no-cors POST to /sleep (an Origin, a text/plain body), an image's GET of
    /flush_cache (Sec-Fetch-Site: cross-site) and any request by a rebinding name are 403, through Serve's proxy;
    the same routes from a local tool, and generation from a page (CORS, as vLLM), still answer."""
    r = requests.post(f"{BASE}/sleep", data="x", timeout=30, headers={
        "Origin": "https://evil.example", "Content-Type": "text/plain", "Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request", r.text
    r = requests.get(f"{BASE}/flush_cache", timeout=30, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403, r.text
    assert not is_sleeping()
    for path in ("/v1/models", "/metrics", "/is_sleeping"):
        r = requests.get(f"{BASE}{path}", timeout=30, headers={"Host": "rebound.example:8014"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (path, r.text)
    assert requests.get(f"{BASE}/health", timeout=30, headers={"Host": "rebound.example:8014"}).status_code == 200
    r = requests.post(f"{BASE}/v1/completions", timeout=60, headers={"Origin": "https://ui.example"},
                      json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", r.text
    assert requests.get(f"{BASE}/flush_cache", timeout=120, headers={"Host": "localhost:8014"}).status_code == 200


def test_command_board_hands_each_command_once_and_never_waits_for_a_gone_group():
    from mtp_ray.serve.cluster.broadcast import CommandBoard

    board = CommandBoard(keep_s=60)
    seq = board.post("sleep", {"level": 1}, ["g1", "g2"])
    assert board.take("g1") == [{"seq": seq, "name": "sleep", "args": {"level": 1}}] and board.take("g1") == []
    assert board.take("g3") == []  # not a target (it was not up when the command was posted)
    board.answer("g1", seq, {"ok": True})
    board.answer("g3", seq, {"ok": True})  # (ignored)
    assert board.status(seq, live={"g1", "g2"}) == {"done": False, "results": {"g1": {"ok": True}}}
    st = board.status(seq, live={"g1"})  # g2 stopped reporting before it answered
    assert st["done"] and not st["results"]["g2"]["ok"] and "went away" in st["results"]["g2"]["error"]
    with pytest.raises(ValueError, match="unknown group command"):
        board.post("shutdown", {}, ["g1"])
    board.keep_s = 0
    later = board.post("wake_up", {}, ["g1"])  # posting forgets commands older than keep_s
    assert list(board.posted) == [later] and board.status(seq, {"g1"})["done"]
