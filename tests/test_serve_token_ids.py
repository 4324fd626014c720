"""A checkpoint without tokenizer files behind the OpenAI server (in-process Serve app): token ids in, token ids
out, equal to the offline engine's greedy output; whatever needs text is a 400 that says why (transformers would
otherwise make an empty tokenizer that encodes every prompt to nothing and decodes every token to "")."""

from __future__ import annotations

import json

import pytest
import requests

from tests.helpers import make_checkpoint

PORT = 8016
BASE = f"http://127.0.0.1:{PORT}"
PROMPTS = [[5, 17, 3, 88, 41], [60, 2]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("no_tokenizer")
    make_checkpoint(path, "gqa6_int3", seed=4)
    assert not any(path.glob("tokenizer*")) and not (path / "vocab.json").exists()
    return path


@pytest.fixture(scope="module")
def server(ray_cluster, ckpt):
    from ray import serve

    from mtp_ray.serve.app import build_app

    args = {"served_model_name": "ids",
            "engine": {"model": str(ckpt), "device": "cpu", "parallel": {"dp": 1, "cpus_per_rank": 0.2},
                       "spec": {"num_speculative_tokens": 2}, "scheduler": {"max_model_len": 256}},
            "group": {"num_replicas": 1}, "ingress": {"num_replicas": 1}}
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(args), name="ids", route_prefix="/")
    yield
    serve.delete("ids")
    serve.shutdown()


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
