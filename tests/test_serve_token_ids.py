"""A checkpoint without tokenizer files behind the OpenAI server (in-process Serve app): token ids in, token ids
out, equal to the offline engine's greedy output; whatever needs text is a 400 that says why (transformers would
otherwise make an empty tokenizer that encodes every prompt to nothing and decodes every token to "")."""

from __future__ import annotations

import json

import pytest
import requests

from tests.conftest import SERVE_PORT
from tests.helpers import make_checkpoint

pytestmark = pytest.mark.serve  # (Ray Serve: its own worker and cluster under -n 2, conftest.worker_of)

PORT = SERVE_PORT
BASE = f"http://127.0.0.1:{PORT}"
PROMPTS = [[5, 17, 3, 88, 41], [60, 2]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("no_tokenizer")
    make_checkpoint(path, "gqa6_int3", seed=4)
    assert not any(path.glob("tokenizer*")) and not (path / "vocab.json").exists()
    # sampling defaults as Qwen ships them, here top_k 1 (greedy at the default temperature) and 6 new tokens
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "top_k": 1, "max_new_tokens": 6}))
    return path


@pytest.fixture(scope="module")
def server(serve_http, ckpt):
    serve = serve_http

    from mtp_ray.serve.app import build_app

    args = {"served_model_name": ["ids", "ids-alias"],  # (vLLM's several names: any is taken, the first reported)
            "engine": {"model": str(ckpt), "device": "cpu", "warmup": "none",
                       "parallel": {"dp": 1, "cpus_per_rank": 0.2},
                       "spec": {"num_speculative_tokens": 2}, "scheduler": {"max_model_len": 256}},
            "group": {"num_replicas": 1}, "ingress": {"num_replicas": 1}}
    serve.run(build_app(args), name="ids", route_prefix="/")
    yield
    serve.delete("ids")


@pytest.fixture(scope="module")
def reference(ckpt) -> list[list[int]]:
    from mtp_ray import LLM, SamplingParams

    out = LLM(str(ckpt)).generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in out]


def post(body: dict, path: str = "/v1/completions", **kw) -> requests.Response:
    return requests.post(f"{BASE}{path}", json=body, timeout=120, **kw)


def test_token_ids_in_and_out_equal_the_offline_engine(server, reference):
    r = post({"model": "ids", "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
              "logprobs": 1})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == reference
    assert [c["prompt_token_ids"] for c in choices] == PROMPTS
    assert all(c["text"] == "" for c in choices)
    assert choices[0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in reference[0]]


def test_every_served_model_name_is_taken_and_the_first_reported(server, reference):
    """served_model_name as a list (vLLM's --served-model-name a b): /v1/models lists each, a request naming any
    is served and answered with the first; a name of another type fails the build. A list used to reach the
    ingress as the name itself: every name a 404, "model" a list in every response."""
    from mtp_ray.serve.app import build_app

    assert [m["id"] for m in requests.get(f"{BASE}/v1/models", timeout=30).json()["data"]] == ["ids", "ids-alias"]
    assert requests.get(f"{BASE}/v1/models/ids-alias", timeout=30).json()["id"] == "ids-alias"
    r = post({"model": "ids-alias", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["model"] == "ids", r.text
    assert r.json()["choices"][0]["token_ids"] == reference[0]
    assert post({"model": "other", "prompt": PROMPTS[0]}).status_code == 404
    for bad in (2024, ["ids", 3], [""]):
        with pytest.raises(ValueError, match="served_model_name"):
            build_app({"served_model_name": bad, "engine": {"device": "cpu"}})


def test_streamed_token_ids_add_up_to_the_offline_output(server, reference):
    r = post({"model": "ids", "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
              "stream": True}, stream=True)
    assert r.status_code == 200
    got: dict[int, list[int]] = {0: [], 1: []}
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            for c in json.loads(line[6:])["choices"]:
                got[c["index"]] += c["token_ids"]
    assert [got[0], got[1]] == reference


def test_generation_config_sets_the_sampling_defaults_and_caps_max_tokens(server, reference, ckpt):
    """As vLLM (--generation-config auto): a request that leaves temperature / top_k / max_tokens out samples with
    the model's generation_config.json (top_k 1: greedy), whose max_new_tokens also caps a larger max_tokens; a
    field the request sets wins. The offline LLM without sampling_params takes the same defaults."""
    from mtp_ray import LLM, SamplingParams

    for extra in ({}, {"max_tokens": 50}):
        r = post({"model": "ids", "prompt": PROMPTS, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == reference, extra
        assert all(c["finish_reason"] == "length" for c in choices)
    r = post({"model": "ids", "prompt": PROMPTS[0], "ignore_eos": True, "top_k": -1, "temperature": 5, "seed": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] != reference[0]  # sampled: top_k off
    r = post({"model": "ids", "prompt": PROMPTS[0], "min_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    llm = LLM(str(ckpt))
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, max_tokens=6)
    for o, want in zip(llm.generate(PROMPTS), reference):  # greedy, 6 tokens unless an end token came first
        c = o.outputs[0]
        assert c.token_ids == want[: len(c.token_ids)] and (c.finish_reason == "stop" or len(c.token_ids) == 6)
    assert LLM(str(ckpt), generation_config="vllm").get_default_sampling_params() == SamplingParams()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hello"}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], "hello"]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/v1/completions", {"prompt": [1, 2], "stop": ["x"]}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "response_format": {"type": "json_object"}}, "structured_outputs"),
    ("/tokenize", {"prompt": "hi"}, "prompt"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
])
def test_what_needs_text_is_a_clear_400(server, path, body, param):
    r = post({"model": "ids", "max_tokens": 4, **body} if path.startswith("/v1") else body, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "tokenizer" in err["message"], err
