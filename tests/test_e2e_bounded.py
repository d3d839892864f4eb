"""Bounded waits of ``snapshot`` where a peer stalls, through the real pipeline with the
two-process stand-in engine (tests/fake_vllm.py) and the real CRIU:

- a rank that stays alive but stops answering during the warm-up (the fake engine core hangs on
  ``SIGUSR2``, sent by the rank fault hook after the grid's first cell: state S, no CPU time) is
  named within ``rank_silence_s`` instead of the request's 600 s timeout (exit 39, RankError);
- a ``criu dump`` past ``dump_timeout_s`` is killed (exit 44, DumpTimeout naming the phase).

Each ends with nothing left: no engine process, no ``/dev/shm`` file, no run scratch, nothing
named in the catalog, and the store still verifies.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import engine_tmp_dirs, listening, procs_under, shm_leaked, shm_names, warmctl
from tests.test_e2e_crash import _ours

pytestmark = pytest.mark.e2e


def _nothing_left(env, engine_port, shm0, tag):
    assert _ours(env) == [] and not listening(engine_port)
    assert procs_under(Path(env["WARMCTL_TEST_HOME"]) / "run") == []  # nor a process CRIU forked
    assert not shm_leaked(shm0), shm_leaked(shm0)
    assert engine_tmp_dirs(env) == []
    assert tag not in warmctl("ls", env=env).stdout  # nothing named
    r = warmctl("verify", env=env, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_silent_rank_during_the_warmup_is_named_within_its_bound(fk_env, fake_ports):
    shm0 = shm_names()
    env = {**fk_env, "WARMCTL_TEST_KILL_RANK": "warmup:EngineCore:USR2", "WARMCTL_RANK_SILENCE_S": "2"}
    t0 = time.monotonic()
    r = warmctl("snapshot", "fake", "--tag", "silent", env=env, check=False, timeout=300)
    took = time.monotonic() - t0
    assert r.returncode == 39, (r.returncode, r.stdout, r.stderr)
    msg = " ".join(r.stderr.split())
    assert "rank EngineCore (pid" in msg and "is alive (state S) but silent: it used no CPU time for 2." in msg, msg
    assert "during the warm-up" in msg and "rank_silence_s = 2 s" in msg and "Traceback" not in msg, msg
    assert "engine core: SIGUSR2, hanging" in msg  # its log lines
    assert took < 60, took  # a cold start of the stand-in, a cell, 2 s of silence: not the 600 s request timeout
    _nothing_left(fk_env, fake_ports[0], shm0, "silent")


def test_a_dump_past_its_bound_is_killed_and_nothing_is_stored(fk_env, fake_ports):
    shm0 = shm_names()
    env = {**fk_env, "WARMCTL_DUMP_TIMEOUT_S": "0.05"}
    r = warmctl("snapshot", "fake", "--tag", "stalled", env=env, check=False, timeout=300)
    assert r.returncode == 44, (r.returncode, r.stdout, r.stderr)
    msg = " ".join(r.stderr.split())
    assert "the criu_dump phase stalled: criu dump of pid" in msg and "bound of 0.05 s: killed after" in msg, msg
    assert "dump_timeout_s" in msg and "Traceback" not in msg, msg
    _nothing_left(fk_env, fake_ports[0], shm0, "stalled")
    cfg = warmctl("config", "show", "--json", env=env).stdout
    assert '"dump_timeout_s"' in cfg and '"rank_silence_s"' in cfg
