"""Session-wide set-up: one torch thread per process, and one local Ray cluster shared by the Ray tests."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 turns token auth on by default
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray's log monitor globs the session's log folder ten times a second while it holds under 1,000 files; with the
# hundreds of worker logs a run leaves it took ~11 CPU-s a cluster (the 2-core CI machine is CPU-bound): here it
# looks for new files every 5 s (no test reads worker output through the driver: log_to_driver=False)
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")
torch.set_num_threads(1)

COMPILE_CHECK = os.environ.get("KERNEL_COMPILE_CHECK") if os.environ.get("TRITON_INTERPRET") == "1" else None
if COMPILE_CHECK:  # interpreter launches are recorded and compiled for that GPU target at the end (kernel_check.py)
    from tests import kernel_check

    kernel_check.install()


def pytest_collection_modifyitems(config, items):
    """Lanes (CONTRIBUTING.md): every test that uses the shared Ray cluster, directly or through a fixture, is marked
    `ray`, so `-m "not ray"` runs the tests of one process."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


ROOT = Path(__file__).resolve().parent.parent


SERVE_MARK = "\npytestmark = pytest.mark.serve"  # the module mark that puts a file on the Serve worker


@functools.cache
def _file_worker(path: str) -> str:
    return "serve" if SERVE_MARK in (ROOT / path).read_text() else "engine"


def worker_of(nodeid: str) -> str:
    """The xdist scope of a test under `-n 2 --dist loadscope`: the files whose module is marked `serve` (they start
    Ray Serve) on one worker, every other file (groups on Ray, the tests of one process) on the other. Each worker
    starts its own cluster (the session's ray_cluster), so Serve's apps, ports and named actors never meet the group
    tests'; measured on the 2-core machine, the two halves take about as long (CONTRIBUTING.md, lanes). By file,
    from its text (each read once): xdist's controller sees node ids only, and pytest 9 ignores the node-id rewrite
    xdist's own loadgroup relies on."""
    return _file_worker(nodeid.split("::", 1)[0])


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook)
def pytest_xdist_make_scheduler(config, log):
    """`-n 2 --dist loadscope` (the README's test command): two scopes (worker_of), each run in file order on a
    worker of its own."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_of(nodeid)

    return LaneScheduling(config, log)


def pytest_sessionfinish(session, exitstatus):
    if COMPILE_CHECK:
        lines = kernel_check.compile_all(COMPILE_CHECK)
        print("\nkernel compile check:", *lines, sep="\n  ")
        if any(not line.startswith("compiled") for line in lines):
            session.exitstatus = 1


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # logical CPUs: rank actors take one bundle CPU each; the machine itself may have only 2 cores
    ray.init(num_cpus=12, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield ray
    ray.shutdown()


SERVE_PORT = 8014  # the session's Serve proxy (serve_http); README's `serve run` takes 8000, bench/serve.py 8021 / 8023


@pytest.fixture(scope="session")
def serve_http(ray_cluster):
    """Ray Serve on 127.0.0.1:SERVE_PORT, started once for the session's Serve files (they run on one worker and
    its cluster under -n 2; each module deploys its apps and deletes them): a start and a shutdown per module cost
    ~7 CPU-s (controller and proxy processes) and ~8 s on the 2-core machine."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    yield serve
    serve.shutdown()
