"""Every rank, for real: the ``tiny-tp2`` profile (tensor parallel 2 on the CPU build of vLLM:
two worker processes, a gloo group over loopback TCP, a shared-memory all-reduce) snapshotted
with real CRIU and restored, with nothing set by hand (warmctl binds the ranks' CPUs and picks
CRIU's network lock).

One session snapshot (``tp2_snapshot``) serves every test here but the first three. Order: a
rank killed during the warm-up, a rank stopped during the warm-up, a rank killed while CRIU
dumps (each its own cold start; each next ``snapshot`` in the same home runs: the stop's
reaches its warm-up, the dump kill's its dump, the session snapshot, made next unless another
module made it first, completes, the last test's reaches its dump);
the layout recorded; a rank killed after the restore, before the canary (named, nothing
served, nothing left); the restore serving a chat completion, with ``status`` naming both
ranks; node B restoring it from a directory remote with its own home and key; a rank killed and
the other stopped right before a dump.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from tests.conftest import (WARMCTL, engine_tmp_dirs, listening, ls_row, node_b_env, rank_procs, shm_leaked, shm_names,
                            tp2_env, up_restore, warmctl)

from warmctl.checkpoint.affinity import parse_cpu_list
from warmctl.checkpoint.layout import STOP_GRACE_S, RankError

pytestmark = pytest.mark.e2e

ROLES = ["Worker_TP0", "Worker_TP1"]


@pytest.fixture(scope="module")
def a(wc_env, engine_ports, tp2_snapshot) -> dict[str, str]:
    env = tp2_env(wc_env, *engine_ports)
    yield env
    warmctl("down", "tiny-tp2", env=env, check=False)


def _rank_procs() -> dict[str, list[int]]:
    return rank_procs(ROLES)


def _engine_procs(env) -> list[str]:
    """Live processes of the tiny-tp2 engine of ``env``'s home: any process whose environment
    names its scratch directory (``VLLM_RPC_BASE_PATH``: every engine process has it; other
    engines on the host have their own), as ``pid cmdline``."""
    from warmctl.engine.run import socket_dir

    home = os.fsencode(socket_dir(Path(env["WARMCTL_TEST_HOME"]) / "run" / "tiny-tp2"))
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            environ = open(f"/proc/{p.pid}/environ", "rb").read()
        except OSError:
            continue
        if b"VLLM_RPC_BASE_PATH=" + home in environ:
            out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:80]}")
    return out


def _tp2_entries(env) -> set[str]:
    return {x["digest"] for x in json.loads(warmctl("ls", "--json", env=env).stdout) if x["name"] == "tiny-tp2"}


def _nothing_left(env, engine_ports, shm_before, entries_before) -> None:
    """No engine process, nothing listening on the engine's or the public port, no /dev/shm
    file or socket of the run, no run directory scratch, no new tiny-tp2 snapshot recorded."""
    assert _engine_procs(env) == [], "an engine process was left running"
    assert not listening(engine_ports[0] + 2) and not listening(engine_ports[1])
    assert not (left := shm_leaked(shm_before)), f"left in /dev/shm: {left}"
    assert engine_tmp_dirs(env) == []
    assert _tp2_entries(env) == entries_before
    assert not [s for s in json.loads(warmctl("status", "--json", env=env, check=False).stdout or "[]")
                if s["name"] == "tiny-tp2"]


@pytest.fixture(scope="module")
def fresh(wc_env, engine_ports) -> dict[str, str]:
    """The session's home with the tiny-tp2 profile, before its session snapshot is made."""
    return tp2_env(wc_env, *engine_ports)


def test_a_rank_killed_during_the_warm_up_is_named_and_leaves_nothing(fresh, engine_ports):
    shm_before, entries = shm_names(), _tp2_entries(fresh)
    env = dict(fresh, WARMCTL_TEST_KILL_RANK="warmup:Worker_TP1")  # kill -9 after the grid's first cell
    r = warmctl("snapshot", "tiny-tp2", env=env, check=False, timeout=1500)
    assert r.returncode == RankError.exit_code, r.stderr
    assert "rank Worker_TP1" in r.stderr and "died during the warm-up" in r.stderr, r.stderr
    assert "(Worker_TP1 pid=" in r.stderr  # its own log lines
    err = r.stderr[r.stderr.index("TP2 engine (pid"):]
    assert "rank Worker_TP0" not in err.split("its log lines")[0]  # the killed rank is blamed, not its peer
    _nothing_left(fresh, engine_ports, shm_before, entries)


