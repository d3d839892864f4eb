"""One clock for "is this ours", on any host.

psutil's ``create_time()`` is the start in ticks since boot plus ``/proc/stat``'s boot time,
which the kernel gives in whole seconds: on a host whose boot time has a fraction ``f`` it is
``f`` seconds early, and a wall-clock step moves it. These tests give this host each such
quirk at the boundary where it enters -- psutil's boot-time read (``psutil._pslinux.boot_time``,
what every psutil creation time adds), warmctl's clock reads (:func:`warmctl.base.proc.wall_clock`,
:func:`warmctl.base.proc.boot_clock`) and a file's mtime -- and run the real rule on real processes:
a rule that compared psutil's creation times with wall-clock stamps, or trusted psutil across a
clock step, fails here on every host, not on half of them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from warmctl.base import proc
from warmctl.engine.run import EngineRun
from warmctl.base.proc import CLK_TCK, ProcessId, Stamp, created_during, kill_child, start_ticks
from warmctl.records.state import EngineState

FRACTIONS = [0.0, 0.49, 0.51, 0.99]
STEPS = [5.0, -5.0]


def _true_boot() -> float:
    """The boot instant in Unix seconds, to the microsecond (psutil's is whole seconds)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


@pytest.fixture
def host(monkeypatch):
    """This host made into another: ``host(fraction=f)`` makes psutil's boot time ``f`` s early
    (a host whose boot time's fraction is ``f``); ``host(step=s)`` steps the wall clock by ``s``
    seconds from now on, as NTP or an operator would: ``time.time()`` as warmctl reads it and the
    boot time psutil reads both move (the kernel recomputes ``btime`` from the wall clock);
    ``CLOCK_BOOTTIME`` does not."""
    import psutil._pslinux as pslinux

    real_boot = _true_boot()
    state = {"fraction": 0.0, "step": 0.0}

    def set_(fraction: float | None = None, step: float | None = None) -> None:
        if fraction is not None:
            state["fraction"] = fraction
        if step is not None:
            state["step"] = step

    monkeypatch.setattr(pslinux, "boot_time", lambda: real_boot - state["fraction"] + state["step"])
    monkeypatch.setattr(proc, "wall_clock", lambda: time.time() + state["step"])
    return set_


def _sleeper(**kw) -> subprocess.Popen:
    p = subprocess.Popen(["sleep", "300"], start_new_session=True, **kw)
    deadline = time.monotonic() + 10
    while Path(psutil.Process(p.pid).exe()).name != "sleep":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return p


def _record(run_dir: Path, name: str) -> EngineRun:
    run = EngineRun(run_dir, name, 1).prepare()
    run.record(EngineState(name=name, phase="restoring", source="restore", internal_port=1, public_host="127.0.0.1",
                           public_port=2, served_model_name=name, log_path=str(run.log_path)))
    return run


def _wait_ticks(n: int = 3) -> None:
    time.sleep(n / CLK_TCK)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_injected_boot_fraction_is_what_psutil_reports(host, fraction):
    """The injection itself: psutil's creation time of a process started now is ``fraction``
    seconds early (to a clock tick), as on the host where this was found (0.97 s)."""
    host(fraction=fraction)
    t = time.time()
    p = _sleeper()
    try:
        assert psutil.Process(p.pid).create_time() - t == pytest.approx(-fraction, abs=0.05)
        assert proc.create_time(p.pid) - t == pytest.approx(0.0, abs=0.05)  # warmctl's: no lost fraction
    finally:
        kill_child(p)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_restore_pidfile_process_started_after_the_record_is_ours_whatever_the_boot_fraction(
        host, tmp_path, fraction):
    """The rule of ``restore.pid`` (a restore CRIU finished after the record was written; its
    root never reached the record): killed by the teardown on every boot-time fraction; a
    process started before the record, never."""
    host(fraction=fraction)
    older = _sleeper()
    _wait_ticks()
    run = _record(tmp_path / "run", "r")
    restored = None
    try:
        run.criu_pidfile.write_text(f"{older.pid}\n")
        rep = EngineRun.load(tmp_path / "run", "r").teardown(strays=True)
        assert rep.killed == [] and older.poll() is None
        assert any("not during the restore" in r for r in rep.refused), rep.refused

        run = _record(tmp_path / "run", "r")
        restored = _sleeper()  # what CRIU restored (at once: the tightest case), then it wrote the file
        run.criu_pidfile.write_text(f"{restored.pid}\n")
        rep = EngineRun.load(tmp_path / "run", "r").teardown(strays=True)
        assert rep.killed == [restored.pid], rep.refused
        assert restored.wait(5) is not None and older.poll() is None
    finally:
        for p in (older, restored):
            if p is not None:
                kill_child(p)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("when", ["before the file", "after the file"])
@pytest.mark.parametrize("fraction", [0.0, 0.99])
def test_a_wall_clock_step_after_the_record_changes_nothing(host, tmp_path, step, when, fraction):
    """The wall clock stepped by +-5 s after the record: before CRIU wrote ``restore.pid`` (its
    mtime moved with the clock) or after (the teardown's clocks moved). The restored process is
    still killed; one the record predates is still refused."""
    host(fraction=fraction)
    older = _sleeper()
    _wait_ticks()
    run = _record(tmp_path / "run", "r")
    restored = _sleeper()
    try:
        written = time.time() + (step if when == "before the file" else 0.0)
        run.criu_pidfile.write_text(f"{restored.pid}\n")
        os.utime(run.criu_pidfile, (written, written))  # the kernel stamps mtimes from the wall clock
        host(step=step)
        again = EngineRun.load(tmp_path / "run", "r")
        assert again.alive() is False  # no root recorded: only the pidfile names it
        ident, why = created_during(older.pid, again.state.since, written)
        assert ident is None and "not during the restore" in why
        rep = again.teardown(strays=True)
        assert rep.killed == [restored.pid], rep.refused
        assert restored.wait(5) is not None and older.poll() is None
    finally:
        kill_child(older)
        kill_child(restored)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_recorded_identity_holds_across_boot_fractions_and_clock_steps(host, tmp_path, step, fraction):
    """A recorded root (``engine.pid`` and the record) is still the same process after the boot
    time psutil reads moved by a fraction and a step, and is killed by the teardown; a PID whose
    start differs is refused whatever psutil says."""
    host(fraction=fraction)
    p = _sleeper()
    try:
        run = _record(tmp_path / "run", "e")
        run.set_root(p.pid)
        me = run.root
        host(fraction=0.0 if fraction else 0.99, step=step)
        assert me.alive() and me.mismatch() is None
        reused = ProcessId(p.pid, psutil.Process(p.pid).create_time(), me.exe, start=me.start + 1, boot=me.boot)
        assert "another process now" in reused.mismatch()
        again = EngineRun.load(tmp_path / "run", "e")
        assert again.alive() and again.root == me
        rep = again.teardown(strays=True)
        assert rep.killed == [p.pid] and p.wait(5) is not None
    finally:
        kill_child(p)


def test_the_upper_bound_refuses_a_process_started_after_the_file(host, tmp_path):
    """``restore.pid``'s mtime bounds the start: a process started after it (the restored one
    died, its PID was reused) is refused, by ticks, even with the clocks' offsets differing."""
    p = _sleeper()
    try:
        now = Stamp.now()
        since = Stamp(now.wall - 20, now.boot - 20, now.boot_id)
        ident, why = created_during(p.pid, since, now.wall - 10)
        assert ident is None and "not during the restore" in why
        ident, why = created_during(p.pid, since, now.wall + 1)
        assert ident is not None and why is None and ident.start == start_ticks(p.pid)
        ident, why = created_during(p.pid, Stamp(since.wall, since.boot, "an-earlier-boot"), now.wall + 1)
        assert ident is None and "earlier boot" in why
        # a record from before boot readings were kept: its wall stamp mapped by the offset now
        ident, why = created_during(p.pid, Stamp(now.wall - 1), now.wall + 1)
        assert ident is not None, why
    finally:
        kill_child(p)


def test_a_record_of_an_earlier_boot_names_no_process():
    p = _sleeper()
    try:
        me = ProcessId.of(p.pid)
        assert me.boot == proc.boot_id() and me.alive()
        assert ProcessId(p.pid, me.ctime, me.exe, start=me.start, boot="another-boot").mismatch() == "gone"
        rec = json.loads(json.dumps(me.as_record()))
        assert ProcessId.from_record(rec) == me
        legacy = ProcessId.from_record({"pid": p.pid, "ctime": psutil.Process(p.pid).create_time()})
        assert legacy.start is None and legacy.alive()  # old records: psutil against psutil
    finally:
        kill_child(p)


def test_start_ticks_reads_field_22_past_any_command_name(tmp_path):
    """``/proc/PID/stat``'s second field is the command name in parentheses, which may itself
    hold ``)`` and spaces: the start is counted from after the last ``)``."""
    odd = tmp_path / "a) 1 2 (b"
    shutil.copy(shutil.which("sleep"), odd)
    p = subprocess.Popen([str(odd), "300"], start_new_session=True)
    try:
        time.sleep(0.2)
        s = start_ticks(p.pid)
        pp = psutil.Process(p.pid)
        assert ")" in pp.name() and s is not None
        assert s / CLK_TCK == pytest.approx(pp.create_time() - psutil.boot_time(), abs=1.5 / CLK_TCK)
        assert start_ticks(p.pid) == s  # stored once by the kernel: never wobbles
    finally:
        kill_child(p)
    assert start_ticks(p.pid) is None
