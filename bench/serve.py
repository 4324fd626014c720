"""Serving benchmark: what a client of `serve run` sees, next to what the engine group did, in one run.

    python bench/serve.py [--yaml deployments/qwen35_mtp.yaml] [--model bundled|35b|micro] [--layers 4]
                          [--variants dp1k3 dp1k0 dp2k3 dp1k0s5d] [--concurrency 1 16 64 128 256] [--max-tokens 128]
                          [--prompt-tokens 32] [--requests-per-stream 4] [--cold-burst 64]
                          [--out bench/results/serve.json]

Per variant (dp, k; s<ms>: server.stream_interval_ms; a<ms>: server.admission_gap_ms; l: Serve's access log on at
the ingress (off by default: serve/app.py); x: scheduler.split_prefill false (new prompts share a step with the
running decodes: the default for k = 0 on one GPU, not for k > 0); a trailing d: Ray Serve's direct ingress, no proxy
hop) it
starts `serve run` on a YAML made from --yaml (engine overrides: dp, k, and with
--model 35b random weights at the Qwen3.5-35B-A3B shapes cut to --layers layers + the MTP layer, with a byte-level
word tokenizer of the full vocabulary; --model micro: random weights at tiny shapes with the bundled tokenizer,
engine steps of a few ms on a CPU), waits for /health, then:
- cold burst: --cold-burst requests at once right after start (TTFT of a cold server), and the same burst again at
  the end (warm): `cold_over_warm_ttft`;
- per concurrency c: c client streams, each sending requests one after another (POST /v1/completions, stream,
  ignore_eos, return_token_ids) until c x --requests-per-stream are done: request throughput, output tok/s,
  TTFT / TPOT / ITL percentiles (vLLM `bench serve` definitions: TPOT per request after its first token, ITL per
  chunk), tokens per chunk;
- the engine's capacity at that concurrency (CUDA only): before each variant's server starts, bench/decode.py
  times the standalone graph step of full batches of the served shapes (random weights, same run, same GPU), at
  the batch the busiest rank holds (c over the ranks, rounded up) and the mean context of a request (prompt +
  max_tokens / 2). Capacity = c x tokens a row gains per step (1; k > 0: 1 + the accepted drafts per verify this
  level measured) / that step. `client_over_capacity` (client tok/s / capacity) is the figure to read: what the
  clients got of what the engine can do at that batch; `mean_running_batch` (the sequences the group's ranks
  stepped, per step of the group) / c says how full the batches stayed; at c = 1,
  `tpot_over_device_step` is the client's time per token over the standalone step's;
- the engine's own counters over the same level (/admin/health): tokens the ranks produced, their step wall time
  (`step_s`: every step that ran a forward, host work included). `client_over_busy_engine_tok_s` divides by the
  tok/s while the group was busy, not by its capacity: a diagnostic (it hides batches that run half empty);
- with more than one dp among the variants: dp_n / dp_1 output tok/s at the highest concurrency (one request per
  call).

Speed targets are for this benchmark, never for tests (tests/test_bench_serve.py only runs it small on CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# ---- the server ----
def word_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer of `vocab` tokens (" w0" ... ; id 0 the end-of-text token), so that every id a random
    model samples detokenises. Byte-level like Qwen's (ByteLevel pre-tokenizer and decoder): decoding costs what
    Qwen's does (20 tokens in ~4.5 us on the dev CPU; a WordPiece decoder, used before, took 13.5 us and was ~30 %
    of the ingress's time at 128 streams, docs/performance.md)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"\u0120w{i}": i for i in range(vocab)}, unk_token="\u0120w1"))  # \u0120: space
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="\u0120w0", unk_token="\u0120w1").save_pretrained(path)


def model_35b(layers: int, mtp: bool) -> Path:
    from decode import hf_config  # torch and the model code: only when this model is asked for

    path = Path(tempfile.mkdtemp(prefix="serve35b-"))
    cfg = hf_config(layers, mtp=mtp)
    (path / "config.json").write_text(json.dumps(cfg))
    word_tokenizer(path, cfg["vocab_size"])
    return path


def model_micro(mtp: bool) -> Path:
    """Random weights at tiny shapes (2 layers, hidden 64, 4 experts) with the bundled tokenizer: engine steps of
    a few ms on a CPU, so a CPU run measures the front door (proxy, ingress, group), not the engine."""
    from decode import hf_config

    from mtp_ray.config.engine import BUNDLED_MODEL

    path = Path(tempfile.mkdtemp(prefix="serve-micro-"))
    cfg = hf_config(2, mtp=mtp)
    cfg.update(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=1,
               linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
               vocab_size=json.loads((Path(BUNDLED_MODEL) / "config.json").read_text()).get("vocab_size", 2048),
               layer_types=["linear_attention", "full_attention"])
    (path / "config.json").write_text(json.dumps(cfg))
    for f in Path(BUNDLED_MODEL).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(f, path / f.name)
    return path


def variant_yaml(base: dict, dp: int, k: int, model: dict, out: Path, groups: int | None = None,
                 ingress: int | None = None, port: int | None = None,
                 server: dict | None = None, access_log: bool | None = None, mixed: bool = False
                 ) -> tuple[Path, int, str]:
    cfg = json.loads(json.dumps(base))
    if port:
        cfg["http_options"] = {**cfg.get("http_options", {}), "port": port}
    app = cfg["applications"][0]
    if ingress:  # a fixed number of ingress replicas
        app["args"]["ingress"] = {**app["args"].get("ingress", {}), "num_replicas": ingress}
        app["args"]["ingress"].pop("autoscaling_config", None)
    if groups:  # a fixed number of engine groups (no autoscaling): e.g. one group on a one-GPU machine
        app["args"]["group"] = {**app["args"].get("group", {}), "num_replicas": groups}
        app["args"]["group"].pop("autoscaling_config", None)
    if access_log is not None:  # Serve's per-request access log line on the ingress replicas
        ing = app["args"]["ingress"] = dict(app["args"].get("ingress") or {})
        ing["logging_config"] = {**(ing.get("logging_config") or {}), "enable_access_log": access_log}
    if server:  # server settings of this variant (stream interval, admission gap)
        app["args"]["server"] = {**(app["args"].get("server") or {}), **server}
    eng = app["args"]["engine"]
    eng.update(model)
    eng.setdefault("parallel", {})["dp"] = dp
    eng["spec"] = {**eng.get("spec", {}), "num_speculative_tokens": k}
    if mixed:
        eng["scheduler"] = {**eng.get("scheduler", {}), "split_prefill": False}
    if k and "method" not in eng["spec"]:
        eng["spec"]["method"] = "qwen3_5_mtp"
    app["args"]["served_model_name"] = name = app["args"].get("served_model_name") or "model"
    out.write_text(yaml.safe_dump(cfg))
    return out, cfg.get("http_options", {}).get("port", 8000), name


def tool(name: str) -> str:
    """A console script of this Python's environment (or on PATH: a --target install on the GPU host)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


