"""The front door of the in-process Serve app with an API key: authentication, request limits, hostile input (each
a 4xx in OpenAI's error shape naming the field, streamed or not), and a large body that does not stall the others."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from tests.conftest import SERVE_PORT

pytestmark = pytest.mark.serve  # (Ray Serve: its own worker and cluster under -n 2, conftest.worker_of)

PORT = SERVE_PORT
BASE = f"http://127.0.0.1:{PORT}"
KEY = "sk-test-front-door"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_N, MAX_STOP = 4, 3


@pytest.fixture(scope="module")
def server(serve_http):
    serve = serve_http

    from mtp_ray.serve.app import build_app

    args = {"served_model_name": "tiny",
            "engine": {"device": "cpu", "warmup": "none", "parallel": {"dp": 1, "cpus_per_rank": 0.2},
                       "spec": {"num_speculative_tokens": 2}, "scheduler": {"max_model_len": 512}},
            "group": {"num_replicas": 1}, "ingress": {"num_replicas": 1},
            "server": {"api_key": KEY, "max_n": MAX_N, "max_stop": MAX_STOP}}
    serve.run(build_app(args), name="front", route_prefix="/")
    yield
    serve.delete("front")


def post(body, path: str = "/v1/completions", headers: dict | None = None, **kw) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(f"{BASE}{path}", data=data, timeout=60,
                         headers={"Content-Type": "application/json", **AUTH, **(headers or {})}, **kw)


def error_of(r: requests.Response) -> dict:
    """The OpenAI error object of a response, whether it came as a status or as a streamed event."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        return next(e["error"] for e in events if "error" in e)
    return r.json()["error"]


