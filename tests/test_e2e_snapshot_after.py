"""A failed ``up --snapshot-after`` leaves the engine serving, end to end through the CLI and
an agent, with the real CRIU and store.

What is tested is warmctl's own orchestration (the order of ``up``'s phases, where the error
is reported, what is left named and running), so the engine is the fake one
(tests/fake_vllm.py, ``fake_env``: a cold start in about a second). One cold start of
``fake`` on a fresh home whose ``keys`` (where the home's signing key is generated on first
use) is a file: the engine starts, warms up, records its canary, is dumped
with CRIU while left running, its files are stored, and the ``publish`` phase fails. ``up``
goes through an agent (``agent_url``), so one run shows the error in each place it is reported:
the agent job's result, ``up --json``'s result and its stderr line, ``status`` (text and JSON);
the engine keeps serving on its public port (a completion answers), nothing is named in the
catalog, and after ``down`` no process or ``/dev/shm`` file of it is left."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import engine_tmp_dirs, fake_env, listening, shm_leaked, shm_names, warmctl
from tests.test_agent_e2e import Agent, _engine_procs

from warmctl.naming.catalog import Catalog
from warmctl.store import open_store

pytestmark = pytest.mark.e2e


def test_a_failed_snapshot_after_leaves_the_engine_serving_and_says_why(tmp_path, engine_ports, fake_ports):
    env = fake_env(tmp_path, *engine_ports)
    home = Path(env["WARMCTL_TEST_HOME"])
    home.mkdir(parents=True)
    (home / "keys").write_text("not a directory\n")  # the home's signing key cannot be made: publish fails
    (tmp_path / "keys").mkdir()
    shm0 = shm_names()
    agent = Agent(env)
    try:
        cli = dict(env, WARMCTL_AGENT_URL=agent.url)
        r = warmctl("up", "fake", "--snapshot-after", "--json", env=cli, timeout=1500, check=False)
        assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        assert "Traceback" not in r.stderr, r.stderr
        res = json.loads(r.stdout)
        err = res["snapshot_error"]
        assert res["source"] == "cold" and res["snapshot"] is None, res
        assert err and str(home / "keys") in err and "fake keeps serving" in err, err
        assert "nothing of it is named in the catalog" in err and "\n" not in err, err
        assert f"error: {err}" in r.stderr, r.stderr
        # the agent job's result says the same
        [job] = [j for j in agent.http.get("/v1/jobs", params={"limit": 500}).json() if j["kind"] == "up"]
        assert job["state"] == "succeeded" and job["result"]["snapshot_error"] == err, job
        # the engine serves on its public port, as the canary recorded it
        assert listening(fake_ports[1])
        c = httpx.post(f"http://127.0.0.1:{fake_ports[1]}/v1/completions", timeout=120,
                       json={"model": "fake", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert c.status_code == 200 and c.json()["choices"][0]["text"], c.text
        # status, through the agent and on this host, names the failure
        for e in (cli, env):
            [row] = json.loads(warmctl("status", "--json", env=e).stdout)
            assert row["phase"] == "serving" and row["healthy"] and row["snapshot_error"] == err, row
        s = warmctl("status", env=env)
        assert f"engine fake: {err}" in s.stderr, s.stderr
        # nothing half-published is named
        assert json.loads(warmctl("ls", "--json", env=env).stdout) == []
        with open_store(home / "store") as st:
            assert Catalog(st).names() == [] and len(st.list_manifests()) == 1  # stored, not named: gc's
    finally:
        warmctl("down", "fake", env=env, check=False)
        agent.stop()
    left = _engine_procs(home)
    for p in left:
        p.kill()
    assert left == [], left
    assert not listening(fake_ports[1])
    # /dev/shm files only: the engine's sockets are in its run's own directory, gone with it (a
    # socket another program leaves in the shared temp dir meanwhile is not this engine's)
    assert {n for n in shm_leaked(shm0) if not n.startswith("tmp:")} == set()
    assert engine_tmp_dirs(env) == []
