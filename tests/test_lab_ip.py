"""make lab-headless listens on 127.0.0.1 unless LAB_IP says otherwise, and says which (issue 41).

``jupyter lab --show-config`` prints the server's resolved settings, the --ip that launch/lab.sh
passed included, and exits without starting a server.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.skipif(not (ROOT / ".venv/bin/jupyter").exists(), reason="no .venv (make setup)"),
    pytest.mark.skipif(sys.platform == "win32", reason="launch/lab.sh is a bash script"),
]


def _lab_config(**env) -> str:
    env = dict(os.environ, HEADLESS="1", LAB_SETUP="0", **env)
    run = subprocess.run(
        ["bash", "launch/lab.sh", "--show-config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout + run.stderr


def test_headless_lab_listens_on_loopback_by_default(monkeypatch):
    monkeypatch.delenv("LAB_IP", raising=False)
    out = _lab_config()
    assert ".ip = '127.0.0.1'" in out
    assert "listening on 127.0.0.1 only" in out and "ssh -L 8888:localhost:8888" in out


def test_headless_lab_listens_on_all_interfaces_when_asked():
    out = _lab_config(LAB_IP="0.0.0.0")
    assert ".ip = '0.0.0.0'" in out
    assert "reachable from the network" in out