def test_a_rank_stopped_during_the_warm_up_ends_the_run_within_its_bound(fresh, engine_ports, tmp_path):
    """SIGSTOP of rank 1: rank 0 then waits in the all-reduce for ever and the warm-up's request
    would wait out its 600 s timeout. warmctl names the stopped rank STOP_GRACE_S after it
    stopped and is gone within seconds more (the teardown kills the stopped tree). Its run
    reaching the warm-up shows the next snapshot after a killed one runs."""
    shm_before, entries = shm_names(), _tp2_entries(fresh)
    env = dict(fresh, WARMCTL_TEST_KILL_RANK="warmup:Worker_TP1:STOP")
    seen: list[float] = []

    def watch() -> None:  # when the rank really stopped, seen from outside
        while not seen and proc.poll() is None:
            for pid in _rank_procs().get("Worker_TP1", []):
                try:
                    if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                        seen.append(time.monotonic())
                except psutil.Error:
                    pass
            time.sleep(0.05)

    errf = tmp_path / "stderr"
    with open(errf, "w") as ef:  # a file, not a pipe: the exit is timed, not the last holder of a pipe
        proc = subprocess.Popen([*WARMCTL, "snapshot", "tiny-tp2"], env=env, stdout=subprocess.DEVNULL, stderr=ef)
        t = threading.Thread(target=watch)
        t.start()
        proc.wait(timeout=1500)
        ended = time.monotonic()
    t.join()
    err = errf.read_text()
    assert proc.returncode == RankError.exit_code, err
    assert "rank Worker_TP1" in err and "is stopped (state T)" in err and "during the warm-up" in err, err
    assert seen, "the rank was never seen stopped"
    took = ended - seen[0]
    assert STOP_GRACE_S - 0.5 <= took <= STOP_GRACE_S + 10, f"{took:.1f} s from the stop to warmctl's exit:\n{err}"
    _nothing_left(fresh, engine_ports, shm_before, entries)


def _stored(env) -> set[str]:
    """Every chunk, manifest, signature and catalog object in ``env``'s local store (paths)."""
    root = Path(env["WARMCTL_TEST_HOME"]) / "store"
    return {str(p.relative_to(root)) for kind in ("chunks", "manifests", "signatures", "catalog")
            for p in (root / kind).rglob("*") if p.is_file()}


def test_a_rank_killed_while_criu_dumps_is_named_and_nothing_is_stored(fresh, engine_ports):
    """kill -9 of rank 1 once ``criu dump`` has seized the tree (the hook's ``dump`` point waits
    for CRIU as the ranks' tracer): CRIU fails on the dead task, warmctl names the rank and
    stores nothing; the session snapshot made after it in this home shows the next one works."""
    shm_before, entries, stored = shm_names(), _tp2_entries(fresh), _stored(fresh)
    env = dict(fresh, WARMCTL_TEST_KILL_RANK="dump:Worker_TP1")
    r = warmctl("snapshot", "tiny-tp2", env=env, check=False, timeout=1500)
    assert r.returncode == RankError.exit_code, r.stderr
    assert "rank Worker_TP1 (pid" in r.stderr and "died during the CRIU dump" in r.stderr, r.stderr
    assert "(Worker_TP1 pid=" in r.stderr  # its own log lines
    assert "criu dump of pid" in r.stderr and "failed" in r.stderr  # CRIU's own error after the rank's
    err = r.stderr[r.stderr.index("TP2 engine (pid"):]
    assert "rank Worker_TP0" not in err.split("its log lines")[0]  # the killed rank is blamed, not its peer
    assert "criu_dump" in r.stderr and "secret_scan" not in r.stderr  # it ended in the dump phase
    assert _stored(fresh) == stored  # no chunk, manifest, signature or name written
    _nothing_left(fresh, engine_ports, shm_before, entries)


def _up(env, *args: str, check: bool = True):
    return up_restore(env, "tiny-tp2", *args, check=check)


def _layout(env) -> dict:
    return ls_row(env, "tiny-tp2")


def test_the_snapshot_records_both_ranks_their_cpus_and_the_network_lock(a, tp2_snapshot):
    # made after the two failed snapshots above in the same home: the next snapshot works
    assert "VLLM_CPU_OMP_THREADS_BIND=" in tp2_snapshot["stderr"]  # warmctl's default binding, said
    row = _layout(a)
    lay = row["layout"]
    assert row["digest"] == tp2_snapshot["digest"]
    assert (lay["tp"], lay["pp"], lay["dp"], lay["ep"], lay["world_size"]) == (2, 1, 1, 1, 2)
    assert [r["role"] for r in lay["ranks"]] == ROLES and [r["rank"] for r in lay["ranks"]] == [0, 1]
    assert len({r["nspid"] for r in lay["ranks"]}) == 2 and all(r["nspid"] > 1 for r in lay["ranks"])
    assert lay["cpu_bind_source"] == "default" and lay["cpu_bind"].count("|") == 1
    assert [r["cpus"] for r in lay["ranks"]] == lay["cpu_bind"].split("|")  # each rank on its own CPUs
    assert lay["network_lock"] in ("nftables", "iptables")
    assert row["host"]["rank_cpus"] == {r["role"]: r["cpus"] for r in lay["ranks"]}  # the catalog's ranks rule
    text = warmctl("ls", env=a).stdout
    assert "TP2 (Worker_TP0 ns-pid" in text and "Worker_TP1 ns-pid" in text


