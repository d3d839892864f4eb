"""What `warmctl` imports before it does anything (issue 12: Python start-up and imports were
0.5-0.7 s of every `up`). Each check runs a fresh interpreter and reads its ``sys.modules``;
nothing is timed (the times are measured in benchmarks/up_vs_raw.py and docs/benchmarks.md).

- Registering every command and building the click command tree (what ``--help`` and every
  command pay) imports none of the library: no pydantic models, rich, httpx, cryptography,
  psutil, asyncio.
- The real ``warmctl up NAME --json`` (here on an empty store with ``--cold-start never``, so it
  stops after the catalog lookup with exit 4, having imported :mod:`warmctl.lifecycle` and
  everything it imports) never imports the agent's server (fastapi, uvicorn, starlette), boto3 or
  botocore (only an S3 store needs them), httpx (health and canary use ``http.client``) or rich
  (``--json`` prints no progress).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: never imported by the `up` path (nor by --help)
NOT_ON_UP_PATH = ("fastapi", "uvicorn", "starlette", "boto3", "botocore", "httpx", "rich")

#: not imported by registering the commands and building the CLI (the commands import them)
NOT_AT_REGISTRATION = NOT_ON_UP_PATH + ("pydantic", "cryptography", "psutil", "asyncio", "zstandard",
                                       "warmctl.config", "warmctl.lifecycle", "warmctl.profile", "warmctl.store")


def _env(tmp_path: Path) -> dict[str, str]:
    cfg = tmp_path / "config.toml"
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "tiny.toml").write_text((REPO / "profiles" / "tiny.toml").read_text())
    cfg.write_text(f'home = "{tmp_path / "home"}"\nprofile_dirs = ["{profiles}"]\nkeys_dir = "{tmp_path / "keys"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_") or k == "WARMCTL_CRIU"}
    env.update({"WARMCTL_CONFIG": str(cfg), "PYTHONPATH": str(REPO)})
    return env


def _loaded(present: list[str], names: tuple[str, ...]) -> list[str]:
    """The ``names`` (packages: any of their submodules counts) among ``present``."""
    return sorted(n for n in names if any(m == n or m.startswith(n + ".") for m in present))


def test_registering_the_commands_imports_none_of_the_library(tmp_path):
    code = ("import json, sys, typer.main, warmctl.cli as c; c._register(); typer.main.get_command(c.app); "
            "print(json.dumps(sorted(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    present = json.loads(r.stdout)
    assert "typer" in present  # the check sees what was imported
    assert _loaded(present, NOT_AT_REGISTRATION) == []


def test_up_imports_no_server_s3_httpx_or_rich(tmp_path):
    dump = tmp_path / "modules.json"
    # sys.modules once lifecycle.up has returned or raised: what `up` imported, before the CLI
    # prints the result (an error line is styled with rich)
    code = ("import json, runpy, sys\n"
            "import warmctl.lifecycle as lc\n"
            "real_up = lc.up\n"
            "def up(*a, **kw):\n"
            "    try:\n"
            "        return real_up(*a, **kw)\n"
            "    finally:\n"
            f"        open({str(dump)!r}, 'w').write(json.dumps(sorted(sys.modules)))\n"
            "lc.up = up\n"
            "sys.argv = ['warmctl', 'up', 'tiny', '--cold-start', 'never', '--json']\n"
            "runpy.run_module('warmctl', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 4, (r.stdout, r.stderr)  # not found: stopped after the catalog lookup
    assert "no snapshot tiny:latest" in r.stderr
    present = json.loads(dump.read_text())
    assert {"warmctl.lifecycle", "warmctl.engine.canary", "warmctl.gate", "pydantic"} <= set(present)
    assert _loaded(present, NOT_ON_UP_PATH) == []