class Server:
    """`serve run` in a process group of its own, with a local Ray cluster of its own (never another one on the
    machine); stopped with SIGTERM to the group, as an operator would, then SIGKILL. direct: Ray Serve's direct
    ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS, experimental in Ray 2.60): the ingress replica serves HTTP on `port`
    itself, no proxy hop (the proxy, started anyway, is moved to port + 100)."""

    def __init__(self, yaml_path: Path, port: int, log: Path, direct: bool = False):
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": "local"}
        if direct:  # the controller allocates replica ports from this minimum: the first ingress replica gets `port`
            env |= {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port)}
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.proc = subprocess.Popen([tool("serve"), "run", str(yaml_path)],
                                     cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    async def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:
            while time.monotonic() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"serve run exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
                try:
                    async with s.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            return time.monotonic() - t0
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(1.0)
        raise TimeoutError(f"server not healthy after {timeout:.0f}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to whatever of the group is left; returns once the port is closed, so that the next
        variant's readiness check cannot be answered by this one's proxy while it winds down."""
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                continue
        host, port = self.url.removeprefix("http://").split(":")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
            except OSError:
                return
            time.sleep(0.5)


# ---- the client ----
async def one_request(s: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: the send time, each chunk's arrival and token count, usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    t0 = time.perf_counter()
    chunks: list[tuple[float, int]] = []
    usage = None
    async with s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"{r.status}: {(await r.text())[:200]}"}
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return {"error": str(ev["error"])[:200]}
            if ev.get("usage") and not ev["choices"]:
                usage = ev["usage"]
            for ch in ev["choices"]:
                n = len(ch.get("token_ids") or [])
                if n:
                    chunks.append((time.perf_counter(), n))
    return {"t0": t0, "chunks": chunks, "usage": usage}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q / 100 * len(xs)))], 3)


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r and r["chunks"]]
    ttft = [1e3 * (r["chunks"][0][0] - r["t0"]) for r in ok]
    tpot, itl, per_chunk = [], [], []
    for r in ok:
        n = sum(c[1] for c in r["chunks"])
        if n > 1:
            tpot.append(1e3 * (r["chunks"][-1][0] - r["chunks"][0][0]) / (n - 1))
        itl += [1e3 * (b[0] - a[0]) for a, b in zip(r["chunks"], r["chunks"][1:])]
        per_chunk += [c[1] for c in r["chunks"]]
    tokens = sum(sum(c[1] for c in r["chunks"]) for r in ok)
    usage_tokens = sum((r["usage"] or {}).get("completion_tokens", 0) for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "errors": [r["error"] for r in results if "error" in r][:5],
        "wall_s": round(wall, 3), "request_throughput": round(len(ok) / wall, 3),
        "output_tokens": tokens, "usage_tokens_match": tokens == usage_tokens,
        "output_tok_s": round(tokens / wall, 1),
        "ttft_ms": {"mean": round(statistics.fmean(ttft), 3) if ttft else None, "p50": pct(ttft, 50),
                    "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
        "tpot_ms": {"mean": round(statistics.fmean(tpot), 3) if tpot else None, "p50": pct(tpot, 50),
                    "p99": pct(tpot, 99)},
        "itl_ms": {"mean": round(statistics.fmean(itl), 3) if itl else None, "p50": pct(itl, 50),
                   "p99": pct(itl, 99)},
        "tokens_per_chunk": round(statistics.fmean(per_chunk), 3) if per_chunk else None,
    }


async def run_level(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                    range_ratio: float = 0.0) -> dict:
    """`concurrency` streams in a closed loop over `prompts` (each stream sends its next request when one ends).
    range_ratio r: each request's max_tokens uniform in [(1 - r), (1 + r)] x max_tokens (seeded; vLLM's random
    dataset --random-range-ratio), so the streams do not all end, and come back, in the same step."""
    rng = random.Random(concurrency)
    lengths = [max(1, round(max_tokens * rng.uniform(1 - range_ratio, 1 + range_ratio))) for _ in prompts]
    todo = list(reversed(list(zip(prompts, lengths))))
    results: list[dict] = []
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as s:
        async def stream() -> None:
            while todo:
                prompt, n = todo.pop()
                results.append(await one_request(s, url, model, prompt, n))

        t0 = time.perf_counter()
        await asyncio.gather(*[stream() for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    return summarize(results, wall)


# ---- the engine's figures ----
async def rank_stats(url: str) -> list[dict]:
    """Every rank's engine counters, asked now (`RankWorker.stats` through GET /admin/health?stats=1)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/admin/health?stats=1") as r:
        return (await r.json())["rank_stats"]


async def engine_counters(url: str) -> list[dict]:
    """Per rank: tokens produced, wall time in waves (`waves_s`: stepping, host work between steps included),
    of steps (`step_s`) and of graph steps, verify counts (tokens per decode step)."""
    keys = ("output_tokens", "step_s", "steps", "waves_s", "graph_step_s", "graph_steps", "verify_steps", "accepted",
            "rows_sum", "work_steps")
    return [{k: r.get(k, 0) for k in keys} for r in await rank_stats(url)]


async def rank_stalls(url: str) -> list[dict]:
    return [r["stalls"] for r in await rank_stats(url)]


def engine_delta(before: list[dict], after: list[dict]) -> dict:
    d = [{k: a[k] - b[k] for k in a} for b, a in zip(before, after)]
    tokens = sum(r["output_tokens"] for r in d)
    # ranks step in lock-step: the busiest rank's time is the group's
    waves, busy = max(r["waves_s"] for r in d), max(r["step_s"] for r in d)
    out = {"output_tokens": tokens, "waves_s": round(waves, 4), "step_s": round(busy, 4),
           "steps": max(r["steps"] for r in d),
           "tok_s": round(tokens / waves, 1) if waves else None,  # while the group ran (what it produced per second)
           "tok_s_in_steps": round(tokens / busy, 1) if busy else None,
           # sequences the group stepped per step (its ranks step together; /admin/health reports one group):
           # every rank's sequences over the group's steps (a step where one rank had work is a step of each)
           "mean_running_batch": round(sum(r["rows_sum"] for r in d) / max(1, max(r["steps"] for r in d)), 2),
           "accepted_per_verify": round(sum(r["accepted"] for r in d) / max(1, sum(r["verify_steps"] for r in d)),
                                        4)}
    r0 = max(d, key=lambda r: r["graph_steps"])
    if r0["graph_steps"]:  # a decode (or verify) graph step's time per token: the engine's own pace at batch 1
        per_step = 1 + (r0["accepted"] / r0["verify_steps"] if r0["verify_steps"] else 0)
        out["graph_step_ms"] = round(1e3 * r0["graph_step_s"] / r0["graph_steps"], 4)
        out["decode_ms_per_token"] = round(out["graph_step_ms"] / per_step, 4)
    return out


TTFT_PARTS = ("ingress_parse_seconds", "ingress_admit_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "time_to_first_token_seconds")


async def histogram_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the TTFT parts' histograms from /metrics, over every series (groups, ranks, replicas)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out = {h: [0.0, 0.0] for h in (*TTFT_PARTS, "group_admit_seconds")}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("mtp_ray:")
        for h in TTFT_PARTS:
            if name in (h + "_sum", h + "_count"):
                out[h][name.endswith("_count")] += float(line.rsplit(" ", 1)[1])
        if name in ("group_admit_seconds_total", "group_admits_total"):  # counters: (seconds, admissions)
            out["group_admit_seconds"][name == "group_admits_total"] += float(line.rsplit(" ", 1)[1])
    return {h: (v[0], v[1]) for h, v in out.items()}


def ttft_parts(before: dict, after: dict) -> dict:
    """Mean ms per request of each TTFT part over a level: the ingress's parse and admission, the rank's queue
    and prefill (add -> first token), and the time to first token the ingress measured from after parsing."""
    out = {}
    for h in (*TTFT_PARTS, "group_admit_seconds"):  # the last: the group's part of ingress_admit
        n = after[h][1] - before[h][1]
        out[h.removesuffix("_seconds")] = round(1e3 * (after[h][0] - before[h][0]) / n, 2) if n else None
    return out


PROCS = {"ingress": "OpenAIIngress", "group": "ServeReplica:.*:EngineGroup", "proxy": "ProxyActor",
         "rank": "RankWorker"}
IDLE = ("wait (threading", "main_loop (ray", "_worker (concurrent", "Thread.run (threading", "select (selectors",
        "_run_router_event_loop", "_run_user_code_event_loop", "run_forever", "_run_once")


def _top(counts: dict[str, int], total: int) -> list:
    return [(round(100 * v / max(total, 1), 1), k[:140]) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:25]]


def profile(seconds: float, out: Path) -> dict:
    """py-spy over the serving processes for `seconds` (runs alongside the load): per process its busy share of
    the samples and the heaviest functions (self and inclusive), idle waits left out."""
    procs = {}
    for name, pat in PROCS.items():
        pids = subprocess.run(["pgrep", "-f", pat], capture_output=True, text=True).stdout.split()
        if pids:
            f = out / f"pyspy_{name}.txt"
            procs[name] = (subprocess.Popen([tool("py-spy"), "record", "-p", pids[0], "-d", str(int(seconds)), "-r",
                                             "250", "-f", "raw", "-o", str(f), "--nonblocking"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), f)
    result = {}
    for name, (p, f) in procs.items():
        _, err = p.communicate(timeout=seconds + 60)
        if not f.exists():
            result[name] = {"error": err.decode()[-300:]}
            continue
        total, busy, own, incl = 0, 0, {}, {}
        for line in f.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = [x for x in stack.split(";") if x and not x.startswith("thread (")]
            total += int(n)
            if not frames or any(i in frames[-1] for i in IDLE):
                continue
            busy += int(n)
            own[frames[-1]] = own.get(frames[-1], 0) + int(n)
            for x in set(frames):
                incl[x] = incl.get(x, 0) + int(n)
        result[name] = {"samples": total, "busy_pct": round(100 * busy / max(total, 1), 1),
                        "self": _top(own, total), "inclusive": _top(incl, total)}
    return result


def save(result: dict, path: str) -> None:
    """The results so far (a device call may run out of time mid-run)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))


def standalone_steps(config: Path, dtype: str, k: int, batches: list[int], context: int, out: Path) -> dict:
    """bench/decode.py's graph steps of full batches at the shapes of `config` (random weights): {"steps": {batch:
    ms}} (k > 0: the fused MTP step, verify + draft loop, as the engine replays it), or {"error": why not}. Run
    while no server holds the GPU."""
    if shutil.which("nvidia-smi") is None:
        return {"error": "no CUDA GPU here: the standalone graph step (bench/decode.py) needs one"}
    if dtype != "bfloat16":
        return {"error": f"engine.dtype is {dtype}: bench/decode.py times bfloat16 steps"}
    bs = [str(b) for b in batches]
    cmd = [sys.executable, str(ROOT / "bench" / "decode.py"), "--config", str(config), "--batches", *bs,
           "--context", str(context), "--mtp-k", str(k), "--mtp-batches", *bs, "--oracle-accept", "--draft-vocab",
           "0", "--kernel-batches", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        return {"error": f"bench/decode.py failed: {(run.stderr or run.stdout)[-800:]}"}
    timed = json.loads(out.read_text())
    steps = {r["batch"]: (r["mtp"][0]["mtp_step_ms"] if k else r["graph_step_ms"]) for r in timed["runs"]}
    return {"steps": steps, "context": context, "device": timed["device"]}


def capacity_figures(level: dict, c: int, ranks: int, k: int, steps: dict) -> dict:
    """A level's figures against the engine's capacity at its concurrency (module docstring)."""
    e = level["engine"]
    out = {"running_batch_over_concurrency": round(e["mean_running_batch"] / c, 3)}
    if "steps" not in steps:
        return {**out, "capacity": steps}
    batch = -(-c // ranks)  # the busiest rank's batch
    step_ms = steps["steps"][batch]
    per_row = 1 + (e["accepted_per_verify"] if k else 0.0)  # tokens a row gains per step
    cap = c * per_row / (step_ms / 1e3)
    out.update(capacity={"batch_per_rank": batch, "step_ms": step_ms, "tokens_per_row_step": round(per_row, 4),
                         "tok_s": round(cap, 1)},
               client_over_capacity=round(level["output_tok_s"] / cap, 3))
    if c == 1 and level["tpot_ms"]["mean"]:
        out["tpot_over_device_step"] = round(level["tpot_ms"]["mean"] / (step_ms / per_row), 3)
    return out


async def run_variant(args, name: str, dp: int, k: int, server_cfg: dict, access_log: bool | None, mixed: bool,
                      direct: bool, model: dict, work: Path, result: dict) -> dict:
    base = yaml.safe_load(Path(args.yaml).read_text())
    client_port = args.port or base.get("http_options", {}).get("port", 8000)
    path, _, served = variant_yaml(base, dp, k, model, work / f"{name}.yaml", args.groups, args.ingress,
                                   client_port + 100 if direct else client_port, server_cfg, access_log, mixed)
    app = yaml.safe_load(path.read_text())["applications"][0]["args"]
    ranks = dp * (args.groups or (app.get("group") or {}).get("num_replicas", 1))  # (autoscaling: its first groups)
    from mtp_ray.config.engine import BUNDLED_MODEL

    steps = await asyncio.to_thread(
        standalone_steps, Path(app["engine"].get("model") or BUNDLED_MODEL) / "config.json",
        app["engine"].get("dtype", "bfloat16"), k, sorted({-(-c // ranks) for c in args.concurrency + args.ranged}),
        args.prompt_tokens + args.max_tokens // 2, work / f"{name}_steps.json")
    server = Server(path, client_port, work / f"{name}.log", direct)
    try:
        up = await server.wait_ready(args.start_timeout)
        url = server.url
        prompt = lambda i: [(7 * i + j) % 2000 + 3 for j in range(args.prompt_tokens)]  # noqa: E731
        out: dict = {"dp": dp, "k": k, "stream_interval_ms": server_cfg.get("stream_interval_ms"),
                     "admission_gap_ms": server_cfg.get("admission_gap_ms"), "direct_ingress": direct,
                     "ingress_access_log": access_log, "split_prefill": False if mixed else None,
                     "server_up_s": round(up, 1), "ranks": ranks, "standalone_steps": steps, "levels": {}}
        result["variants"][name] = out
        burst = [prompt(10_000 + i) for i in range(args.cold_burst)]
        if args.cold_burst:
            before = await rank_stalls(url)
            out["cold_burst"] = await run_level(url, served, burst, args.cold_burst, args.max_tokens)
            # Triton compiles and GC pauses the ranks met during the cold burst (runtime/stalls.py)
            out["cold_burst"]["rank_stalls"] = [
                {"triton_compiles": a["triton_compiles"] - b["triton_compiles"],
                 "triton_compile_s": round(a["triton_compile_s"] - b["triton_compile_s"], 3),
                 "gc_s": round(a["gc_s"] - b["gc_s"], 3), "recent_compiles": a["recent_compiles"][-5:]}
                for b, a in zip(before, await rank_stalls(url))]
            save(result, args.out)
        for c, ratio in [(c, 0.0) for c in args.concurrency] + [(c, args.range_ratio) for c in args.ranged]:
            prompts = [prompt(c * 1000 + i) for i in range(c * args.requests_per_stream)]
            before, hist_before = await engine_counters(url), await histogram_sums(url)
            run = asyncio.ensure_future(run_level(url, served, prompts, c, args.max_tokens, ratio))
            if args.profile_s and c == max(args.concurrency) and not ratio:
                await asyncio.sleep(2.0)
                try:
                    out["profile"] = await asyncio.to_thread(profile, args.profile_s, work)
                except Exception as e:  # no py-spy, or no ptrace here: the figures still count
                    out["profile"] = {"error": f"{type(e).__name__}: {e}"}
            level = await run
            level["engine"] = engine_delta(before, await engine_counters(url))
            await asyncio.sleep(1.5)  # the replicas report their histograms to the metrics hub every second
            level["ttft_parts_ms"] = ttft_parts(hist_before, await histogram_sums(url))
            e = level["engine"]
            level.update(capacity_figures(level, c, ranks, k, steps))
            level["client_over_busy_engine_tok_s"] = (round(level["output_tok_s"] / e["tok_s"], 3) if e["tok_s"]
                                                      else None)  # (a diagnostic: module docstring)
            if c == 1 and level["tpot_ms"]["mean"] and e.get("decode_ms_per_token"):
                level["tpot_over_engine_decode_ms_per_token"] = round(
                    level["tpot_ms"]["mean"] / e["decode_ms_per_token"], 3)
            key = f"{c}" if not ratio else f"{c}@range{ratio:g}"
            out["levels"][key] = level
            save(result, args.out)
            cap = level.get("capacity", {})
            print(f"{name} c={key}: {level['output_tok_s']} tok/s client = x{level.get('client_over_capacity')} "
                  f"the capacity ({cap.get('tok_s', cap.get('error'))}); running batch {e['mean_running_batch']} "
                  f"(x{level['running_batch_over_concurrency']} c); {e['tok_s']} engine while running "
                  f"(x{level['client_over_busy_engine_tok_s']}; {e['tok_s_in_steps']} in steps); TTFT p50 "
                  f"{level['ttft_ms']['p50']} ms, TPOT {level['tpot_ms']['mean']} ms (engine graph step "
                  f"{e.get('graph_step_ms')} ms, {e.get('decode_ms_per_token')} ms/token), "
                  f"{level['tokens_per_chunk']} tokens/chunk; TTFT parts ms {level['ttft_parts_ms']}", flush=True)
        if args.cold_burst:
            out["warm_burst"] = await run_level(url, served, burst, args.cold_burst, args.max_tokens)
            cold, warm = out["cold_burst"]["ttft_ms"]["p50"], out["warm_burst"]["ttft_ms"]["p50"]
            out["cold_over_warm_ttft"] = round(cold / warm, 3) if cold and warm else None
        return out
    finally:
        server.stop()


VARIANT = re.compile(r"dp(\d+)k(\d+)(?:s(\d+(?:\.\d+)?))?(?:a(\d+(?:\.\d+)?))?(l?)(x?)(d?)")


def parse_variant(v: str) -> tuple[int, int, dict, bool | None, bool, bool]:
    """dp<N>k<K>[s<ms>][a<ms>][l][x][d] -> (dp, k, the server overrides: s = server.stream_interval_ms, a =
    server.admission_gap_ms (the YAML's where absent), the ingress's access log (l: on; else None, the YAML's or
    the app's default: off), mixed steps (x: scheduler.split_prefill false), direct ingress)."""
    m = VARIANT.fullmatch(v)
    if m is None:
        raise SystemExit(f"variant {v!r}: expected dp<N>k<K>[s<ms>][a<ms>][l][x][d], e.g. dp1k0s5a20d")
    server = {key: float(x) for key, x in (("stream_interval_ms", m[3]), ("admission_gap_ms", m[4])) if x}
    return int(m[1]), int(m[2]), server, True if m[5] else None, bool(m[6]), bool(m[7])


async def main_async(args) -> dict:
    model: dict = {}
    tmp = None
    if args.model in ("35b", "micro"):
        mtp = any(parse_variant(v)[1] for v in args.variants)
        tmp = model_35b(args.layers, mtp) if args.model == "35b" else model_micro(mtp)
        model = {"model": str(tmp), "load_format": "dummy", "tokenizer": str(tmp)}
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    result = {"machine": machine(), "yaml": args.yaml, "model": args.model if args.model != "35b"
              else f"random Qwen3.5-35B-A3B shapes, {args.layers} layers", "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "requests_per_stream": args.requests_per_stream, "variants": {}}
    try:
        for v in args.variants:
            await run_variant(args, v, *parse_variant(v), model, work, result)
            save(result, args.out)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    top = str(max(args.concurrency))
    by_dp: dict[tuple, dict] = {}
    for r in result["variants"].values():
        key = (r["k"], r["stream_interval_ms"], r.get("admission_gap_ms"), r["direct_ingress"])
        by_dp.setdefault(key, {})[r["dp"]] = r["levels"][top]["output_tok_s"]
    for (k, iv, gap, direct), rows in by_dp.items():
        for dp in sorted(rows):
            if dp > 1 and 1 in rows:
                tag = ("" if iv is None else f"_s{iv:g}") + ("" if gap is None else f"_a{gap:g}") + ("_d" * direct)
                result[f"dp{dp}_over_dp1_k{k}{tag}_c{top}"] = round(rows[dp] / rows[1], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--yaml", default="deployments/qwen35_mtp.yaml")
    ap.add_argument("--model", choices=["bundled", "35b", "micro"], default="bundled")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=["dp1k3", "dp1k0"],
                    help="dp<N>k<K>[s<ms>][a<ms>][d] each: s, a = server.stream_interval_ms, admission_gap_ms (else "
                         "the YAML's); d: Ray Serve's direct ingress")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ranged", type=int, nargs="*", default=[], help="concurrencies run again with --range-ratio")
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--cold-burst", type=int, default=64)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--profile-s", type=float, default=0, help="py-spy the serving processes for this long "
                    "during the highest concurrency level")
    ap.add_argument("--groups", type=int, default=None, help="fixed engine groups (default: the YAML's)")
    ap.add_argument("--port", type=int, default=None, help="HTTP port (default: the YAML's)")
    ap.add_argument("--ingress", type=int, default=None, help="fixed ingress replicas (default: the YAML's)")
    ap.add_argument("--out", default="bench/results/serve.json")
    args = ap.parse_args()
    write_json(asyncio.run(main_async(args)), args.out)


if __name__ == "__main__":
    main()
