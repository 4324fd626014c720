"""A tiny OpenAI legacy-completions mock for testing lm-eval plumbing offline (stdlib only; transformers optional).

POST /v1/completions answers `echo` + `logprobs` like OpenAI/vLLM: choices[i].logprobs = {tokens, token_logprobs,
top_logprobs, text_offset} over the prompt tokens (first entry null) then `max_tokens` generated ones, and vLLM's
`prompt_logprobs` field when asked. The numbers are fake but deterministic: the log-prob of token t after token p is
`fake_logprob(p, t)`, so a document's prompt log-prob sum is the same whichever way it is asked for. Prompts: a
string, a token-id list, or a list of either (one choice per prompt). Every request (method, path, body) is appended,
one JSON a line, to --record. GET /v1/models answers too; anything else is a 404.

  python bench/lm_eval/mock_server.py --port 8011 --record /tmp/req.jsonl [--tokenizer mtp_ray/assets/tiny-qwen35-mtp]
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 2048


def fake_logprob(prev: int, tok: int) -> float:
    return -(0.25 + ((prev * 31 + tok * 17) % 97) / 16.0)


class Mock:
    def __init__(self, model: str, record: str | None, tokenizer: str | None, echo_prompt_only: bool = False):
        self.model, self.record, self.lock = model, record, threading.Lock()
        self.echo_prompt_only = echo_prompt_only
        self.tok = None
        if tokenizer:
            import transformers

            self.tok = transformers.AutoTokenizer.from_pretrained(tokenizer)

    def log(self, path: str, body: dict | None) -> None:
        if self.record:
            with self.lock, open(self.record, "a") as f:
                method = "GET" if body is None else "POST"
                f.write(json.dumps({"method": method, "path": path, "body": body}) + "\n")

    def encode(self, s: str) -> list[int]:
        return self.tok(s, add_special_tokens=False).input_ids if self.tok else list(s.encode())

    def piece(self, t: int) -> str:
        return self.tok.decode([t]) if self.tok else f"<{t}>"

    def choice(self, i: int, ids: list[int], body: dict) -> dict:
        n_gen, echo, n_top = int(body.get("max_tokens", 16) or 0), bool(body.get("echo")), body.get("logprobs")
        gen = []
        for _ in range(n_gen):
            gen.append(((ids + gen)[-1] * 7 + 3) % VOCAB if ids + gen else 1)
        seq, first = (ids + ([] if self.echo_prompt_only else gen), 0) if echo else (gen, len(ids))
        full = ids + gen
        lps = [None if first + k == 0 else fake_logprob(full[first + k - 1], t) for k, t in enumerate(seq)]
        pieces = [self.piece(t) for t in seq]
        out = {"index": i, "text": "".join(pieces), "finish_reason": "length", "logprobs": None}
        if n_top is not None:
            offs, o = [], 0
            for p in pieces:
                offs.append(o)
                o += len(p)
            # the token is the argmax ("greedy") where its id is even, else an alternative beats it by 0.5
            top = [None if lp is None else {p: lp} if t % 2 == 0 else {p: lp, "<alt>": lp + 0.5}
                   for t, p, lp in zip(seq, pieces, lps)]
            out["logprobs"] = {"tokens": pieces, "token_logprobs": lps, "top_logprobs": top, "text_offset": offs}
        if body.get("prompt_logprobs") is not None:  # vLLM's field: per prompt position {id: {logprob, rank, ...}}
            out["prompt_logprobs"] = [None] + [{str(t): {"logprob": fake_logprob(p, t), "rank": 1,
                                                         "decoded_token": self.piece(t)}} for p, t in zip(ids, ids[1:])]
        return out

    def complete(self, body: dict) -> dict:
        p = body["prompt"]
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else p
        ids = [x if isinstance(x, list) else self.encode(x) for x in prompts]
        choices = [self.choice(i, x, body) for i, x in enumerate(ids)]
        n_prompt, n_gen = sum(map(len, ids)), len(ids) * int(body.get("max_tokens", 16) or 0)
        return {"id": "cmpl-mock", "object": "text_completion", "created": 0, "model": body.get("model", self.model),
                "choices": choices,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}}


def handler(mock: Mock):
    class H(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            mock.log(self.path, None)
            if self.path.rstrip("/") == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": mock.model, "object": "model"}]})
            self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            mock.log(self.path, body)
            if self.path.rstrip("/") != "/v1/completions":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            try:
                self._send(200, mock.complete(body))
            except Exception as e:  # noqa: BLE001 - a mock: say what was wrong with the request
                self._send(400, {"error": {"message": repr(e)}})

        def log_message(self, *a):
            pass

    return H


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--model", default="tiny-qwen35-mtp")
    ap.add_argument("--record", default=None, help="append each request body here, one JSON a line")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir for string prompts/token text (else bytes)")
    ap.add_argument("--echo-prompt-only", action="store_true",
                    help="a broken server for negative tests: echo logprobs cover the prompt only, never the generated "
                         "tokens (lm-eval sums token_logprobs[ctxlen:-1], so it then drops each item's last token)")
    a = ap.parse_args()
    srv = ThreadingHTTPServer((a.host, a.port), handler(Mock(a.model, a.record, a.tokenizer, a.echo_prompt_only)))
    print(f"mock listening on http://{a.host}:{a.port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
