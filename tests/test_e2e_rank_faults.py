"""A rank killed or stopped at each point of warmctl's multi-rank pipeline: named, the run
ended within its bound, nothing stored or served, nothing left.

What is tested is warmctl's own orchestration (its rank model, the watch over the warm-up, the
kill during the CRIU dump, the check after a restore, the teardown of a tree with a stopped
rank), so the engine is the fake one at tensor parallel 2 (tests/fake_vllm.py
``--tensor-parallel-size 2``: an engine core and two worker ranks ``VLLM::Worker_TP0``/``_TP1``,
each bound to its own CPUs by warmctl's default binding, joined by loopback TCP and an
"all-reduce" per request, so a stopped rank makes its peers wait for ever), dumped and restored
by the real CRIU under its network lock, in seconds per cold start instead of a vLLM cold
start. The real ``tiny-tp2`` engine's snapshot, restore and fleet pull are
tests/test_e2e_ranks.py's.

One home for the module. Order: a rank killed during the warm-up, a rank stopped during the
warm-up, a rank killed while CRIU dumps (each its own cold start; each next ``snapshot`` in the
same home runs: the stop's reaches its warm-up, the dump kill's its dump, the module's snapshot,
made next, completes and is restored); a rank killed after the restore, before the canary
(named, nothing served, nothing left); a rank killed and the other stopped right before a dump.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from tests.conftest import (WARMCTL, engine_tmp_dirs, fake_env, fake_profile, listening, shm_leaked, shm_names,
                            snapshot_once, up_restore, warmctl)

from warmctl.checkpoint.layout import RANK_TITLE, STOP_GRACE_S, RankError

pytestmark = pytest.mark.e2e

NAME = "fake-tp2"
ROLES = ["Worker_TP0", "Worker_TP1"]
#: MiB of random bytes each worker rank holds (``FAKE_VLLM_RANK_PAD_MIB``): CRIU's dump of a
#: rank then lasts long enough for the ``dump`` kill point's SIGKILL, sent once CRIU has seized
#: the tree, to land before CRIU is done with the rank (with ranks of a few MiB, a loaded host
#: sometimes saw CRIU finish with the rank first: the dump completed and the snapshot was stored).
PAD_MIB = 64
#: Offset of this module's internal and public ports from the session's (the ``fake`` profile's
#: is 6, ``tiny-tp2``'s internal one 2).
PORT_OFFSET = 8


@pytest.fixture(scope="module")
def ports(engine_ports) -> tuple[int, int]:
    return engine_ports[0] + PORT_OFFSET, engine_ports[1] + PORT_OFFSET


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, engine_ports, ports) -> dict[str, str]:
    """A home of its own with the ``fake-tp2`` profile, before its snapshot is made."""
    env = fake_env(tmp_path_factory.mktemp("fake-tp2"), *engine_ports)
    (Path(env["WARMCTL_CONFIG"]).parent / "profiles" / f"{NAME}.toml").write_text(
        fake_profile(*ports, name=NAME, tp=2, extra=f'\n[engine.env]\nFAKE_VLLM_RANK_PAD_MIB = "{PAD_MIB}"\n'))
    yield env
    warmctl("down", NAME, env=env, check=False)


@pytest.fixture(scope="module")
def snap(fresh) -> dict:
    """``warmctl snapshot fake-tp2`` in :func:`fresh`, made after the failed ones before it."""
    return snapshot_once(fresh, NAME)


def _engine_procs(env) -> dict[int, str]:
    """``{pid: cmdline}`` of live processes of the fake-tp2 engine of ``env``'s home: any
    process whose environment names its scratch directory (``VLLM_RPC_BASE_PATH``: every engine
    process has it; other engines on the host have their own), and their descendants (a
    process that sets its title, as the ranks do, may no longer show its environment)."""
    from warmctl.engine.run import socket_dir

    home = os.fsencode(socket_dir(Path(env["WARMCTL_TEST_HOME"]) / "run" / NAME))
    found: set[psutil.Process] = set()
    for p in psutil.process_iter():
        try:
            environ = open(f"/proc/{p.pid}/environ", "rb").read()
            if b"VLLM_RPC_BASE_PATH=" + home in environ:
                found |= {p, *p.children(recursive=True)}
        except (OSError, psutil.Error):
            continue
    out = {}
    for p in found:
        try:
            out[p.pid] = " ".join(p.cmdline())
        except psutil.Error:
            continue
    return out


def _rank_procs(env) -> dict[str, list[int]]:
    """``{role: [pid, ...]}`` of the live rank processes of ``env``'s engine."""
    out: dict[str, list[int]] = {}
    for pid, cmd in _engine_procs(env).items():
        if (m := RANK_TITLE.match(cmd)) and m.group(1) in ROLES:
            out.setdefault(m.group(1), []).append(pid)
    return out


