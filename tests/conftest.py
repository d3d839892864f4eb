"""Shared fixtures. Tests that need an engine share ONE session-scoped snapshot of ``tiny``.

Environment knobs (for running several suites side by side on one host):
``WARMCTL_TEST_ENGINE_PORT`` (internal engine port, default 18000) and
``WARMCTL_TEST_GATE_PORT`` (public port, default 18080).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WARMCTL = [sys.executable, "-m", "warmctl"]


def warmctl(*args: str, env: dict[str, str], check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the real ``warmctl`` CLI in a subprocess; on ``check`` failure show its output."""
    r = subprocess.run([*WARMCTL, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"warmctl {' '.join(args)} exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
    return r


@pytest.fixture(scope="session")
def engine_ports() -> tuple[int, int]:
    """(internal engine port, public gate port) used by the shared ``tiny`` profile."""
    return (int(os.environ.get("WARMCTL_TEST_ENGINE_PORT", "18000")),
            int(os.environ.get("WARMCTL_TEST_GATE_PORT", "18080")))


@pytest.fixture(scope="session")
def wc_env(tmp_path_factory, engine_ports) -> dict[str, str]:
    """Environment for warmctl subprocesses: a fresh data dir, a config file pointing at it, and
    a ``tiny`` profile with the test ports. Keys: the process env plus ``WARMCTL_CONFIG``;
    ``env["WARMCTL_TEST_HOME"]`` is the data dir."""
    root = tmp_path_factory.mktemp("warmctl")
    home, profiles = root / "home", root / "profiles"
    profiles.mkdir()
    text = (REPO / "profiles" / "tiny.toml").read_text()
    text = re.sub(r"(?m)^port = 18000", f"port = {engine_ports[0]}", text)
    text = re.sub(r"(?m)^port = 8000", f"port = {engine_ports[1]}", text)
    (profiles / "tiny.toml").write_text(text)
    cfg = root / "config.toml"
    cfg.write_text(f'home = "{home}"\nprofile_dirs = ["{profiles}"]\nkeys_dir = "{root / "keys"}"\n')
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("WARMCTL_") and k not in ("WARMCTL_CRIU",):
            env.pop(k)
    env.update({"WARMCTL_CONFIG": str(cfg), "WARMCTL_TEST_HOME": str(home), "PYTHONUNBUFFERED": "1"})
    return env


@pytest.fixture(scope="session")
def tiny_snapshot(wc_env) -> dict:
    """``warmctl snapshot tiny`` run once per session. Returns {"digest", "stdout", "stderr",
    "shm_left"}: ``shm_left`` = /dev/shm names present after the snapshot but not before."""
    shm_before = set(os.listdir("/dev/shm"))
    r = warmctl("snapshot", "tiny", env=wc_env, timeout=1500)
    shm_after = set(os.listdir("/dev/shm"))
    m = re.search(r"tiny:latest\s+(sha256:[0-9a-f]{64})", r.stdout.replace("\n", " "))
    assert m, f"no digest in snapshot output:\n{r.stdout}\n{r.stderr}"
    return {"digest": m.group(1), "stdout": r.stdout, "stderr": r.stderr, "shm_left": shm_after - shm_before}
