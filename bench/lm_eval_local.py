"""lm-evaluation-harness `local-completions` against a running server, checked against the server's own log-probs.

1. Runs `lm_eval` (a subprocess) with the two local tasks under bench/lm_eval/tasks (pycode_mc: multiple_choice;
   pycode_ppl: loglikelihood_rolling) against BASE_URL/v1/completions, token-id prompts, with --log_samples.
2. Re-asks the server itself, one POST /v1/completions per item, tokenised the way lm-eval does it:
   - rolling: prompt = [prefix_token_id] + tok(text) (prefix = custom_prefix_token_id, else the tokenizer's BOS, else
     its EOS: id 0 `<|endoftext|>` for the bundled model), echo, logprobs 0, temperature 0; the document's
     log-likelihood is sum(token_logprobs[1 : 1 + len(tok(text))]) (every document is one window: checked);
   - multiple choice: context/continuation split as lm-eval's `_encode_pair` (trailing context spaces move to the
     continuation; whole = tok(ctx + cont), ctx_ids = tok(ctx), cont_ids = whole[len(ctx_ids):]); the choice's
     log-likelihood is sum(token_logprobs[len(ctx_ids) : len(whole)]).
   The slices are explicit, so a server that leaves out the generated token (lm-eval sums token_logprobs[ctxlen:-1]
   and so silently drops the last prompt token then) shows up as a mismatch.
   With --prompt-logprobs, also asks vLLM's `prompt_logprobs: 0` and sums those per-position entries.
3. Compares with lm-eval's logged per-sample log-likelihoods (|diff| <= --tol) and writes --out JSON: the tasks'
   metrics, every comparison, the max |diff|, lm-eval's version and the command. Exits 1 on a mismatch, 2 when
   lm_eval itself fails.

Needs lm-eval in some venv (`python3 -m venv /tmp/lmeval-venv && /tmp/lmeval-venv/bin/pip install lm-eval==0.4.13
transformers tenacity`; no torch needed) and `transformers` in the python running this script.

  python bench/lm_eval_local.py --lm-eval /tmp/lmeval-venv/bin/lm_eval [--base-url http://127.0.0.1:8000]
  # offline plumbing test: python bench/lm_eval/mock_server.py --port 8011 --tokenizer mtp_ray/assets/tiny-qwen35-mtp &
  #   python bench/lm_eval_local.py --lm-eval /tmp/lmeval-venv/bin/lm_eval --base-url http://127.0.0.1:8011
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS_DIR = ROOT / "bench" / "lm_eval" / "tasks"
TASKS = ("pycode_mc", "pycode_ppl")


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_lm_eval(a, out_dir: str) -> tuple[list[str], str]:
    model_args = ",".join([
        f"model={a.model}", f"base_url={a.base_url.rstrip('/')}/v1/completions", "tokenizer_backend=huggingface",
        f"tokenizer={a.tokenizer}", "tokenized_requests=True", f"max_length={a.max_length}",
        f"num_concurrent={a.num_concurrent}", "max_retries=1", f"timeout={int(a.timeout)}"])
    cmd = [a.lm_eval, "--model", "local-completions", "--model_args", model_args, "--include_path", str(TASKS_DIR),
           "--tasks", ",".join(TASKS), "--output_path", out_dir, "--log_samples", "--seed", "1234"]
    if a.limit:
        cmd += ["--limit", str(a.limit)]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if shutil.which(a.lm_eval) is None:
        sys.exit(f"no lm_eval executable {a.lm_eval!r}: give --lm-eval (see this script's --help for an install)")
    print("+", shlex.join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-8000:])
        print(f"lm_eval failed (exit {p.returncode})", file=sys.stderr)
        sys.exit(2)
    return cmd, p.stdout


def one(path_glob: str) -> str:
    hits = sorted(glob.glob(path_glob, recursive=True))
    if not hits:
        sys.exit(f"lm_eval wrote no {path_glob}")
    return hits[-1]


def echo_sum(a, ids: list[int], lo: int, hi: int) -> float:
    """sum of token_logprobs[lo:hi] of the echoed prompt `ids` (one choice, one prompt)."""
    body = {"model": a.model, "prompt": ids, "max_tokens": a.max_tokens, "echo": True, "logprobs": 0,
            "temperature": 0}
    lp = post(a.url, body, a.timeout)["choices"][0]["logprobs"]["token_logprobs"]
    if len(lp) < len(ids) or lp[0] is not None:
        raise SystemExit(f"echo answered {len(lp)} token_logprobs (first {lp[0]!r}) for a {len(ids)}-token prompt: "
                         f"want one per prompt token (then the generated ones), the first null")
    return float(sum(lp[lo:hi]))


def prompt_logprobs_sum(a, ids: list[int], lo: int, hi: int) -> float:
    """The same sum from vLLM's `prompt_logprobs` (entries {id: {logprob, ...}} or {id: logprob}, first null)."""
    body = {"model": a.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    pl = post(a.url, body, a.timeout)["choices"][0]["prompt_logprobs"]
    tot = 0.0
    for i in range(lo, hi):
        e = pl[i][str(ids[i])] if str(ids[i]) in pl[i] else pl[i][ids[i]]
        tot += e["logprob"] if isinstance(e, dict) else e
    return tot


def engine_sums(model: str, checks: list[dict]) -> None:
    """The offline engine's prompt log-probs of every item, summed over its scored span (one batch)."""
    from mtp_ray import LLM, SamplingParams

    llm = LLM(model, device="cpu")
    outs = llm.generate([c["ids"] for c in checks], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    for c, o in zip(checks, outs, strict=True):
        lo, hi = c["span"]
        c["engine_prompt_logprobs"] = float(sum(o.prompt_logprobs[i][t].logprob for i, t in enumerate(c["ids"])
                                                if lo <= i < hi))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="tiny-qwen35-mtp")
    ap.add_argument("--tokenizer", default=str(ROOT / "mtp_ray" / "assets" / "tiny-qwen35-mtp"))
    ap.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lm_eval_local.json"))
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--max-length", type=int, default=2048, help="lm-eval's max_length model arg")
    ap.add_argument("--num-concurrent", type=int, default=1, help="lm-eval's num_concurrent model arg")
    ap.add_argument("--max-tokens", type=int, default=1, choices=(0, 1), help="max_tokens of the direct echo asks")
    ap.add_argument("--prompt-logprobs", action="store_true", help="also check vLLM's prompt_logprobs field")
    ap.add_argument("--engine", default=None, metavar="MODEL_DIR",
                    help="also score every item with an offline engine (mtp_ray.LLM) of this model: lm-eval's "
                         "log-likelihood must equal the sum of the engine's own prompt log-probs")
    ap.add_argument("--limit", type=int, default=0, help="lm-eval --limit (items per task); 0: all")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--output-path", default=None, help="keep lm-eval's output here (default: a temp dir)")
    a = ap.parse_args()
    a.url = f"{a.base_url.rstrip('/')}/v1/completions"
    a.tokenizer = str(Path(a.tokenizer).resolve())

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(a.tokenizer)
    # lm-eval's TemplateAPI.prefix_token_id (huggingface backend, no custom_prefix_token_id): BOS, else EOS
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    def enc(s: str) -> list[int]:  # TemplateAPI.tok_encode: add_special_tokens=False (add_bos_token unset)
        return tok(s, add_special_tokens=False).input_ids

    out_dir = a.output_path or tempfile.mkdtemp(prefix="lm_eval_local_")
    t0 = time.time()
    cmd, stdout = run_lm_eval(a, out_dir)
    lm_eval_s = time.time() - t0
    results = json.load(open(one(f"{out_dir}/**/results_*.json")))
    metrics = {t: {k.split(",")[0]: v for k, v in results["results"][t].items() if "," in k and "stderr" not in k}
               for t in TASKS}

    checks = []
    max_seq = a.max_length - 2  # lm-eval: self.max_length = max_length - 1; rolling windows of self.max_length - 1
    for line in open(one(f"{out_dir}/**/samples_pycode_ppl_*.jsonl")):
        s = json.loads(line)
        text = s["doc"]["text"]
        ids = enc(text)
        if len(ids) > max_seq:
            sys.exit(f"pycode_ppl doc {s['doc_id']}: {len(ids)} tokens > {max_seq}: more than one rolling window")
        c = {"task": "pycode_ppl", "doc_id": s["doc_id"], "n_tokens": len(ids), "ids": [prefix] + ids,
             "span": [1, 1 + len(ids)],
             "lm_eval": float(s["resps"][0][0]), "server_echo": echo_sum(a, [prefix] + ids, 1, 1 + len(ids))}
        if a.prompt_logprobs:
            c["server_prompt_logprobs"] = prompt_logprobs_sum(a, [prefix] + ids, 1, 1 + len(ids))
        checks.append(c)
    for line in open(one(f"{out_dir}/**/samples_pycode_mc_*.jsonl")):
        s = json.loads(line)
        for i, (args, resp) in enumerate(zip(s["arguments"].values(), s["resps"], strict=True)):
            ctx, cont = args["arg_0"], args["arg_1"]
            n_sp = len(ctx) - len(ctx.rstrip())  # TemplateLM._encode_pair
            if n_sp:
                ctx, cont = ctx[:-n_sp], ctx[-n_sp:] + cont
            whole, ctx_ids = enc(ctx + cont), enc(ctx)
            c = {"task": "pycode_mc", "doc_id": s["doc_id"], "choice": i, "n_ctx": len(ctx_ids), "ids": whole,
                 "span": [len(ctx_ids), len(whole)],
                 "n_cont": len(whole) - len(ctx_ids), "lm_eval": float(resp[0][0]),
                 "server_echo": echo_sum(a, whole, len(ctx_ids), len(whole))}
            if a.prompt_logprobs:
                c["server_prompt_logprobs"] = prompt_logprobs_sum(a, whole, len(ctx_ids), len(whole))
            checks.append(c)
    if a.engine:
        engine_sums(a.engine, checks)
    for c in checks:
        c["abs_diff"] = max(abs(c["lm_eval"] - c[k]) for k in ("server_echo", "server_prompt_logprobs",
                                                                "engine_prompt_logprobs") if k in c)
    max_diff = max(c["abs_diff"] for c in checks)
    bad = [c for c in checks if not c["abs_diff"] <= a.tol]

    out = {"ok": not bad, "max_abs_diff": max_diff, "tol": a.tol, "n_checked": len(checks), "n_mismatch": len(bad),
           "lm_eval_version": results.get("lm_eval_version"),
           "transformers_version": results.get("transformers_version"),
           "base_url": a.base_url, "model": a.model, "tokenizer": a.tokenizer, "prefix_token_id": prefix,
           "direct_ask": {"echo": True, "logprobs": 0, "max_tokens": a.max_tokens, "temperature": 0,
                          "prompt_logprobs": 0 if a.prompt_logprobs else None},
           "command": shlex.join(cmd), "lm_eval_seconds": round(lm_eval_s, 2), "metrics": metrics,
           "comparison": checks}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(stdout[stdout.rfind("|  Tasks"):] if "|  Tasks" in stdout else "")
    print(f"{len(checks)} log-likelihoods compared, max |diff| {max_diff:.3g} (tol {a.tol}); "
          f"{len(bad)} mismatched -> {a.out}")
    for c in bad[:10]:
        print("MISMATCH", json.dumps(c), file=sys.stderr)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
