"""No silent skips: what cannot be read is reported, not passed over. An
unreadable manifest stays listed by ``ls`` with why; a corrupt ``state.json`` is a clear error
for ``down`` and a warning for ``status``; a failing job callback is logged (a damaged cache
chunk: tests/test_store_cache.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_store_fixtures import snapshot, write_payload

from warmctl.agent.jobs import JobManager
from warmctl.records.config import Settings
from warmctl.base.errors import HostError
from warmctl.pipelines.lifecycle import down, status
from warmctl.records.state import all_states
from warmctl.store import manifest_key, open_store

REPO = Path(__file__).resolve().parent.parent


def _cli(args: list[str], home: Path) -> subprocess.CompletedProcess:
    cfg = home.parent / "cfg.toml"
    cfg.write_text(f'home = "{home}"\nkeys_dir = "{home.parent / "keys"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")}
    env.update(WARMCTL_CONFIG=str(cfg), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "warmctl", *args], env=env, capture_output=True, text=True, timeout=120)


def test_ls_lists_an_entry_whose_manifest_is_unreadable_and_says_why(tmp_path):
    home = tmp_path / "home"
    with open_store(home / "store") as s:
        d = snapshot(s, "tiny", {"a.img": write_payload(tmp_path / "a.img", [("random", 5000)])})
        snapshot(s, "other", {"b.img": write_payload(tmp_path / "b.img", [("random", 6000)], seed=3)})
    (home / "store" / manifest_key(d)).write_bytes(b"{not json")
    r = _cli(["ls"], home)
    assert r.returncode == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("tiny:latest"))
    assert "manifest unreadable" in row and "corrupt" in row, r.stdout
    assert "other:latest" in r.stdout
    assert f"tiny:latest names manifest {d}, which cannot be read" in r.stderr
    j = _cli(["ls", "--json"], home)
    rows = {x["name"]: x for x in json.loads(j.stdout)}
    assert "corrupt" in rows["tiny"]["problem"] and "problem" not in rows["other"]


def test_corrupt_state_json_is_an_error_for_down_and_a_warning_for_status(tmp_path, caplog):
    s = Settings(home=tmp_path / "home", keys_dir=tmp_path / "keys")
    rec = s.run_dir / "tiny" / "state.json"
    rec.parent.mkdir(parents=True)
    rec.write_text('{"name": "tiny", "phase": ')
    with pytest.raises(HostError, match=f"engine record {rec} is unreadable .*remove {rec.parent}"):
        down("tiny", s)
    assert rec.exists()  # nothing guessed, nothing removed
    problems: list[str] = []
    with caplog.at_level(logging.WARNING, logger="warmctl.records.state"):
        assert all_states(s.run_dir, problems) == [] and status(s) == []
    assert len(problems) == 1 and str(rec) in problems[0]
    assert sum(str(rec) in r.getMessage() for r in caplog.records) == 2
    r = _cli(["down", "tiny"], s.home)
    assert r.returncode == HostError.exit_code and "is unreadable" in r.stderr and "Traceback" not in r.stderr, r.stderr
    st = _cli(["status"], s.home)
    assert str(rec) in st.stderr and "Traceback" not in st.stderr, st.stderr


def test_a_failing_job_callback_is_logged(tmp_path, caplog):
    def broken(job):
        raise RuntimeError("metrics exporter is down")

    m = JobManager(tmp_path / "jobs", on_finish=broken)
    with caplog.at_level(logging.ERROR, logger="warmctl.agent"):
        job = m.submit("down", "tiny", ["engine:tiny"], lambda rep, job: {"ok": True})
        done = m.wait(job.id, timeout=30)
        for _ in range(100):  # the callback runs right after the end is recorded
            if any(job.id in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.05)
    assert done is not None and done.state == "succeeded"
    (rec,) = [r for r in caplog.records if job.id in r.getMessage()]
    # exc_info, not exc_text: the handler appends the record before formatting it (which fills
    # exc_text), so the loop above can see it from this thread while the job's thread formats
    assert "on_finish callback" in rec.getMessage()
    assert rec.exc_info and "metrics exporter is down" in str(rec.exc_info[1])
