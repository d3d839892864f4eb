"""What `warmctl` imports before it does anything (Python start-up and imports were 0.5-0.7 s of
every `up`). Each check runs a fresh interpreter and reads its ``sys.modules``; the last one
counts its instructions (the times: benchmarks/up_imports.py, benchmarks/up_vs_raw.py and
docs/benchmarks.md).

- Registering every command and building the click command tree (what ``--help`` and every
  command pay) imports none of the library: no pydantic models, rich, httpx, cryptography,
  psutil, asyncio.
- The real ``warmctl up NAME --json`` (here on an empty store with ``--cold-start never``, so it
  stops after the catalog lookup with exit 4, having imported :mod:`warmctl.pipelines.lifecycle` and
  everything it imports) never imports the agent's server (fastapi, uvicorn, starlette), boto3 or
  botocore (only an S3 store needs them), httpx (health and canary use ``http.client``) or rich
  (``--json`` prints no progress), cryptography (only a signed snapshot or a sealed store needs
  it, once ``up`` runs), the S3 and OCI backends, nor the cold-start and snapshot paths.
- The weight: the up path (``python -m warmctl up``, from the interpreter's start to the call of
  ``lifecycle.up``: the CLI, typer/click, the settings, and what
  :mod:`warmctl.pipelines.lifecycle` imports) executes at most :data:`BUDGET_INSTRUCTIONS`
  instructions over a bare interpreter, counted under valgrind's callgrind as
  ``benchmarks/up_imports.py --instructions`` counts them. Instructions, not seconds: the count
  does not move with the host's load or clock, where CPU time did (the time is the benchmark's,
  docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_spec = importlib.util.spec_from_file_location("up_imports", REPO / "benchmarks" / "up_imports.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

#: never imported by the `up` path (nor by --help)
NOT_ON_UP_PATH = bench.NOT_ON_UP_PATH

#: instructions the up path may execute over a bare interpreter (valgrind's count). 862 M at
#: 987943c (typer 0.29.2, pydantic 2.14.4, Python 3.11.7; 858 M on 2026-12-03): 130 ms of CPU on
#: the quiet Intel VM, 227-246 ms on the slower AMD VM of 2026-12-06/07. The budget keeps the path under the 150 ms aim where it
#: is met (about 995 M there) with a margin: a new heavy import on the path fails it (httpx
#: imported first adds 245 M). The earlier budget in CPU seconds, scaled by the bare interpreter's
#: time, failed on the AMD VM: 221 ms against 217 ms at load 16, and 246 ms against 232 ms quiet
#: (its imports are slower there than its bare interpreter says).
BUDGET_INSTRUCTIONS = 950_000_000

#: not imported by registering the commands and building the CLI (the commands import them)
NOT_AT_REGISTRATION = NOT_ON_UP_PATH + ("pydantic", "cryptography", "psutil", "asyncio", "zstandard",
                                       "warmctl.records.config", "warmctl.pipelines.lifecycle", "warmctl.records.profile", "warmctl.store",
                                       "warmctl.diskspace")


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
            "import warmctl.pipelines.lifecycle as lc\n"
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
    assert {"warmctl.pipelines.lifecycle", "warmctl.engine.canary", "warmctl.gate", "pydantic"} <= set(present)
    assert _loaded(present, NOT_ON_UP_PATH) == []


def test_up_path_imports_no_heavy_module_when_it_calls_lifecycle_up(tmp_path):
    present = bench.up_modules(bench.make_env(tmp_path), tmp_path)
    assert {"warmctl.pipelines.lifecycle", "warmctl.records.config", "warmctl.records.profile", "typer", "pydantic"} <= set(present)
    assert bench.loaded(present) == []


def test_up_path_loads_the_profile_without_detect_secrets_or_requests(tmp_path):
    """``up``'s first step, the profile load, runs the credential rules without importing the
    detect_secrets package and its ``requests`` (they read the plugins' expressions from source)."""
    dump = tmp_path / "modules.json"
    bench.run_once(bench.UP_PROFILE_CODE, {**bench.make_env(tmp_path), "WARMCTL_IMPORTS_DUMP": str(dump)}, tmp_path)
    present = json.loads(dump.read_text())
    assert {"warmctl.pipelines.lifecycle", "warmctl.records.profile", "warmctl.records.credentials"} <= set(present)
    assert _loaded(present, NOT_ON_UP_PATH + ("detect_secrets", "requests", "urllib3")) == []


def test_up_path_instructions_within_budget(tmp_path):
    env = bench.make_env(tmp_path)
    for code in (bench.SIDES["bare"], bench.UP_CODE):  # writes the bytecode, as an install has it
        bench.run_once(code, env, tmp_path)
    bare = bench.instructions(bench.SIDES["bare"], env, tmp_path)
    extra = bench.instructions(bench.UP_CODE, env, tmp_path) - bare
    assert 0 < bare and 0 < extra  # counted: a bare interpreter runs tens of millions
    assert extra <= BUDGET_INSTRUCTIONS, (f"the up path executed {extra / 1e6:.0f} M instructions over a bare "
                                          f"interpreter (budget {BUDGET_INSTRUCTIONS / 1e6:.0f} M): python "
                                          "benchmarks/up_imports.py --instructions shows its slowest imports")


def test_a_top_level_command_builds_only_itself_and_a_group_the_whole_tree(tmp_path):
    code = ("import json, warmctl.cli as c; c._register()\n"
            "print(json.dumps({k: sorted(c._click_command(k.split()).commands) "
            "for k in ('up tiny', 'profile ls', 'bogus', '')}))")
    r = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    built = json.loads(r.stdout)
    assert built["up tiny"] == ["up"]  # still a group: `warmctl up NAME` as ever
    assert {"up", "down", "status", "push", "profile", "keys"} <= set(built["profile ls"])
    assert built["bogus"] == built[""] == built["profile ls"]  # click names what does not exist, and suggests


def test_a_core_command_registers_core_alone_and_names_are_unique(tmp_path):
    """``warmctl up`` registers the ``core`` area alone (the other areas' CLI modules are not
    imported); that builds the same command as the whole registration only because no other
    area registers a top-level command of a core command's name, which this also checks."""
    code = ("import json, sys, warmctl.cli as c; c._register('up'); lone = c._command_names()\n"
            "mods = sorted(m for m in sys.modules if m.startswith('warmctl.cli.'))\n"
            "c.app.registered_commands.clear(); c._register(); every = c._command_names()\n"
            "print(json.dumps({'lone': lone, 'mods': mods, 'every': every}))")
    r = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert "up" in got["lone"] and got["every"][:len(got["lone"])] == got["lone"]
    assert [m for m in got["mods"] if m not in ("warmctl.cli.core", "warmctl.cli.output")] == []
    assert len(got["every"]) == len(set(got["every"])) > len(got["lone"])
