"""A DP group across Ray nodes: two raylets on this machine (ray.cluster_utils.Cluster, in a process of its own so
the test session's Ray is untouched), one rank on each, token-identical to dp = 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


KS = (0, 3)


@pytest.fixture(scope="module")
def two_node_runs() -> dict[int, dict]:
    """Both k on one two-node cluster (its start is most of the time): k -> that group's JSON line."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run([sys.executable, str(ROOT / "tests/two_node_group.py"), *map(str, KS)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return {res["k"]: res for res in lines}


@pytest.mark.ray  # (a two-node Ray cluster of its own)
@pytest.mark.slow
@pytest.mark.parametrize("k", KS)
def test_dp2_group_with_one_rank_on_each_of_two_nodes_equals_dp1(two_node_runs, k):
    res = two_node_runs[k]
    assert len(res["cluster_nodes"]) == 2
    assert sorted(res["rank_nodes"]) == res["cluster_nodes"], res  # one rank on each node
    assert res["equal"], res
