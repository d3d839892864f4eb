"""``up`` with lazy pages, end to end: real CRIU (``criu lazy-pages`` + ``criu restore
--lazy-pages``), the real vLLM CPU engine on ``tiny``, the real gate. Reuses the session snapshot
(``tiny_snapshot``); each test brings the engine up from it and down again.
"""

from __future__ import annotations

import json
import time

import httpx
import psutil
import pytest

from tests.conftest import listening, shm_leaked, shm_names, wait_until, warmctl
from warmctl.checkpoint import criu
from warmctl.base.proc import ProcessId

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _lazy_host(wc_env):
    if not criu.uffd_supported(criu.check()):
        pytest.fail("criu check --feature uffd-noncoop fails on this host: lazy restore cannot be tested here")
    yield
    warmctl("down", "tiny", env=wc_env, check=False)


def _status(env) -> dict:
    rows = json.loads(warmctl("status", "tiny", "--json", env=env, check=False).stdout or "[]")
    return rows[0] if rows else {}


def _daemon(row: dict) -> ProcessId | None:
    # with its start ticks and boot id, as warmctl judges it (without them psutil's create_time
    # decides, early by the host's boot-time fraction: a live daemon read as gone on such hosts)
    return ProcessId.recorded(row.get("lazy_pid"), row.get("lazy_ctime"), row.get("lazy_exe"), row.get("lazy_cmdline"),
                              row.get("lazy_start"), row.get("boot_id"))


def _canary(env) -> tuple[str, int]:
    from warmctl.naming.catalog import Catalog
    from warmctl.records.config import load_settings
    from warmctl.store import open_store
    import os

    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]
    try:
        store = open_store(load_settings().store_dir)
        m = store.get_manifest(Catalog(store).newest("tiny"))
    finally:
        del os.environ["WARMCTL_CONFIG"]
    c = m.canary.completions[0]
    return c.prompt, c.token_ids[0]


def _first_token(port: int, prompt: str) -> int:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"][0]


def _no_criu_of(run_dir: str) -> list[int]:
    """PIDs of CRIU processes whose command line names this test's run directory."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "criu" in cmd and run_dir in cmd:
            out.append(p.pid)
    return out


def test_lazy_up_serves_the_canary_token_and_leaves_nothing(tiny_snapshot, wc_env, engine_ports):
    shm_before = shm_names()
    warmctl("up", "tiny", "--restore-pages", "lazy", env=wc_env)
    row = _status(wc_env)
    assert row["restore_pages"] == "lazy" and row["lazy_pid"], row
    daemon = _daemon(row)
    prompt, token = _canary(wc_env)
    assert _first_token(engine_ports[1], prompt) == token  # through the gate's public port
    # the background copy ends, the daemon exits with every page copied, the engine keeps serving
    assert wait_until(lambda: not daemon.alive(), 180), "the lazy-pages daemon did not finish its copy"
    time.sleep(0.5)
    row = _status(wc_env)
    assert row["lazy_copy"] == "done" and not row["failure"] and row["gate_alive"] and row["engine_alive"], row
    run_dir = f"{wc_env['WARMCTL_TEST_HOME']}/run/tiny"
    assert criu.lazy_log_status(__import__("pathlib").Path(run_dir) / "lazy-pages.log").complete
    assert _first_token(engine_ports[1], prompt) == token
    warmctl("down", "tiny", env=wc_env)
    assert not listening(engine_ports[1]) and not daemon.alive()
    assert _no_criu_of(run_dir) == []
    assert shm_leaked(shm_before) == set()


def test_killing_the_daemon_after_up_is_judged_by_its_log(tiny_snapshot, wc_env, engine_ports):
    """SIGKILL the lazy-pages daemon the moment the public port opens (``up`` is still
    returning; the background copy usually runs 1-4 s longer). Whether its copy had ended by
    then depends on the host's speed, so the test asserts the gate's reaction matches the
    daemon's log: copy incomplete -> public port closed, open connection cut, engine killed,
    status names why; complete -> still serving."""
    import subprocess
    from pathlib import Path

    from tests.conftest import WARMCTL

    shm_before = shm_names()
    run_dir = Path(wc_env["WARMCTL_TEST_HOME"]) / "run" / "tiny"
    up = subprocess.Popen([*WARMCTL, "up", "tiny", "--restore-pages", "lazy"], env=wc_env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: listening(engine_ports[1]) or up.poll() is not None, 600)
        d = json.loads((run_dir / "lazy-pages.pid").read_text())
        daemon = ProcessId.from_record(d)  # with its start ticks, as warmctl judges it (see _daemon)
        killed = daemon.alive() and psutil.Process(daemon.pid).kill() is None
        out, err = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode in (0, 36), f"up exited {up.returncode}:\n{out}\n{err}"
    assert wait_until(lambda: not daemon.alive(), 10)
    complete = criu.lazy_log_status(run_dir / "lazy-pages.log").complete
    print(f"daemon killed while running: {killed}; its log shows the copy complete: {complete}")
    if up.returncode == 36:  # the gate refused to open: the daemon died before `up` handed over
        assert not complete and "LazyPagesError" not in err and "copied every page" in err
        assert not listening(engine_ports[1]) and _status(wc_env) == {}
    elif complete:
        time.sleep(2)
        assert listening(engine_ports[1])
        prompt, token = _canary(wc_env)
        assert _first_token(engine_ports[1], prompt) == token
    else:
        assert wait_until(lambda: not listening(engine_ports[1]), 30), "the public port stayed open"
        row = _status(wc_env)
        assert wait_until(lambda: not _status(wc_env).get("engine_alive"), 30), "the engine is still running"
        row = _status(wc_env)
        assert "before it had copied every page" in row["failure"], row
        assert "failed" in warmctl("status", "tiny", env=wc_env, check=False).stdout
    warmctl("down", "tiny", env=wc_env)
    assert _no_criu_of(str(run_dir)) == []
    assert shm_leaked(shm_before) == set()
