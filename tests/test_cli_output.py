"""Output for people and for logs: the real CLI in a subprocess, with pipes (not a
terminal) and under a pseudo-terminal (python's ``pty``).

Off a terminal: nothing hard-wrapped (a long path or digest stays on its line), tables as plain
tab-separated lines, no progress bars, no escape codes; ``--json`` parses and carries the keys
docs/cli-json.md states. On a terminal: tables and progress bars; ``NO_COLOR`` removes styles.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_store_fixtures import chunk_files, snapshot, write_payload

from warmctl.naming.trust import generate_keypair
from warmctl.store import open_store

WARMCTL = [sys.executable, "-m", "warmctl"]
CH = 256 * 1024
SGR = re.compile(r"\x1b\[[0-9;]*m")  # colour and style escape codes
ESC = re.compile(r"\x1b")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "cli-json.md"


@pytest.fixture
def home(tmp_path) -> dict:
    """A config whose home sits under a 150-character directory name (so any wrapping at 80 or
    even 120 columns would have to break it), with a snapshot ``tiny`` of synthetic files in
    its store and a directory remote ``remote``."""
    root = tmp_path / ("d" * 150)
    root.mkdir()
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'home = "{root / "home"}"\nkeys_dir = "{root / "keys"}"\n')
    f = write_payload(tmp_path / "p.img", [("random", 3 * CH), ("zero", CH), ("text", CH)])
    kp = generate_keypair(root / "keys", "publisher")  # trusted by this home: pull names only signed entries
    with open_store(root / "home" / "store", chunk_size=CH) as s:
        digest = snapshot(s, "tiny", {"p.img": f}, signer=kp.private)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_") and k not in ("NO_COLOR", "FORCE_COLOR")}
    env.update({"WARMCTL_CONFIG": str(cfg), "COLUMNS": "80", "TERM": "xterm-256color"})
    return {"env": env, "root": root, "store": root / "home" / "store", "remote": tmp_path / "remote", "digest": digest}


def run(home: dict, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*WARMCTL, *args], env={**home["env"], **env}, capture_output=True, text=True, timeout=120)


def run_pty(home: dict, *args: str, **env: str) -> tuple[int, str]:
    """Run the CLI with stdin, stdout and stderr on one pseudo-terminal; (exit code, output)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([*WARMCTL, *args], env={**home["env"], "COLUMNS": "200", **env},
                         stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    buf = b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.5)
            if r:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every holder of the slave side closed it
                    break
                if not chunk:
                    break
                buf += chunk
            elif p.poll() is not None:
                break
    finally:
        os.close(master)
        p.wait(timeout=30)
    return p.returncode, buf.decode(errors="replace")


def test_errors_keep_long_paths_and_digests_on_one_line(home):
    r = run(home, "verify", "nosuch")
    assert r.returncode == 4 and r.stdout == ""
    catalog = str(home["store"] / "catalog")
    assert r.stderr.splitlines() == [f"error: no snapshot nosuch:latest in the catalog at {catalog}"], r.stderr

    bad = chunk_files(home["store"])[0]
    bad.write_bytes(b"bad")
    r = run(home, "verify", "tiny")
    assert r.returncode == 5
    assert not ESC.search(r.stdout + r.stderr)
    # the report names the corrupt chunk by its whole digest and its whole path, on one line
    lines = r.stdout.splitlines()
    hexpart = bad.name.split(".")[0][-64:]
    hit = [ln for ln in lines if ln.startswith("corrupt ")]
    assert len(hit) == 1 and hexpart in hit[0] and str(home["store"]) in hit[0], r.stdout
    assert home["digest"][:19] in hit[0]
    assert r.stderr.count("\n") == 1 and str(home["store"]) in r.stderr, r.stderr


def test_usage_errors_are_plain_lines_off_a_terminal(home):
    r = run(home, "up", "tiny", "--cold-start", "sometimes")
    assert r.returncode == 2
    assert "Invalid value for --cold-start: 'sometimes': use fallback or never" in r.stderr, r.stderr
    assert not re.search("[╭│╰]", r.stderr), r.stderr  # no box drawn around it


