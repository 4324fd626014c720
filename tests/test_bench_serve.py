"""bench/serve.py runs as a user runs it (`serve run` of the deployment YAML, HTTP streams, the engine's counters
from /admin/health?stats=1), small, on the CPU. No speed is asserted: speed targets belong to the benchmark."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serve  # (Ray Serve: its own worker and cluster under -n 2, conftest.worker_of)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.ray  # (`serve run`: a Ray cluster of its own)
@pytest.mark.slow
def test_serving_benchmark_smoke(tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "bench/serve.py", "--variants", "dp2k3", "--concurrency", "1", "4", "--ranged", "4",
           "--max-tokens", "12", "--requests-per-stream", "2", "--cold-burst", "4", "--port", "8021", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    v = res["variants"]["dp2k3"]
    assert (v["dp"], v["k"]) == (2, 3)
    assert set(v["levels"]) == {"1", "4", "4@range0.5"}
    for name, level in v["levels"].items():
        assert level["completed"] == level["requests"] and not level["errors"], (name, level)
        assert level["usage_tokens_match"], level  # the tokens counted from the chunks = usage.completion_tokens
        e = level["engine"]
        # every token the clients got, the ranks produced (the counters are the ranks' own, asked live)
        assert e["output_tokens"] == level["output_tokens"] and e["tok_s"] > 0, (name, e)
        assert level["client_over_busy_engine_tok_s"] > 0 and level["ttft_ms"]["p50"] > 0
        # how full the batches stayed: 1 stream -> at most 1 sequence a step on each rank; the capacity needs CUDA
        # graph steps (bench/decode.py), so on a CPU it says why it is missing instead
        assert 0 < e["mean_running_batch"] <= int(name.split("@")[0]), (name, e)
        assert level["running_batch_over_concurrency"] > 0
        assert "tok_s" in level["capacity"] or "needs" in level["capacity"]["error"] \
            or "dtype" in level["capacity"]["error"], level["capacity"]
    assert v["levels"]["1"]["tpot_ms"]["mean"] > 0
    assert len(v["cold_burst"]["rank_stalls"]) == 2 and "triton_compiles" in v["cold_burst"]["rank_stalls"][0]
    assert v["cold_burst"]["completed"] == 4 and v["warm_burst"]["completed"] == 4 and v["cold_over_warm_ttft"] > 0


@pytest.mark.ray
@pytest.mark.slow
def test_serving_benchmark_with_direct_ingress(tmp_path):
    """Variant suffix d: `serve run` with Ray Serve's direct ingress, the client on the ingress replica's own port
    (the proxy moved to port + 100): every stream completes, every token the ranks made reaches the client."""
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "bench/serve.py", "--variants", "dp1k0d", "--concurrency", "1", "4", "--max-tokens", "12",
           "--requests-per-stream", "2", "--cold-burst", "0", "--port", "8023", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    v = json.loads(out.read_text())["variants"]["dp1k0d"]
    assert v["direct_ingress"] and (v["dp"], v["k"]) == (1, 0)
    for name, level in v["levels"].items():
        assert level["completed"] == level["requests"] and not level["errors"], (name, level)
        assert level["usage_tokens_match"] and level["engine"]["output_tokens"] == level["output_tokens"], level


def test_ingress_chunk_benchmark_smoke(tmp_path):
    out = tmp_path / "chunk.json"
    run = subprocess.run([sys.executable, "bench/ingress_chunk.py", "--streams", "1", "3", "--steps", "12", "--out",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["runs"]
    # every stream streamed: a chunk per step (the first and the last may merge with a neighbour)
    assert [r["streams"] for r in rows] == [1, 3] and all(r["events"] >= r["streams"] * 10 for r in rows), rows
