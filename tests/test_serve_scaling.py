"""Serve autoscaling adds and removes whole engine groups (CPU, small bundles); cluster.yaml passes Ray's checks."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.conftest import SERVE_PORT

pytestmark = pytest.mark.serve  # (Ray Serve: its own worker and cluster under -n 2, conftest.worker_of)

ROOT = Path(__file__).resolve().parent.parent
PORT = SERVE_PORT


def running_groups(serve, app: str) -> int:
    st = serve.status().applications[app].deployments["EngineGroup"]
    return st.replica_states.get("RUNNING", 0)


def rank_actor_steps(ray) -> dict[str, int]:
    """group id -> steps run by its rank 0 (rank actors are named mtp_ray_rank_<group>_e<epoch>_r<rank>)."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("mtp_ray_rank_") and a["name"].endswith("_r0"):
            try:
                h = ray.get_actor(a["name"], namespace=a["namespace"])
                out[a["name"].split("_")[3]] = ray.get(h.stats.remote(), timeout=10)["steps"]
            except Exception:
                continue  # a group going away
    return out


@pytest.mark.slow
def test_autoscaling_adds_and_removes_whole_groups(ray_cluster, serve_http):
    serve = serve_http

    from mtp_ray.serve.app import build_app

    args = {
        "served_model_name": "tiny",
        # dp = 2 groups: each replica is a whole group of two ranks (issue 25: not only groups of one)
        "engine": {"device": "cpu", "warmup": "none", "parallel": {"dp": 2, "cpus_per_rank": 0.2},
                   "spec": {"num_speculative_tokens": 1}, "scheduler": {"max_model_len": 1024}},
        "group": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                                         "upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_period_s": 11}},
        "ingress": {"num_replicas": 1},
    }
    serve.run(build_app(args), name="autoscale", route_prefix="/")
    stop = threading.Event()
    errors: list[str] = []

    def load() -> None:
        while not stop.is_set():
            r = requests.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": "def f(", "max_tokens": 120, "ignore_eos": True})
            if r.status_code != 200:
                errors.append(r.text)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(8)]
    try:
        assert running_groups(serve, "autoscale") == 1
        for t in threads:
            t.start()
        deadline = time.time() + 120
        while running_groups(serve, "autoscale") < 2 and time.time() < deadline:
            time.sleep(1)
        assert running_groups(serve, "autoscale") == 2
        # both groups serve: each one's rank 0 keeps stepping under the load
        first, waited = rank_actor_steps(ray_cluster), time.time() + 8
        while True:  # (until both have stepped, at most 8 s)
            time.sleep(1)
            second = rank_actor_steps(ray_cluster)
            busy = [g for g in second if second[g] > first.get(g, 0)]
            if len(busy) == 2 or time.time() > waited:
                break
        assert len(busy) == 2, (first, second)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert not errors, errors[:3]
    deadline = time.time() + 120
    while running_groups(serve, "autoscale") > 1 and time.time() < deadline:
        time.sleep(1)
    assert running_groups(serve, "autoscale") == 1
    r = requests.post(f"http://127.0.0.1:{PORT}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
    assert r.status_code == 200
    serve.delete("autoscale")


def test_cluster_yaml_passes_ray_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    types = prepared["available_node_types"]
    assert types["gpu_worker"]["max_workers"] > types["gpu_worker"]["min_workers"] >= 0
    assert any("serve deploy deployments/qwen35_gpu.yaml" in c for c in prepared["head_start_ray_commands"])
    # safe defaults: dashboard (job submission runs code) on loopback, Ray's token authentication not turned off
    cmds = " ".join(prepared["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in cmds and "RAY_AUTH_MODE=disabled" not in cmds


def test_gpu_profile_yaml_is_a_valid_engine_config():
    from mtp_ray.config.engine import EngineConfig

    spec = yaml.safe_load((ROOT / "deployments" / "qwen35_gpu.yaml").read_text())["applications"][0]
    cfg = EngineConfig.from_dict(spec["args"]["engine"])
    assert cfg.device == "cuda" and cfg.parallel.dp == 2 and cfg.spec.k == 3
    full = yaml.safe_load((ROOT / "deployments" / "qwen35_gpu.yaml").read_text())
    assert full["http_options"]["host"] == "127.0.0.1"  # loopback unless the operator opens it


def test_group_policy_scales_on_the_groups_requests_not_serve_calls():
    """One admission call carries a burst of requests: the policy reads the groups' own count of requests in flight
    (GroupDeployment.record_autoscaling_stats), Serve's default policy otherwise unchanged."""
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from mtp_ray.serve.app import build_app
    from mtp_ray.serve.cluster.scaling import POLICY, REQUESTS_IN_FLIGHT, group_policy, with_group_policy

    did = DeploymentID(name="EngineGroup", app_name="a")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=did) for i in range(2)]
    cfg = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=4, upscale_delay_s=0,
                            downscale_delay_s=0)

    def decide(metrics: dict) -> float:
        ctx = AutoscalingContext(
            deployment_id=did, deployment_name="EngineGroup", app_name="a", current_num_replicas=2,
            target_num_replicas=2, running_replicas=replicas, total_num_requests=2.0, total_queued_requests=1.0,
            aggregated_metrics=metrics, raw_metrics=None, capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=8, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
            current_time=time.time(), config=cfg)
        return group_policy(ctx)[0]

    # 2 calls open (+1 queued at the handles) but 23 + 8 requests in flight: (31 + 1) / 4 groups
    assert decide({REQUESTS_IN_FLIGHT: {replicas[0]: 23.0, replicas[1]: 8.0}}) == 8
    assert decide({}) < 2  # no report yet (a new replica): Serve's own count
    opts = with_group_policy({"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}})
    assert opts["autoscaling_config"]["policy"] == {"policy_function": POLICY}
    mine = {"autoscaling_config": {"max_replicas": 2, "policy": {"policy_function": "x:y"}}}
    assert with_group_policy(mine) == mine and with_group_policy({"num_replicas": 2}) == {"num_replicas": 2}
    app = build_app({"engine": {"device": "cpu"}, "group": {"autoscaling_config": {"max_replicas": 2}}})
    group = app._bound_deployment.init_args[0]._bound_deployment  # (the ingress is bound to the group)
    assert group.name == "EngineGroup" and group._deployment_config.autoscaling_config.policy.policy_function == POLICY