def _leaked(shm_before: set[str]) -> set[str]:
    """:func:`shm_leaked` but another fake engine's files (``fake_vllm_<its name>_*``: a suite
    beside this one on a shared host leaves them between a kill and its next run's cleanup)."""
    return {n for n in shm_leaked(shm_before) if not n.startswith("fake_vllm_") or n.startswith(f"fake_vllm_{NAME}_")}


def _entries(env) -> set[str]:
    return {x["digest"] for x in json.loads(warmctl("ls", "--json", env=env).stdout) if x["name"] == NAME}


def _nothing_left(env, ports, shm_before, entries_before) -> None:
    """No engine process, nothing listening on the engine's or the public port, no /dev/shm
    file or socket of the run, no run directory scratch, no new fake-tp2 snapshot recorded."""
    assert _engine_procs(env) == {}, "an engine process was left running"
    assert not listening(ports[0]) and not listening(ports[1])
    assert not (left := _leaked(shm_before)), f"left in /dev/shm: {left}"
    assert engine_tmp_dirs(env) == []
    assert _entries(env) == entries_before
    assert not [s for s in json.loads(warmctl("status", "--json", env=env, check=False).stdout or "[]")
                if s["name"] == NAME]


def test_a_rank_killed_during_the_warm_up_is_named_and_leaves_nothing(fresh, ports):
    shm_before, entries = shm_names(), _entries(fresh)
    env = dict(fresh, WARMCTL_TEST_KILL_RANK="warmup:Worker_TP1")  # kill -9 after the grid's first cell
    r = warmctl("snapshot", NAME, env=env, check=False, timeout=300)
    assert r.returncode == RankError.exit_code, r.stderr
    assert "rank Worker_TP1" in r.stderr and "died during the warm-up" in r.stderr, r.stderr
    assert "(Worker_TP1 pid=" in r.stderr  # its own log lines
    err = r.stderr[r.stderr.index("TP2 engine (pid"):]
    assert "rank Worker_TP0" not in err.split("its log lines")[0]  # the killed rank is blamed, not its peer
    _nothing_left(fresh, ports, shm_before, entries)


def test_a_rank_stopped_during_the_warm_up_ends_the_run_within_its_bound(fresh, ports, tmp_path):
    """SIGSTOP of rank 1: rank 0 then waits in the all-reduce for ever and the warm-up's request
    would wait out its 600 s timeout. warmctl names the stopped rank STOP_GRACE_S after it
    stopped and is gone within seconds more (the teardown kills the stopped tree). Its run
    reaching the warm-up shows the next snapshot after a killed one runs."""
    shm_before, entries = shm_names(), _entries(fresh)
    env = dict(fresh, WARMCTL_TEST_KILL_RANK="warmup:Worker_TP1:STOP")
    seen: list[float] = []

    def watch() -> None:  # when the rank really stopped, seen from outside
        while not seen and proc.poll() is None:
            for pid in _rank_procs(fresh).get("Worker_TP1", []):
                try:
                    if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                        seen.append(time.monotonic())
                except psutil.Error:
                    pass
            time.sleep(0.05)

    errf = tmp_path / "stderr"
    with open(errf, "w") as ef:  # a file, not a pipe: the exit is timed, not the last holder of a pipe
        proc = subprocess.Popen([*WARMCTL, "snapshot", NAME], env=env, stdout=subprocess.DEVNULL, stderr=ef)
        t = threading.Thread(target=watch)
        t.start()
        proc.wait(timeout=300)
        ended = time.monotonic()
    t.join()
    err = errf.read_text()
    assert proc.returncode == RankError.exit_code, err
    assert "rank Worker_TP1" in err and "is stopped (state T)" in err and "during the warm-up" in err, err
    assert seen, "the rank was never seen stopped"
    took = ended - seen[0]
    assert STOP_GRACE_S - 0.5 <= took <= STOP_GRACE_S + 10, f"{took:.1f} s from the stop to warmctl's exit:\n{err}"
    _nothing_left(fresh, ports, shm_before, entries)


def _stored(env) -> set[str]:
    """Every chunk, manifest, signature and catalog object in ``env``'s local store (paths)."""
    root = Path(env["WARMCTL_TEST_HOME"]) / "store"
    return {str(p.relative_to(root)) for kind in ("chunks", "manifests", "signatures", "catalog")
            for p in (root / kind).rglob("*") if p.is_file()}


