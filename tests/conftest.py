"""Session-wide set-up: one torch thread per process, and one local Ray cluster shared by the Ray tests."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 turns token auth on by default
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

COMPILE_CHECK = os.environ.get("KERNEL_COMPILE_CHECK") if os.environ.get("TRITON_INTERPRET") == "1" else None
if COMPILE_CHECK:  # interpreter launches are recorded and compiled for that GPU target at the end (kernel_check.py)
    from tests import kernel_check

    kernel_check.install()


@pytest.hookimpl(tryfirst=True)  # (before xdist's own hook reads the xdist_group marks)
def pytest_collection_modifyitems(config, items):
    """Lanes (CONTRIBUTING.md): every test that uses the shared Ray cluster, directly or through a fixture, is marked
    `ray`, so `-m "not ray"` runs the tests of one process. Under `-n 2 --dist loadgroup` (the README's test command)
    the two lanes run side by side, each in file order on one worker: the Ray tests on one cluster (two clusters on
    the 2-core machine starved each other's start-up), the tests of one process on the other worker."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
        item.add_marker(pytest.mark.xdist_group("ray" if item.get_closest_marker("ray") else "local"))


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
