"""The README's first command on a fresh clone, as a new user runs it: install, `serve run` the deployment
YAML, then curl the server. Ends the server with SIGTERM (then SIGKILL of its process group if needed).

The clone's venv sees this session's packages (a .pth naming its site-packages, and its `serve` script), so the
command's pip steps find torch and every dependency installed and only install the clone itself: what the test
proves is the README's commands in order on a fresh clone, the package installed from it (its data, the bundled
model) and `serve run` of the shipped YAML answering curl. Resolving and installing the dependencies from nothing is
what `.ci/run` does itself, with the same pip line, before it runs this suite."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.serve  # (Ray Serve: its own worker and cluster under -n 2, conftest.worker_of)

ROOT = Path(__file__).resolve().parent.parent


def first_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    cmd = blocks[0].strip()
    assert "serve run deployments/qwen35_mtp.yaml" in cmd and "pip install" in cmd
    return cmd


def with_installed_packages(cmd: str) -> str:
    """The command, its fresh venv seeing this interpreter's site-packages (dependencies already installed) and
    holding its `serve` script (pip installs a script only with its package)."""
    venv = "python3 -m venv .venv"
    assert cmd.startswith(venv + " && "), cmd
    site = sysconfig.get_paths()["purelib"]
    serve = Path(sys.executable).parent / "serve"
    link = (f"echo {shlex.quote(site)} > \"$(.venv/bin/python -c 'import sysconfig; "
            f"print(sysconfig.get_paths()[\"purelib\"])')/installed.pth\" && "
            f"printf '#!%s\\n' \"$PWD/.venv/bin/python\" > .venv/bin/serve && "
            f"tail -n +2 {shlex.quote(str(serve))} >> .venv/bin/serve && chmod +x .venv/bin/serve")
    return f"{venv} && {link} && {cmd[len(venv) + 4:]}"


@pytest.mark.ray  # (`serve run`: a Ray cluster of its own)
@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout to clone from")
def test_readme_first_command_then_curl(tmp_path):
    subprocess.run(["git", "clone", "-q", str(ROOT), str(tmp_path / "repo")], check=True)
    repo = tmp_path / "repo"
    log = open(tmp_path / "serve.log", "w")
    # RAY_ADDRESS=local: a cluster of its own, never the test session's
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "RAY_AUTH_MODE")} | {"RAY_ADDRESS": "local"}
    proc = subprocess.Popen(["bash", "-c", with_installed_packages(first_command())], cwd=repo, stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + 900
        ready = False
        while time.time() < deadline and proc.poll() is None:
            try:
                ready = requests.get("http://127.0.0.1:8000/v1/models", timeout=5).status_code == 200
            except requests.RequestException:
                pass
            if ready:
                break
            time.sleep(1)
        assert ready, (tmp_path / "serve.log").read_text()[-3000:]
        body = json.dumps({"model": "tiny-qwen35-mtp", "prompt": "def fib(n):", "max_tokens": 16, "temperature": 0})
        out = subprocess.run(["curl", "-s", "-m", "120", "http://127.0.0.1:8000/v1/completions", "-H",
                              "Content-Type: application/json", "-d", body], capture_output=True, text=True)
        resp = json.loads(out.stdout)
        assert resp["usage"]["completion_tokens"] == 16 and resp["choices"][0]["text"]
        # `serve run`'s console says the server is open (no key in the shipped YAML) and what keeps pages out
        assert "mtp-ray: no API key" in (tmp_path / "serve.log").read_text()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