def test_a_rank_killed_while_criu_dumps_is_named_and_nothing_is_stored(fresh, ports):
    """kill -9 of rank 1 once ``criu dump`` has seized the tree (the hook's ``dump`` point waits
    for CRIU as the ranks' tracer): CRIU fails on the dead task, warmctl names the rank and
    stores nothing; the module's snapshot made after it in this home shows the next one works."""
    shm_before, entries, stored = shm_names(), _entries(fresh), _stored(fresh)
    env = dict(fresh, WARMCTL_TEST_KILL_RANK="dump:Worker_TP1")
    r = warmctl("snapshot", NAME, env=env, check=False, timeout=300)
    assert r.returncode == RankError.exit_code, r.stderr
    assert "rank Worker_TP1 (pid" in r.stderr and "died during the CRIU dump" in r.stderr, r.stderr
    assert "(Worker_TP1 pid=" in r.stderr  # its own log lines
    # CRIU's own error after the rank's; or, the kill having landed while CRIU collected the
    # tree, CRIU's success with the rank dumped as a zombie, which warmctl refuses
    assert "criu dump of pid" in r.stderr and ("failed" in r.stderr or "stored it as a dead process" in r.stderr)
    err = r.stderr[r.stderr.index("TP2 engine (pid"):]
    assert "rank Worker_TP0" not in err.split("its log lines")[0]  # the killed rank is blamed, not its peer
    assert "criu_dump" in r.stderr and "secret_scan" not in r.stderr  # it ended in the dump phase
    assert _stored(fresh) == stored  # no chunk, manifest, signature or name written
    _nothing_left(fresh, ports, shm_before, entries)


def test_the_next_snapshot_records_both_ranks_and_its_restore_serves(fresh, ports, snap):
    # made after the three failed snapshots above in the same home: the next snapshot works
    [row] = [x for x in json.loads(warmctl("ls", "--json", env=fresh).stdout) if x["name"] == NAME]
    lay = row["layout"]
    assert row["digest"] == snap["digest"] and lay["world_size"] == 2
    assert [r["role"] for r in lay["ranks"]] == ROLES and lay["cpu_bind_source"] == "default"
    assert [r["cpus"] for r in lay["ranks"]] == lay["cpu_bind"].split("|")  # each rank on its own CPUs
    shm_before = shm_names()
    r, res = up_restore(fresh, NAME)
    assert res["path"] == "restore" and res["snapshot"] == snap["digest"], r.stderr
    [st] = [s for s in json.loads(warmctl("status", "--json", env=fresh).stdout) if s["name"] == NAME]
    assert sorted(st["ranks"]) == ROLES and st["healthy"]
    assert _rank_procs(fresh) == {role: [st["ranks"][role]] for role in ROLES}
    warmctl("down", NAME, env=fresh)
    assert _engine_procs(fresh) == {} and not _leaked(shm_before)


def test_a_rank_killed_after_the_restore_is_named_and_nothing_is_served(fresh, ports, snap):
    shm_before = shm_names()
    env = dict(fresh, WARMCTL_TEST_KILL_RANK="ranks:Worker_TP1")
    r, _ = up_restore(env, NAME, check=False)
    assert r.returncode == RankError.exit_code, r.stderr
    assert "rank Worker_TP1" in r.stderr and "is not running after the restore" in r.stderr
    assert "(Worker_TP1 pid=" in r.stderr  # its own log lines
    assert not listening(ports[1]) and not listening(ports[0])
    assert _engine_procs(fresh) == {}, "an engine process was left running"
    assert not _leaked(shm_before)
    st = json.loads(warmctl("status", "--json", env=fresh, check=False).stdout or "[]")
    assert not [s for s in st if s["name"] == NAME and s["phase"] == "serving"]


def test_a_rank_killed_and_one_stopped_before_the_dump_are_named_and_nothing_is_stored(fresh, snap):
    shm_before = shm_names()
    env = dict(fresh, WARMCTL_TEST_KILL_RANK="before_dump:Worker_TP0,before_dump:Worker_TP1:STOP")
    r = warmctl("snapshot", NAME, "--tag", "killed", env=env, check=False, timeout=300)
    assert r.returncode == RankError.exit_code, r.stderr
    assert "rank Worker_TP0 is not running" in r.stderr and "(Worker_TP0 pid=" in r.stderr
    assert "rank Worker_TP1 (pid" in r.stderr and "is stopped (state T)" in r.stderr, r.stderr
    assert "ranks present: Worker_TP1" in r.stderr
    assert "criu_dump" not in r.stderr  # refused before CRIU (whose dump timeout is 600 s) ran
    assert _engine_procs(fresh) == {}
    assert not (left := _leaked(shm_before)), f"left in /dev/shm: {left}"  # the survivors' files too
    tags = {(x["name"], x["tag"]) for x in json.loads(warmctl("ls", "--json", env=fresh).stdout)}
    assert (NAME, "killed") not in tags and (NAME, "latest") in tags