def test_a_rank_killed_after_the_restore_is_named_and_nothing_is_served(a, engine_ports):
    shm_before = shm_names()
    env = dict(a, WARMCTL_TEST_KILL_RANK="ranks:Worker_TP1")
    r, _ = _up(env, check=False)
    assert r.returncode == RankError.exit_code, r.stderr
    assert "rank Worker_TP1" in r.stderr and "is not running after the restore" in r.stderr
    assert "(Worker_TP1 pid=" in r.stderr  # its own log lines
    assert not listening(engine_ports[1]) and not listening(engine_ports[0] + 2)
    assert _rank_procs() == {}, "a rank was left running"
    assert not shm_leaked(shm_before)
    st = json.loads(warmctl("status", "--json", env=a, check=False).stdout or "[]")
    assert not [s for s in st if s["name"] == "tiny-tp2" and s["phase"] == "serving"]


def test_up_restores_every_rank_bound_and_serves_through_the_gate(a, engine_ports, tp2_snapshot):
    shm_before = shm_names()
    r, res = _up(a)
    assert res["path"] == "restore" and res["snapshot"] == tp2_snapshot["digest"], r.stderr
    assert "ranks" in res["timings_s"] and "canary" in res["timings_s"]
    [st] = [s for s in json.loads(warmctl("status", "--json", env=a).stdout) if s["name"] == "tiny-tp2"]
    assert st["layout"] == "TP2" and sorted(st["ranks"]) == ROLES and st["healthy"]
    procs = _rank_procs()
    assert procs == {role: [st["ranks"][role]] for role in ROLES}
    lay = _layout(a)["layout"]
    unbound = os.sched_getaffinity(0)
    for rec in lay["ranks"]:  # bound as recorded (CRIU restores no affinity; up put it back)
        pid = st["ranks"][rec["role"]]
        bound = set().union(*[aff for t in os.listdir(f"/proc/{pid}/task")
                              if (aff := os.sched_getaffinity(int(t))) != unbound])
        assert bound == parse_cpu_list(rec["cpus"]), (rec, bound)
    chat = httpx.post(f"http://127.0.0.1:{engine_ports[1]}/v1/chat/completions", timeout=60, json={
        "model": "tiny-tp2", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": "The capital of France is"}]})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"].strip(), chat.text
    table = warmctl("status", env=a).stdout
    assert f"TP2: Worker_TP0 {st['ranks']['Worker_TP0']}, Worker_TP1 {st['ranks']['Worker_TP1']}" in table
    warmctl("down", "tiny-tp2", env=a)
    assert _rank_procs() == {} and not shm_leaked(shm_before)


def test_node_b_restores_the_tp2_snapshot_from_a_directory_remote(a, engine_ports, tp2_snapshot, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2-fleet")
    remote = root / "remote"
    r = warmctl("push", "tiny-tp2", "--to", str(remote), env=a)
    assert f"push tiny-tp2:latest ({tp2_snapshot['digest'][:19]})" in r.stderr
    b = tp2_env(node_b_env(root / "b", a, remote, *engine_ports), *engine_ports)  # its own home and key
    try:
        r, res = _up(b)
        assert res["path"] == "restore" and res["snapshot"] == tp2_snapshot["digest"], r.stderr
        assert res["fetched"]["remote"] > 100 * 2**20, res
        [st] = [s for s in json.loads(warmctl("status", "--json", env=b).stdout) if s["name"] == "tiny-tp2"]
        assert sorted(st["ranks"]) == ROLES and st["healthy"]
        chat = httpx.post(f"http://127.0.0.1:{engine_ports[1]}/v1/completions", timeout=60, json={
            "model": "tiny-tp2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200 and chat.json()["choices"][0]["text"], chat.text
        assert _layout(b)["layout"]["world_size"] == 2  # B's local catalog names it now, layout included
    finally:
        warmctl("down", "tiny-tp2", env=b, check=False)
    assert _rank_procs() == {}


def test_a_rank_killed_and_one_stopped_before_the_dump_are_named_and_nothing_is_stored(a, tp2_snapshot):
    shm_before = shm_names()
    env = dict(a, WARMCTL_TEST_KILL_RANK="before_dump:Worker_TP0,before_dump:Worker_TP1:STOP")
    r = warmctl("snapshot", "tiny-tp2", "--tag", "killed", env=env, check=False, timeout=1500)
    assert r.returncode == RankError.exit_code, r.stderr
    assert "rank Worker_TP0 is not running" in r.stderr and "(Worker_TP0 pid=" in r.stderr
    assert "rank Worker_TP1 (pid" in r.stderr and "is stopped (state T)" in r.stderr, r.stderr
    assert "ranks present: Worker_TP1" in r.stderr
    assert "criu_dump" not in r.stderr  # refused before CRIU (whose dump timeout is 600 s) ran
    assert _rank_procs() == {} and _engine_procs(a) == []
    assert not (left := shm_leaked(shm_before)), f"left in /dev/shm: {left}"  # the survivors' semaphores too
    tags = {(x["name"], x["tag"]) for x in json.loads(warmctl("ls", "--json", env=a).stdout)}
    assert ("tiny-tp2", "killed") not in tags and ("tiny-tp2", "latest") in tags
