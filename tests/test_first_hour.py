"""docs/first-hour.md is run, so it cannot rot.

Convention (stated in the guide itself): every fenced block tagged ``bash`` is run, in document
order, each in a fresh ``bash -euo pipefail`` that first restores the exported variables, shell
functions and working directory the previous block left. A block tagged ``bash norun=KEY``
changes the machine itself (installer, systemd units, an S3 endpoint it does not have); each KEY
is listed in :data:`NOT_RUN` with what checks it instead, and any other shell-like block
(``sh``, ``console``, ``shell``, untagged) fails :func:`test_every_command_block_is_run_or_listed`,
so nothing in the guide is skipped silently.

The run (:func:`test_first_hour_guide_runs`, e2e: one cold start, the guide's ``warmctl snapshot
tiny``) sets the guide's variables to this test's: ``FH`` (a temporary directory), ``PORT`` (the
public port, ``WARMCTL_TEST_GATE_PORT``), ``AGENT_PORT`` (a free loopback port), and gives both
homes a ``tiny`` on the test ports through ``WARMCTL_PROFILE_DIRS`` (the engine's internal port
is a profile field, ``WARMCTL_TEST_ENGINE_PORT``). ``warmctl`` on ``PATH`` is this checkout's.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, tiny_profile
from tests.ports import free_port
from tests.test_agent_e2e import _snapshot_shm

GUIDE = REPO / "docs" / "first-hour.md"

#: norun KEY -> why the block is not run here, and what checks it instead
NOT_RUN = {
    "install": "scripts/install.sh changes the host (apt packages, /usr/local/sbin/criu); "
               "`bash scripts/test.sh` runs it on every CI machine, and `bash scripts/test.sh --clean-root` "
               "runs scripts/demo.sh (which starts with it) in a clean Debian 12 root (tests/test_clean_root.py)",
    "systemd": "systemctl needs a booted systemd as PID 1 and writes /etc; the unit files are checked with "
               "`systemd-analyze verify` by test_systemd_units_verify",
    "s3": "needs an S3 endpoint; push to and restore from a real Ceph RGW is "
          "tests/test_e2e_fleet.py::test_b_restores_from_ceph_rgw",
}

#: info strings of fenced blocks that are not commands
NOT_COMMANDS = {"text", "toml", "json", "ini"}


@dataclass
class Block:
    line: int       # 1-based line of the opening fence
    info: str       # the fence's info string, e.g. "bash" or "bash norun=systemd"
    body: str

    @property
    def norun(self) -> str | None:
        m = re.fullmatch(r"bash\s+norun=([\w-]+)", self.info)
        return m.group(1) if m else None


def blocks(text: str) -> list[Block]:
    """Fenced code blocks of a Markdown text (``` fences, any indentation) in order."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^\s*```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{GUIDE.name}:{start + 1}: fence never closed"
        out.append(Block(start + 1, m.group(1).strip(), "\n".join(body) + "\n"))
        i += 1
    return out


def test_every_command_block_is_run_or_listed():
    bs = blocks(GUIDE.read_text())
    bad = [f"{GUIDE.name}:{b.line}: ```{b.info}" for b in bs
           if b.info != "bash" and b.norun is None and b.info not in NOT_COMMANDS]
    assert not bad, ("blocks that are neither run (```bash) nor listed as not run (```bash norun=KEY, KEY in "
                     "NOT_RUN) nor non-command (" + ", ".join(sorted(NOT_COMMANDS)) + "):\n" + "\n".join(bad))
    keys = [b.norun for b in bs if b.norun]
    assert sorted(keys) == sorted(NOT_RUN), f"norun blocks {keys} != NOT_RUN {sorted(NOT_RUN)}"
    assert sum(b.info == "bash" for b in bs) >= 10
    for b in bs:  # every command block, run or not, is valid bash
        if b.info == "bash" or b.norun:
            r = subprocess.run(["bash", "-n"], input=b.body, capture_output=True, text=True)
            assert r.returncode == 0, f"{GUIDE.name}:{b.line}: {r.stderr}"


def test_norun_blocks_name_what_exists():
    """What the not-run blocks copy or call is in the repository."""
    text = "".join(b.body for b in blocks(GUIDE.read_text()) if b.norun)
    for path in ("scripts/install.sh", "systemd/warmctl-agent.service", "systemd/warmctl-up@.service"):
        assert path in text, path
        assert (REPO / path).is_file(), path


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (package systemd)")
def test_systemd_units_verify(tmp_path):
    """The units the guide installs load without a warning: `systemd-analyze verify` of both
    (the template as instance ``tiny``), ExecStart pointed at an executable that exists here."""
    exe = tmp_path / "warmctl"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    for unit in ("warmctl-agent.service", "warmctl-up@.service"):
        text = (REPO / "systemd" / unit).read_text()
        assert "/opt/warmctl/bin/warmctl" in text, unit
        (tmp_path / unit).write_text(text.replace("/opt/warmctl/bin/warmctl", str(exe)))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", "warmctl-agent.service", "warmctl-up@tiny.service"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def _procs_under(path: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if Path(p.cwd()).is_relative_to(path) or any(str(path) in a for a in p.cmdline()):
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


@pytest.mark.e2e
def test_first_hour_guide_runs(tmp_path, engine_ports):
    engine_port, gate_port = engine_ports
    fh = tmp_path / "fh"
    profiles, shim = tmp_path / "profiles", tmp_path / "bin"
    profiles.mkdir()
    (profiles / "tiny.toml").write_text(tiny_profile(engine_port, gate_port))
    shim.mkdir()
    (shim / "warmctl").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m warmctl \"$@\"\n")
    (shim / "warmctl").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_") or k == "WARMCTL_CRIU"}
    env.update({
        "PATH": f"{shim}:{env.get('PATH', '/usr/bin:/bin')}",
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
        "PYTHONUNBUFFERED": "1",
        "FH": str(fh), "PORT": str(gate_port), "AGENT_PORT": str(free_port()),
        "WARMCTL_PROFILE_DIRS": str(profiles),
    })
    state = tmp_path / "state.sh"
    state.write_text(f"cd {shlex.quote(str(tmp_path))}\n")
    outputs: list[tuple[Block, str]] = []
    shm: list[str] = []  # /dev/shm files of the snapshot: the restored engines' (the cold start's had the same)
    try:
        for b in blocks(GUIDE.read_text()):
            if b.info != "bash":
                continue
            script = (f"set -euo pipefail\nsource {shlex.quote(str(state))}\n{b.body}"
                      f"{{ export -p; declare -f; printf 'cd %q\\n' \"$PWD\"; }} > {shlex.quote(str(state))}\n")
            t0 = time.monotonic()
            r = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                               timeout=1800)
            out = r.stdout + r.stderr
            print(f"{GUIDE.name}:{b.line}: {time.monotonic() - t0:.1f} s, exit {r.returncode}")
            assert r.returncode == 0, (f"{GUIDE.name}:{b.line}: block exited {r.returncode}\n--- block\n{b.body}"
                                       f"--- output\n{out}")
            outputs.append((b, out))
            if "warmctl snapshot tiny" in b.body:
                shm = _snapshot_shm({"WARMCTL_CONFIG": str(fh / "a" / "config.toml")})
    finally:
        # whatever the guide left when it failed part-way: both engines, the agent
        for h in ("a", "b"):
            if (fh / h / "config.toml").exists():
                subprocess.run([sys.executable, "-m", "warmctl", "down", "tiny"], capture_output=True, timeout=120,
                               env=dict(env, WARMCTL_CONFIG=str(fh / h / "config.toml")))
        pidfile = fh / "b" / "agent.pid"
        if pidfile.exists():
            try:
                agent = psutil.Process(int(pidfile.read_text()))
                if "agent" in agent.cmdline():
                    agent.send_signal(signal.SIGTERM)
                    agent.wait(30)
            except psutil.Error:
                pass

    def out_of(command: str) -> str:
        found = [o for b, o in outputs if command in b.body]
        assert found, f"no block runs {command!r}"
        return found[0]

    assert re.search(r"tiny:latest\s+sha256:[0-9a-f]{64}", out_of("warmctl snapshot tiny")), out_of("warmctl snapshot tiny")
    assert "push tiny:latest" in out_of("warmctl push tiny")
    assert "Paris" in out_of("v1/chat/completions")
    assert "succeeded restore" in out_of("/v1/engines/tiny/up"), out_of("/v1/engines/tiny/up")
    assert not fh.exists(), "the guide's clean-up step removes $FH"
    time.sleep(0.5)
    left = _procs_under(fh)
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {left}"
    assert shm, "the snapshot has /dev/shm files"
    assert not [f for f in shm if Path("/dev/shm", Path(f).name).exists()], shm
