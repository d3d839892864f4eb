"""The agent's restart policy (warmctl.agent.supervise): when a restart is submitted, the backoff
between restarts, the limit, ``down`` dropping the policy, and persistence across agents. The
engine's liveness and the job submission are the callables the agent passes in (the real
engine and agent: tests/test_e2e_restart.py)."""

from __future__ import annotations

from warmctl.agent import supervise
from warmctl.agent.supervise import Supervisor


def make(tmp_path, dead: set[str], busy: set[str] | None = None):
    submitted: list[tuple[str, dict]] = []

    def restart(name: str, params: dict) -> str:
        submitted.append((name, params))
        return f"j-{len(submitted):012x}"

    sup = Supervisor(tmp_path / "restart.json", dead=lambda n: n in dead, busy=lambda n: n in (busy or set()),
                     restart=restart)
    return sup, submitted


def test_restart_backoff_and_limit(tmp_path):
    dead: set[str] = set()
    sup, submitted = make(tmp_path, dead)
    sup.watch("tiny", {"tag": "latest", "restart": "on-failure"}, limit=3)
    assert sup.tick(now=1000.0) == [] and submitted == []  # alive: nothing to do
    dead.add("tiny")
    assert sup.tick(now=1001.0) == ["tiny"]  # the first restart goes at once
    assert submitted == [("tiny", {"tag": "latest", "restart": "on-failure"})]
    assert sup.tick(now=1002.0) == []  # backoff: 2 s after the first
    assert sup.tick(now=1003.0) == ["tiny"]
    assert sup.tick(now=1005.0) == []  # then 4 s
    assert sup.tick(now=1007.0) == ["tiny"]
    assert sup.view("tiny", now=1007.0)["restarts"] == 3
    assert sup.tick(now=1100.0) == []  # limit 3 within the window reached: left down
    v = sup.view("tiny")
    assert v["policy"] == "no" and "restart limit 3" in v["gave_up"]
    assert len(submitted) == 3


def test_busy_engines_wait_and_forget_drops_the_policy(tmp_path):
    dead, busy = {"tiny"}, {"tiny"}
    sup, submitted = make(tmp_path, dead, busy)
    sup.watch("tiny", {}, None)
    assert sup.tick(now=1.0) == []  # a job (the up itself, a down) works on it
    busy.clear()
    sup.forget("tiny")  # what a down job does first
    assert sup.tick(now=2.0) == [] and submitted == [] and sup.view("tiny") is None


def test_backoff_resets_after_a_stable_run_and_policies_persist(tmp_path):
    dead = {"tiny"}
    sup, _ = make(tmp_path, dead)
    sup.watch("tiny", {"tag": "v1"}, 5)
    sup.tick(now=0.0)
    sup.tick(now=supervise.BACKOFF_FIRST_S)
    assert sup.policies["tiny"].backoff_s == 2 * supervise.BACKOFF_FIRST_S
    dead.clear()
    sup.tick(now=supervise.STABLE_S + 10)
    assert sup.policies["tiny"].backoff_s == 0.0
    again, submitted = make(tmp_path, {"tiny"})  # a restarted agent reads the policies back
    assert again.policies["tiny"].params == {"tag": "v1"}
    assert again.tick(now=supervise.STABLE_S + 20) == ["tiny"] and submitted[0][1] == {"tag": "v1"}