def test_no_access_log_line_per_request_unless_asked(server):
    """Serve's access log (a formatted line per HTTP request, shipped to `serve run`'s console) is off at the
    ingress by default: at 128 streams a CPU server gave 0.82-0.88 of the tok/s with it on. The replica's own log still
    runs; `ingress: {logging_config: {enable_access_log: true}}` turns the lines back on."""
    from pathlib import Path

    import ray

    from mtp_ray.serve.app import build_app

    assert post({"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"

    def text(deployment: str) -> str:
        return "".join(f.read_text() for f in sorted(logs.glob(f"replica_front_{deployment}_*.log")))

    # the group replica keeps Serve's access log: its line for the admission call is written after the ingress's
    # line for the same request would have been (seen: 0.45 s later), so once it is there the check is not early
    deadline = time.monotonic() + 30
    while "CALL admit_batch OK" not in text("EngineGroup") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "CALL admit_batch OK" in text("EngineGroup")
    time.sleep(0.5)
    ingress = text("OpenAIIngress")
    assert "Finished initializing replica" in ingress  # the replica's own log is written
    assert "POST /v1/completions" not in ingress
    on = build_app({"engine": {"device": "cpu"}, "ingress": {"logging_config": {"enable_access_log": True,
                                                                                 "log_level": "DEBUG"}}})
    cfg = on._bound_deployment._deployment_config.logging_config
    assert cfg["enable_access_log"] is True and cfg["log_level"] == "DEBUG"


def test_cors_preflight_as_vllm_answers_it(server):
    """A browser's preflight (OPTIONS, no credentials) is answered for any origin, as vLLM's server does (it was a
    405); the call itself still needs the key."""
    r = requests.options(f"{BASE}/v1/chat/completions", timeout=30, headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", (r.status_code, r.headers)
    r = requests.post(f"{BASE}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=30,
                      headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"


def test_api_key_through_the_official_client(server):
    from openai import AuthenticationError, OpenAI

    ok = OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0)
    out = ok.completions.create(model="tiny", prompt="def f(", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    assert [m.id for m in ok.models.list().data] == ["tiny"]
    for key in ("wrong", ""):
        bad = OpenAI(base_url=f"{BASE}/v1", api_key=key or "x", max_retries=0,
                     default_headers={"Authorization": ""} if not key else None)
        with pytest.raises(AuthenticationError):
            bad.completions.create(model="tiny", prompt="def f(", max_tokens=4)
        with pytest.raises(AuthenticationError):
            bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        with pytest.raises(AuthenticationError):
            bad.models.list()


def test_anthropic_clients_send_their_key_as_x_api_key(server):
    import anthropic

    kw = dict(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    ok = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0, timeout=60).messages.create(**kw)
    assert ok.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=BASE, api_key="wrong", max_retries=0, timeout=60).messages.create(**kw)


def test_open_and_closed_routes(server):
    h = requests.get(f"{BASE}/health")
    assert h.status_code == 200 and h.json() == {"healthy": True, "state": "ready"}  # no internals
    assert requests.get(f"{BASE}/admin/health").status_code == 401
    detail = requests.get(f"{BASE}/admin/health", headers=AUTH)
    assert detail.status_code == 200 and "ranks" in detail.json()
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/nothing"):
        assert requests.get(f"{BASE}{path}").status_code == 401, path  # (the key first, on every route)
        r = requests.get(f"{BASE}{path}", headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404, (path, r.text)
    assert requests.post(f"{BASE}/tokenize", json={"prompt": "x"}).status_code == 401
    # with a key nothing but the health checks answers without it: not the model's paths, counters or version
    for path in ("/get_server_info", "/get_model_info", "/metrics", "/version", "/load", "/is_sleeping"):
        r = requests.get(f"{BASE}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert requests.get(f"{BASE}{path}", headers=AUTH).status_code == 200, path
    # those refusals count in request_failed_total{status="401"}, as the routes' own errors do (12 above)
    deadline, failed = time.monotonic() + 20, 0.0
    while failed < 12 and time.monotonic() < deadline:
        time.sleep(0.5)  # (each replica reports to the metrics hub about once a second)
        text = requests.get(f"{BASE}/metrics", headers=AUTH).text
        failed = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("mtp_ray:request_failed_total{") and 'status="401"' in line)
    assert failed >= 12, failed


def test_what_other_servers_clients_send_and_read(server):
    """SGLang's, lmdeploy's and SageMaker's routes, fields and error shapes: liveness at /ping and /health_generate,
    /v1/tokenize, /get_model_info; lmdeploy's client body ("kwargs": {}, min_new_tokens, max_completion_tokens on
    completions); SGLang's extras at their neutral value (else a 400 naming them); the flat error keys beside
    OpenAI's nested ones; reasoning_effort "none" turning thinking off (vLLM's), unless the request says."""
    for method in ("get", "post"):
        assert requests.request(method, f"{BASE}/ping").status_code == 200
    assert requests.get(f"{BASE}/health_generate").json() == {"healthy": True, "state": "ready"}
    tok = {"model": "tiny", "prompt": "def f(x):"}
    assert post(tok, "/v1/tokenize").json() == post(tok, "/tokenize").json()
    info = requests.get(f"{BASE}/get_model_info", headers=AUTH).json()
    assert info["is_generation"] is True and info["model_path"].endswith("tiny-qwen35-mtp"), info
    first = post({"model": "tiny", "prompt": "x", "max_tokens": 1, "temperature": 0, "return_token_ids": True})
    stop = {"model": "tiny", "prompt": "x", "temperature": 0, "stop_token_ids": first.json()["choices"][0]["token_ids"]}
    lmdeploy = {**stop, "kwargs": {}, "max_completion_tokens": 6, "min_new_tokens": 4, "top_k": 40,
                "spaces_between_special_tokens": True, "return_hidden_states": False, "rid": "r1", "lora_path": None}
    r = post({**stop, "max_tokens": 6})
    assert r.json()["usage"]["completion_tokens"] == 1, (first.text, r.text)  # stopped at once
    r = post(lmdeploy)
    assert r.status_code == 200 and 4 <= r.json()["usage"]["completion_tokens"] <= 6, r.text
    for field, value in (("kwargs", {"a": 1}), ("return_hidden_states", True), ("lora_path", "/adapters/x")):
        r = post({**lmdeploy, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and "not supported" in r.text, r.text
        body = r.json()  # the flat keys (vLLM's older shape, lmdeploy's tests) beside OpenAI's
        assert body["object"] == "error" and {k: body[k] for k in body["error"]} == body["error"], body
    r = post({"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "The served model name is `tiny`" in r.json()["message"], r.text
    r = post({"model": "", "prompt": "x", "max_tokens": 1})  # an empty name is the served model (vLLM's rule)
    assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
    msgs = [{"role": "user", "content": "hi"}]

    def prompt_ids(**extra) -> list[int]:
        r = post({"model": "tiny", "messages": msgs, "max_tokens": 1, "return_token_ids": True, **extra},
                 "/v1/chat/completions")
        assert r.status_code == 200, r.text
        return r.json()["prompt_token_ids"]

    think, no_think = (prompt_ids(chat_template_kwargs={"enable_thinking": on}) for on in (True, False))
    assert think != no_think
    assert prompt_ids(reasoning_effort="none") == no_think
    assert prompt_ids(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == think


BAD = [  # (body, status, param)
    ({"model": "tiny", "prompt": "a\ud800b", "max_tokens": 4}, 400, "prompt"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x\udfff"}], "max_tokens": 4}, 400, "messages"),
    ({"model": "tiny", "prompt": [5, 6, 10**6], "max_tokens": 4}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"\u00b2": 5}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "n": MAX_N + 1}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d"]}, 400, "stop"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [10**7], "max_tokens": 4}, 400, "stop_token_ids"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": ["x"] * 300, "max_tokens": 1}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x" * 200_000, "max_tokens": 1}, 400, "prompt"),
    # a lone surrogate anywhere (a field a response or an error message would echo), or too large for a float
    ({"model": "tiny\ud800", "prompt": "x", "max_tokens": 1}, 400, "model"),
    ({"model": "tiny", "prompt": "x", "user": "\udc00", "max_tokens": 1}, 400, "user"),
    ({"model": "tiny", "prompt": "x", "temperature": 2**1100, "max_tokens": 1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "temperature": float("nan"), "max_tokens": 1}, 400, None),  # not JSON
    # an echoed prompt is decoded before admission: its ids are checked first
    ({"model": "tiny", "prompt": ["a b", [5, 10**12]], "echo": True, "max_tokens": 2}, 400, "prompt"),
    # a schema llguidance panics on (a Rust panic is a BaseException): refused, never a failed rank
    ({"model": "tiny", "prompt": "x", "max_tokens": 2,
      "structured_outputs": {"json": {"type": "object", "required": "\U0001F642" * 50}}}, 400, "structured_outputs"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_input_is_a_4xx_naming_the_field(server, case, stream):
    body, status, param = BAD[case]
    chat = "messages" in body
    r = post({**body, "stream": stream}, "/v1/chat/completions" if chat else "/v1/completions")
    assert r.status_code == status, r.text[:300]
    err = error_of(r)
    assert err["param"] == param and err["message"] and err["type"], err


def test_hostile_bodies(server):
    deep = ("[" * 100_000) + ("]" * 100_000)
    r = post(deep)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    r = post(b"\xff\xfe not json")
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    big = b'{"prompt": "' + b"x" * (17 << 20) + b'"}'
    r = post(big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "Payload Too Large" in r.json()["error"]["message"]  # (SGLang's test reads the phrase)
    # the largest seed with n > 1: each choice's seed stays valid; past a signed 64-bit integer a 400 (as vLLM's,
    # whose test_long_seed reads pydantic's words in the message)
    r = post({"model": "tiny", "prompt": "x", "n": 2, "seed": 2**63 - 1, "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    for seed, word in ((2**63, "less_than_equal"), (-2**63 - 1, "greater_than_equal")):
        r = post({"model": "tiny", "prompt": "x", "seed": seed, "max_tokens": 3})
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    # integers past 2**63 where a float is meant: served (they failed the group's tensor arithmetic)
    for field in ("temperature", "repetition_penalty"):
        r = post({"model": "tiny", "prompt": "x", field: 2**70, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", (field, r.text)
    # a Responses request echoes metadata and tools: a lone surrogate there is a 400, not a 500
    tool = {"type": "function", "name": "f\ud800", "parameters": {}}
    for extra in ({"metadata": {"k": "\ud800"}}, {"tools": [tool]}):
        r = post({"model": "tiny", "input": "x", "max_output_tokens": 2, **extra}, "/v1/responses")
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text
    # numbers JSON has not (a Response would echo them in its tools, and could not be written): 400
    for raw in (b'{"model": "tiny", "prompt": "x", "top_p": 1e999}', b'{"model": "tiny", "input": "x", "tools": '
                b'[{"type": "function", "name": "f", "parameters": {"type": "object", "maximum": Infinity}}]}'):
        r = post(raw, "/v1/responses" if b"input" in raw else "/v1/completions")
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"], r.text
    r = post({"model": "tiny", "input": [{"role": ["user"], "content": "x"}], "max_output_tokens": 2}, "/v1/responses")
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert requests.get(f"{BASE}/health").json()["healthy"]


def test_a_10_mb_body_does_not_stall_a_normal_request(server):
    """A 10 MB token-id prompt (parsed off the event loop, then refused: too long) and a normal request sent at the
    same time: the normal one is served in under 2 s."""
    big = json.dumps({"model": "tiny", "prompt": list(range(1000, 4000)) * 600, "max_tokens": 1})
    assert 10_000_000 < len(big) < 16 << 20
    out = {}

    def send_big() -> None:
        out["big"] = post(big)

    t = threading.Thread(target=send_big)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    r = post({"model": "tiny", "prompt": "def f(", "max_tokens": 8, "temperature": 0})
    elapsed = time.monotonic() - t0
    t.join(60)
    assert r.status_code == 200 and elapsed < 2.0, (r.status_code, elapsed)
    assert out["big"].status_code == 400 and out["big"].json()["error"]["param"] == "prompt"


def test_a_large_tokenize_does_not_stall_the_replica(server):
    """/tokenize of a 4 MB text (seconds of tokenising) runs off the event loop: /health answers meanwhile, and the
    count comes back."""
    text = "a " * 2_000_000
    out = {}
    t = threading.Thread(target=lambda: out.update(r=post({"model": "tiny", "prompt": text}, "/tokenize")))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    health = requests.get(f"{BASE}/health", timeout=60)
    elapsed = time.monotonic() - t0
    t.join(120)
    assert health.status_code == 200 and elapsed < 2.0, (health.status_code, elapsed)
    assert out["r"].status_code == 200 and out["r"].json()["count"] >= 2_000_000


def test_many_messages_past_the_context_are_refused_before_the_template(server):
    """Each message short, together far more characters than the context can hold: a 400 naming 'messages' from
    the character count, without templating and tokenising them."""
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 400} for i in range(400)]
    r = post({"model": "tiny", "messages": msgs, "max_tokens": 2}, "/v1/chat/completions")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and "too long" in err["message"], r.text


def _counters(prefix: str, where: str = "") -> float:
    text = requests.get(f"{BASE}/metrics", headers=AUTH, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix) and where in line)


def test_a_client_gone_mid_body_is_an_abort_not_a_server_error(server):
    """A client that drops its connection while the body is read (it promised more bytes) is counted aborted;
    it was an 'internal error' with a traceback and request_failed_total{status="500"}."""
    import socket

    failed, aborted = _counters("mtp_ray:request_failed_total", 'status="500"'), _counters("mtp_ray:request_aborted")
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4}).encode()
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", PORT))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                  b"Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body) + 100).encode() + b"\r\n\r\n"
                  + body)
        time.sleep(0.5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")  # close with a reset
        s.close()
    time.sleep(3.0)  # (a report to the hub)
    assert _counters("mtp_ray:request_failed_total", 'status="500"') == failed
    # (Serve may drop one before it reaches the replica: the replica counts what it saw)
    assert _counters("mtp_ray:request_aborted") >= aborted + 1
    assert post({"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("args,field", [
    ({"engine": {"model": "/nonexistent/model"}}, "engine.model: no config.json"),
    ({"engine": {"parallel": {"dp": 16}}}, "parallel.dp=16 exceeds the model's num_experts=8"),
    ({"engine": {"scheduler": {"max_model_len": 10**7}}}, "scheduler.max_model_len"),
    ({"engine": {"spec": {"draft_vocab_size": 10**6}}}, "spec.draft_vocab_size"),
    ({"engine": {"scheduler": "big"}}, "^scheduler must be a mapping"),
    ({"engine": [1, 2]}, "args.engine must be a mapping"),
    ({"server": "x"}, "args.server must be a mapping"),
])
def test_what_the_model_refuses_fails_the_deploy_not_the_replicas(args, field):
    """Settings the model cannot take are refused by build_app (the deploy), naming the field: they failed only in
    the new group replicas, after Serve had begun to stop the old ones, so a bad `serve deploy` update took a healthy
    app down; a list where a mapping belongs was a TypeError naming nothing."""
    from mtp_ray.serve.app import build_app

    with pytest.raises(ValueError, match=field):
        build_app(args)


@pytest.mark.parametrize("content,error", [('{"top_k": 2.5}', "top_k must be"), ('{"temperature": "hot"}',
                                           "temperature must be a number"), ("{", "not valid JSON")])
def test_sampling_defaults_the_requests_would_fail_on_fail_the_deploy(tmp_path, content, error):
    """server.generation_config's sampling defaults are read and checked by build_app: a bad one would otherwise
    be a 400 for every request that leaves the field out."""
    from mtp_ray.serve.app import build_app

    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=f"server.generation_config .*{error}"):
        build_app({"server": {"generation_config": str(tmp_path)}})
    build_app({"server": {"generation_config": "vllm"}})  # (none read)
