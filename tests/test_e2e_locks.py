"""``up`` of one name started twice at once (a scheduler and the boot unit).
One restores, the other waits for the name's lock and reports what the first did: "already
up" (exit 0) after a success, the first one's error and exit code after a failure, without
trying again; one engine tree either way.

What is tested is warmctl's lock and its reporting, so the engine is the two-process stand-in
``tests/fake_vllm.py`` (``fake_snapshot`` in ``fk_env``), restored by the real CRIU.
"""

from __future__ import annotations

import json
import re
import subprocess

import psutil
import pytest

from tests.conftest import WARMCTL, engine_pids, listening, shm_leaked, shm_names, warmctl
from tests.test_e2e_main import _settings
from warmctl.naming.catalog import Catalog
from warmctl.records.manifest import Manifest
from warmctl.store import open_store

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _down_after(fk_env):
    """Whatever a test leaves up (a failed assertion mid-test), the next one starts clean."""
    yield
    warmctl("down", "fake", env=fk_env, check=False)




def test_two_concurrent_ups_of_one_name_restore_once(fake_snapshot, fk_env):
    """One restores, the other waits for it and reports "already up" with exit 0; one engine tree."""
    shm0 = shm_names()
    procs = [subprocess.Popen([*WARMCTL, "up", "fake", "--json"], env=fk_env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    res = [json.loads(o) for o, _ in outs]
    assert sorted(r["already_up"] for r in res) == [False, True], res
    assert {r["snapshot"] for r in res} == {fake_snapshot["digest"]}
    assert len({r["public"] for r in res}) == 1
    st = json.loads(warmctl("status", "--json", env=fk_env).stdout)
    assert len(st) == 1 and st[0]["healthy"] and st[0]["phase"] == "serving"
    # /dev/shm accounting: the engine's file is counted and is no orphan
    assert st[0]["shm_count"] >= 1 and st[0]["shm_bytes"] > 0
    orphans = {o["path"] for o in json.loads(warmctl("status", "--orphans", "--json", env=fk_env).stdout)}
    assert not orphans & (shm_names() - shm0), orphans
    root = psutil.Process(st[0]["root_pid"])  # one engine tree: every engine process is in it
    pids = engine_pids(fk_env)  # (a process that set its title, the engine core, no longer shows its environment)
    assert root.pid in pids and set(pids) <= {root.pid} | {c.pid for c in root.children(recursive=True)}, pids
    warmctl("down", "fake", env=fk_env)
    assert engine_pids(fk_env) == []
    assert not shm_leaked(shm0)


def test_a_concurrent_up_reports_the_first_ones_failure(fake_snapshot, fk_env, fake_ports):
    """The second ``up`` of a name waits and reports the failure of the first (same exit code),
    without trying again: the altered canary fails once, both exit 3, the port never opens."""
    s = _settings(fk_env)
    store = open_store(s.store_dir)
    data = store.get_manifest(fake_snapshot["digest"]).model_dump(mode="json")
    data["canary"]["completions"][0]["logprobs"][2] += 1e-6
    bad = Manifest.model_validate(data)
    digest = store.put_manifest(bad)
    Catalog(store).publish(digest, bad, tag="tampered2", signer=s.home / "keys" / "local.key")
    shm0 = shm_names()
    try:
        procs = [subprocess.Popen([*WARMCTL, "up", "fake:tampered2"], env=fk_env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=900) for p in procs]
        assert [p.returncode for p in procs] == [3, 3], outs
        text = [" ".join((o + e).split()) for o, e in outs]
        assert all("canary mismatch" in t for t in text)
        assert sum("this one waited for" in t for t in text) == 1, text  # one restore, one report
        assert sum(bool(re.search(r"ok restore\b", t)) for t in text) == 1  # one restore ran
        assert json.loads(warmctl("status", "--json", env=fk_env).stdout) == []
        assert not listening(fake_ports[1]) and engine_pids(fk_env) == []
        assert not shm_leaked(shm0)
    finally:
        Catalog(store).remove("fake", "tampered2", digest)
