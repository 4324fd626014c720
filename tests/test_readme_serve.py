"""The README's first command on a fresh clone, as a new user runs it: install, `serve run` the deployment
YAML, then curl the server. Ends the server with SIGTERM (then SIGKILL of its process group if needed)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent


def first_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    cmd = blocks[0].strip()
    assert "serve run deployments/qwen35_mtp.yaml" in cmd and "pip install" in cmd
    return cmd


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout to clone from")
def test_readme_first_command_then_curl(tmp_path):
    subprocess.run(["git", "clone", "-q", str(ROOT), str(tmp_path / "repo")], check=True)
    repo = tmp_path / "repo"
    log = open(tmp_path / "serve.log", "w")
    # RAY_ADDRESS=local: a cluster of its own, never the test session's
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "RAY_AUTH_MODE")} | {"RAY_ADDRESS": "local"}
    proc = subprocess.Popen(["bash", "-c", first_command()], cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
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
            time.sleep(3)
        assert ready, (tmp_path / "serve.log").read_text()[-3000:]
        body = json.dumps({"model": "tiny-qwen35-mtp", "prompt": "def fib(n):", "max_tokens": 16, "temperature": 0})
        out = subprocess.run(["curl", "-s", "-m", "120", "http://127.0.0.1:8000/v1/completions", "-H",
                              "Content-Type: application/json", "-d", body], capture_output=True, text=True)
        resp = json.loads(out.stdout)
        assert resp["usage"]["completion_tokens"] == 16 and resp["choices"][0]["text"]
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
