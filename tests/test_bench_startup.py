"""``warmctl bench startup`` on the real tiny profile: one cold start and one restore from the
session's snapshot (a few minutes: the cold start compiles). Runs after test_bench_engine, whose
engine is down by then (both use the same ports)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import warmctl

pytestmark = pytest.mark.e2e


def test_startup_cold_vs_restore(wc_env, tiny_snapshot, tmp_path):
    r = warmctl("bench", "startup", "tiny", "--runs", "1", "-o", str(tmp_path), env=wc_env, timeout=1500)
    d = json.loads((tmp_path / "startup.json").read_text())
    assert d["snapshot"] == tiny_snapshot["digest"]
    (cold,), (rest,) = d["cold"], d["restore"]
    assert cold["error"] is None and rest["error"] is None
    assert cold["path"] == "cold" and rest["path"] == "restore"
    # the cold engine's breakdown comes from vLLM's log; the restore's from up's own phases
    assert {"weights", "torch_compile", "cold_start", "warmup", "gate"} <= set(cold["phases"])
    assert {"materialize", "restore", "health", "canary", "gate"} <= set(rest["phases"])
    assert cold["phases"]["torch_compile"] > 0
    assert cold["first_request_tokens"] == rest["first_request_tokens"] == 16
    for run in (cold, rest):
        assert run["ready_s"] == pytest.approx(run["up_wall_s"] + run["first_request_s"])
        assert run["up_wall_s"] >= sum(v for k, v in run["phases"].items()
                                       if k in ("materialize", "restore", "health", "canary", "gate"))
    assert d["ratio"] == pytest.approx(cold["ready_s"] / rest["ready_s"]) and d["ratio"] > 1
    md = (tmp_path / "startup.md").read_text()
    assert "| CRIU restore |" in md and "faster" in md and md in r.stdout
    # nothing left running
    st = warmctl("status", "tiny", env=wc_env, check=False)
    assert st.returncode == 1 and "no engines" in st.stdout
