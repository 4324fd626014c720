"""A DP group across Ray nodes: two raylets on this machine (ray.cluster_utils.Cluster, in a process of its own so
the test session's Ray is untouched), one rank on each, token-identical to dp = 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.ray  # (a two-node Ray cluster of its own)
@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 3])
def test_dp2_group_with_one_rank_on_each_of_two_nodes_equals_dp1(k):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run([sys.executable, str(ROOT / "tests/two_node_group.py"), str(k)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(res["cluster_nodes"]) == 2
    assert sorted(res["rank_nodes"]) == res["cluster_nodes"], res  # one rank on each node
    assert res["equal"], res
