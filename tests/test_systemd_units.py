"""The shipped systemd units keep what was found to work under a real systemd (a
Debian 12 systemd-nspawn root, ../shared/tools/systemd-root.sh; results in docs/operations.md):
warmctl-up@ is a Type=notify unit around ``up --foreground`` that systemd restarts on failure,
and neither unit withholds what CRIU's restore needs (CAP_SYS_TIME for the time namespace)."""

from __future__ import annotations

from pathlib import Path

SYSTEMD = Path(__file__).resolve().parent.parent / "systemd"


def service(name: str) -> dict[str, str]:
    """``[Service]`` settings of unit ``name`` (the last value of a repeated key)."""
    out, section = {}, None
    for line in (SYSTEMD / name).read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v
    return out


def test_up_unit_is_notify_and_restarts_on_failure():
    s = service("warmctl-up@.service")
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    assert s["ExecStart"].endswith(" up %i --foreground")
    assert s["Restart"] == "on-failure" and "WatchdogSec" in s and s["KillMode"] == "mixed"
    assert "ExecStop" not in s and "RemainAfterExit" not in s  # SIGTERM to the supervisor takes it down
    assert "CapabilityBoundingSet" not in s and s.get("ProtectClock", "no") == "no"


def test_agent_unit_leaves_criu_the_clock_capability():
    s = service("warmctl-agent.service")
    if "CapabilityBoundingSet" in s:
        assert "CAP_SYS_TIME" in s["CapabilityBoundingSet"].split()
    assert s.get("ProtectClock", "no") == "no"
