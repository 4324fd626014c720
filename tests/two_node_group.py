"""Run by tests/test_multinode.py in a process of its own: a local Ray cluster of two nodes (a head and a second
raylet on this machine, each with its own resources), a dp = 2 group placed STRICT_SPREAD (one rank per node),
its greedy outputs against an offline dp = 1 engine, for each MTP k named on the command line (one cluster for
all). Prints one JSON line per k."""

import json
import os
import sys

import ray
from ray.cluster_utils import Cluster

from mtp_ray import LLM, SamplingParams
from mtp_ray.rl.engine import launch_engine

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
PROMPTS = [list(range(10, 10 + n)) for n in (5, 30, 12, 44)]
MAX_TOKENS = [12, 9, 16, 7]


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}})
    cluster.add_node(num_cpus=2, resources={"node_b": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        for k in map(int, sys.argv[1:]):
            check(k)
    finally:
        ray.shutdown()
        cluster.shutdown()


def check(k: int) -> None:
    """One dp = 2 group of MTP k, one rank a node, against dp = 1: one JSON line with k in it."""
    want = [o.outputs[0].token_ids for o in LLM(num_speculative_tokens=k).generate(
        PROMPTS, [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m) for m in MAX_TOKENS])]
    h = launch_engine({"parallel": {"dp": 2, "placement_strategy": "STRICT_SPREAD", "cpus_per_rank": 1},
                       "spec": {"num_speculative_tokens": k}, "timeouts": {"collective_s": 60},
                       "warmup": "forwards"})
    got = ray.get([h.generate.remote(p, {"temperature": 0, "ignore_eos": True, "max_tokens": m})
                   for p, m in zip(PROMPTS, MAX_TOKENS)], timeout=300)
    workers = ray.get(h.worker_handles.remote())
    nodes = ray.get([w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                     for w in workers])
    print(json.dumps({"k": k, "equal": [g["token_ids"] for g in got] == want, "rank_nodes": nodes,
                      "cluster_nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}), flush=True)
    ray.get(h.shutdown.remote())


if __name__ == "__main__":
    main()