def test_tables_are_tab_separated_lines_off_a_terminal(home):
    r = run(home, "ls")
    assert r.returncode == 0 and not ESC.search(r.stdout)
    lines = r.stdout.splitlines()
    assert lines[0] == "# snapshot\tdigest\tsize\tcreated\tcold start\tranks\thost"
    assert lines[1].split("\t")[:2] == ["tiny:latest", home["digest"][:19]]
    r = run(home, "config", "show")
    assert r.returncode == 0
    home_line = next(ln for ln in r.stdout.splitlines() if ln.startswith("home\t"))
    assert home_line.split("\t")[1] == str(home["root"] / "home")  # 160+ characters, one field
    r = run(home, "du")
    assert r.returncode == 0  # the 160+ character store path unwrapped, in du's first line and its free-space line
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"# store {home['store']}, kept images "), r.stdout
    assert any(ln.endswith(f" {home['store']}: " + ln.split(": ")[-1]) and " free of " in ln for ln in lines), r.stdout


def _documented_keys(command: str) -> set[str]:
    """The keys docs/cli-json.md lists for ``command`` in the first quoted-key group of its
    section (a ``{"a", "b"}`` line or the JSON example)."""
    text = DOCS.read_text()
    sec = text.split(f"### `{command}")[1].split("\n### ")[0]
    block = re.search(r"```json\n(.*?)```", sec, re.S)
    if block:
        return set(json.loads(block.group(1)))
    braces = re.search(r"`\{(\"[^}]*)\}`", sec, re.S)
    return set(re.findall(r'"(\w+)"', braces.group(1)))


def test_json_outputs_parse_with_documented_keys(home):
    def j(*args: str) -> object:
        r = run(home, *args, "--json")
        assert r.returncode == 0, r.stderr
        assert not ESC.search(r.stdout + r.stderr)
        return json.loads(r.stdout)

    rows = j("ls")
    assert [(e["name"], e["tag"], e["digest"]) for e in rows] == [("tiny", "latest", home["digest"])]
    assert set(rows[0]) == _documented_keys("ls [--remote] --json") == {"name", "tag", "digest", "size", "created", "host", "profile",
                                                                   "layout"}
    assert j("status") == []
    du = j("du")
    assert set(du) == _documented_keys("du --json") and du["rows"][0]["digest"] == home["digest"]
    v = j("verify")
    assert set(v) == _documented_keys("verify [REF...] --json") and v["ok"] is True and v["manifests_checked"] == 1
    gc = j("gc", "--dry-run")
    assert set(gc) == _documented_keys("gc --json") and gc["dry_run"] is True and gc["manifests_kept"] == 1
    host = j("host")
    assert {"hostname", "arch", "kernel", "cpu", "env_digest"} <= set(host)
    cat = j("catalog", "ls")
    assert cat[0]["manifest"] == home["digest"]

    pushed = j("push", "tiny", "--to", str(home["remote"]))
    assert len(pushed) == 1 and set(pushed[0]) == _documented_keys("push NAME[:TAG] --json")
    assert pushed[0]["digest"] == home["digest"] and pushed[0]["chunks_copied"] == pushed[0]["chunks_total"] == 4
    other = home["root"] / "other"
    pulled = j("pull", "tiny", "--all", "--from", str(home["remote"]), "--store", str(other))
    assert pulled[0]["digest"] == home["digest"] and pulled[0]["to"] == str(other)

    bad = chunk_files(home["store"])[0]
    bad.write_bytes(b"bad")
    r = run(home, "verify", "--json")
    assert r.returncode == 5 and json.loads(r.stdout)["corrupt"][0]["manifests"] == [f"{home['digest'][:19]} (tiny)"]


def test_no_color_and_terminal_output(home):
    # on a terminal: a drawn table, with styles
    code, text = run_pty(home, "config", "show")
    assert code == 0 and "┃" in text and SGR.search(text), text[:400]
    # NO_COLOR: still a table, but no colour or style codes
    code, text = run_pty(home, "config", "show", NO_COLOR="1")
    assert code == 0 and "┃" in text and not SGR.search(text), text[:400]
    # a progress bar is drawn on a terminal, never into a pipe
    code, text = run_pty(home, "push", "tiny", "--to", str(home["remote"]))
    assert code == 0 and "━" in text, text[-600:]
    r = run(home, "push", "tiny", "--to", str(home["remote"] / "b"))
    assert r.returncode == 0 and "━" not in r.stderr and not ESC.search(r.stderr)
    assert len(r.stderr.splitlines()) == 1 and str(home["remote"] / "b") in r.stderr, r.stderr
    r = run(home, "push", "tiny", "--to", str(home["remote"] / "c"), NO_COLOR="1")
    assert r.returncode == 0 and not ESC.search(r.stdout + r.stderr)
