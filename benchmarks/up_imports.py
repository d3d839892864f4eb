"""What ``warmctl up`` pays in Python start-up and imports before its first phase.

Measures, in fresh interpreters, interleaved, ``--runs`` times each (the machine is shared:
compare within one run):

- **bare**: ``python -c pass`` (the interpreter alone);
- **floor**: the libraries ``up`` is built on and nothing of warmctl: ``import typer.main`` and
  pydantic with one model built and validated (:data:`FLOOR_CODE`). The up path can get no
  cheaper than this while it parses its command line with typer and reads its settings,
  profile and manifest with pydantic; the up path minus the floor is warmctl's own share;
- **cli**: ``import warmctl.cli``, every command registered and the click command built (what
  every ``warmctl`` command, ``--help`` included, pays);
- **up path**: the real ``python -m warmctl up tiny --json --cold-start never`` (a config with
  the ``tiny`` profile in a temporary directory), ended at the moment the command calls
  :func:`warmctl.pipelines.lifecycle.up`: the CLI, typer/click, the settings, and
  everything ``warmctl.pipelines.lifecycle`` imports at its top;
- **up path with the profile loaded**: the same, continued through ``up``'s first step, the
  profile load (:func:`warmctl.pipelines.lifecycle.find_profile`: the TOML, the models, the credential
  rules), ended there.

Each side's extra over **bare** is reported (best and median of the runs); then one
``python -X importtime`` run of the up path: its imports grouped (typer/click, pydantic,
warmctl's own modules, the rest), the slowest modules by their own time, and which heavy
modules it does not import. ``--instructions`` also counts the instructions each side executes
once under valgrind's callgrind (:func:`instructions`: the same at any load; the
test ``tests/test_startup_imports.py`` holds the up path to a budget of them).

``--repo DIR`` (repeatable) measures the code in each checkout (``PYTHONPATH=DIR``), the
sides interleaved; with two, the second's ratio to the first is printed (before/after).
Bytecode is compiled once into a temporary ``PYTHONPYCACHEPREFIX`` before the timed runs, as
an installed package has its ``.pyc`` files (``PYTHONDONTWRITEBYTECODE`` is ignored here).
``--no-bytecode`` measures instead what a checkout run with ``PYTHONDONTWRITEBYTECODE=1`` pays
(this project's development hosts set it; ``benchmarks/up_vs_raw.py`` runs ``warmctl`` so):
warmctl's own modules compiled from source by every process (the checkouts must hold no
``__pycache__``), the installed packages read from their ``.pyc`` files.

Usage::

    python benchmarks/up_imports.py [--runs 15] [--repo BEFORE --repo AFTER] [--no-bytecode] [--instructions] [--top 15] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Modules the up path must not import (their packages' submodules included): the agent's
#: server, the S3 client, the HTTP client and terminal styling of other commands, cryptography
#: (only signed snapshots and sealed stores need it), the cold-start and snapshot paths (the
#: engine's start-up log is read by a cold start alone).
NOT_ON_UP_PATH = ("fastapi", "uvicorn", "starlette", "boto3", "botocore", "httpx", "rich", "cryptography",
                  "warmctl.pipelines.snapshot", "warmctl.engine.cold", "warmctl.engine.startlog", "warmctl.store.s3",
                  "warmctl.store.oci", "warmctl.agent")

#: The up path, ended where the `up` command calls lifecycle.up (exit 0 there; any other exit
#: means the path changed: a failure). WARMCTL_IMPORTS_DUMP: write sys.modules there first.
#: lifecycle.up is replaced as the command's own import of warmctl.pipelines.lifecycle loads it (a finder
#: first on sys.meta_path), so the modules load in the order `warmctl up` loads them: the CLI
#: first (which may set up the process, e.g. pydantic's plugins), then what the command imports.
UP_CODE = """\
import os, runpy, sys
def up(*a, **kw):
    dump = os.environ.get("WARMCTL_IMPORTS_DUMP")
    if dump:
        import json
        with open(dump, "w") as f:
            json.dump(sorted(sys.modules), f)
    sys.stdout.flush()
    os._exit(0)
class PatchUp:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "warmctl.pipelines.lifecycle":
            return None
        sys.meta_path.remove(PatchUp)
        import importlib.util
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.up = up
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, PatchUp)
sys.argv = ["warmctl", "up", "tiny", "--json", "--cold-start", "never"]
runpy.run_module("warmctl", run_name="__main__")
os._exit(3)
"""
#: The up path continued through ``up``'s first step, the profile load (lifecycle.find_profile:
#: the TOML, the models, the credential rules), then ended as UP_CODE ends.
UP_PROFILE_CODE = UP_CODE.replace("def up(*a, **kw):\n", "def up(*a, **kw):\n"
                                  "    sys.modules['warmctl.pipelines.lifecycle'].find_profile(a[0].name, a[1])\n", 1)
CLI_CODE = "import typer.main, warmctl.cli as c; c._register(); typer.main.get_command(c.app)"
#: The libraries' floor: what the up path costs before any of warmctl's own code runs, the
#: libraries it is built on, typer (the CLI) and pydantic with its first model built and
#: validated (the settings, profile and manifest are pydantic models), plugins off as
#: warmctl.cli.main turns them off. None of warmctl is imported.
FLOOR_CODE = ("import os\nos.environ.setdefault('PYDANTIC_DISABLE_PLUGINS', '__all__')\nimport typer.main\n"
              "import pydantic\nclass M(pydantic.BaseModel):\n    x: int\nM(x=1)\n")
SIDES = {"bare": "pass", "floor": FLOOR_CODE, "cli": CLI_CODE, "up": UP_CODE, "up_profile": UP_PROFILE_CODE}


def make_env(work: Path, repo: Path = REPO, bytecode: bool = True) -> dict[str, str]:
    """An environment for the measured interpreters: warmctl from ``repo``, a config in ``work``
    (home, keys, a ``tiny`` profile), bytecode kept under ``work/pycache`` (``bytecode=False``:
    none written, ``PYTHONDONTWRITEBYTECODE=1``), no ``WARMCTL_*`` setting of the caller's but
    ``WARMCTL_CRIU``."""
    profiles = work / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    shutil.copy(repo / "profiles" / "tiny.toml", profiles / "tiny.toml")
    cfg = work / "config.toml"
    cfg.write_text(f'home = "{work / "home"}"\nprofile_dirs = ["{profiles}"]\nkeys_dir = "{work / "keys"}"\n')
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("WARMCTL_") or k == "WARMCTL_CRIU") and k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    env.update({"WARMCTL_CONFIG": str(cfg), "PYTHONPATH": str(repo)})
    if bytecode:
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.pop("PYTHONPYCACHEPREFIX", None)
        if any(repo.rglob("__pycache__")):
            raise SystemExit(f"--no-bytecode: {repo} holds __pycache__ directories; remove them first")
    return env


def run_once(code: str, env: dict[str, str], cwd: Path, *flags: str) -> tuple[float, float, subprocess.CompletedProcess]:
    """``python [flags] -c code`` run to its end: (wall seconds from its start to its exit, CPU
    seconds it used (user + system, its children included), the process). The CPU time is what
    a loaded host inflates least. Raises RuntimeError with its output when it does not exit 0."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *flags, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=120)
    dt = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise RuntimeError(f"python -c ... exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return dt, (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime), r


def instructions(code: str, env: dict[str, str], cwd: Path) -> int:
    """Instructions ``python -c code`` executes in user space, run once to its end under
    ``valgrind --tool=callgrind`` (its "Collected" total; ``PYTHONHASHSEED=0``): the same count
    for the same code, libraries and interpreter whatever the host's load or clock (valgrind
    runs every process on one synthetic CPU; another host's C library may pick other string
    routines, a small difference), about 60 times slower than a plain run. Raises
    RuntimeError when valgrind is missing or the program does not exit 0."""
    if shutil.which("valgrind") is None:
        raise RuntimeError("valgrind not found (Debian's valgrind; scripts/install-test-services.sh installs it)")
    r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", code],
                       env={**env, "PYTHONHASHSEED": "0"}, cwd=cwd, capture_output=True, text=True, timeout=600)
    m = re.search(r"^==\d+== Collected : (\d+)$", r.stderr, re.MULTILINE)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"valgrind python -c ... exited {r.returncode}:\n{r.stdout}\n{r.stderr[-3000:]}")
    return int(m.group(1))


def loaded(modules: list[str], names: tuple[str, ...] = NOT_ON_UP_PATH) -> list[str]:
    """The ``names`` (packages: any submodule counts) among ``modules``."""
    return sorted(n for n in names if any(m == n or m.startswith(n + ".") for m in modules))


def up_modules(env: dict[str, str], cwd: Path) -> list[str]:
    """``sys.modules`` (sorted names) of the up path at the moment it calls lifecycle.up."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        run_once(UP_CODE, {**env, "WARMCTL_IMPORTS_DUMP": f.name}, cwd)
        return json.loads(Path(f.name).read_text())


def importtime(env: dict[str, str], cwd: Path) -> list[tuple[str, int, int, int]]:
    """One ``-X importtime`` run of the up path: ``[(module, self_us, cumulative_us, depth)]``
    in the order Python printed them."""
    _, _, r = run_once(UP_CODE, env, cwd, "-X", "importtime")
    rows = []
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((m.group(4), int(m.group(1)), int(m.group(2)), len(m.group(3)) // 2))
    return rows


GROUPS = (("typer/click", ("typer", "click")),
          ("pydantic", ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions")),
          ("warmctl", ("warmctl",)))


def group_of(module: str) -> str:
    top = module.split(".")[0]
    for name, tops in GROUPS:
        if top in tops:
            return name
    return "other (stdlib, psutil, zstandard, ...)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15, help="timed runs of each side (default 15)")
    ap.add_argument("--repo", type=Path, action="append", default=None,
                    help="checkout to measure (repeatable; default: this one)")
    ap.add_argument("--no-bytecode", action="store_true",
                    help="warmctl's modules compiled by every process (PYTHONDONTWRITEBYTECODE=1)")
    ap.add_argument("--instructions", action="store_true",
                    help="also count each side's instructions once under valgrind's callgrind")
    ap.add_argument("--top", type=int, default=15, help="modules listed by their own import time")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args()
    repos = [p.resolve() for p in (a.repo or [REPO])]
    load = os.getloadavg()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} at the start")
    work = Path(tempfile.mkdtemp(prefix="warmctl-up-imports-"))
    result: dict = {"runs": a.runs, "bytecode": not a.no_bytecode, "load_start": load, "repos": {}}
    try:
        envs = {str(r): make_env(work / f"r{i}", r, bytecode=not a.no_bytecode) for i, r in enumerate(repos)}
        for r in repos:  # compile once each
            for code in SIDES.values():
                run_once(code, envs[str(r)], work)
        times: dict[str, dict[str, list[float]]] = {str(r): {k: [] for k in SIDES} for r in repos}
        cpu: dict[str, dict[str, list[float]]] = {str(r): {k: [] for k in SIDES} for r in repos}
        for _ in range(a.runs):
            for r in repos:
                for side, code in SIDES.items():
                    wall_s, cpu_s, _ = run_once(code, envs[str(r)], work)
                    times[str(r)][side].append(wall_s)
                    cpu[str(r)][side].append(cpu_s)
        print(f"\nfresh interpreters, {a.runs} runs of each side, interleaved; ms over a bare interpreter, "
              "best / median, wall clock and CPU (user + system):")
        for r in repos:
            row = {}
            for what, t in (("", times[str(r)]), ("cpu_", cpu[str(r)])):
                bare_b, bare_m = min(t["bare"]), statistics.median(t["bare"])
                row.update({f"{what}bare_best_s": bare_b, f"{what}bare_median_s": bare_m})
                for side in ("floor", "cli", "up", "up_profile"):
                    row[f"{what}{side}_best_s"] = min(t[side]) - bare_b
                    row[f"{what}{side}_median_s"] = statistics.median(t[side]) - bare_m
            mods = up_modules(envs[str(r)], work)
            row["up_modules"] = len(mods)
            row["heavy_loaded"] = loaded(mods)
            result["repos"][str(r)] = row
            print(f"  {r}:\n    wall: bare {row['bare_best_s'] * 1e3:.0f} / {row['bare_median_s'] * 1e3:.0f} ms; "
                  f"floor +{row['floor_best_s'] * 1e3:.0f} / +{row['floor_median_s'] * 1e3:.0f} ms; "
                  f"cli +{row['cli_best_s'] * 1e3:.0f} / +{row['cli_median_s'] * 1e3:.0f} ms; "
                  f"up path +{row['up_best_s'] * 1e3:.0f} / +{row['up_median_s'] * 1e3:.0f} ms; "
                  f"with the profile loaded +{row['up_profile_best_s'] * 1e3:.0f} / +{row['up_profile_median_s'] * 1e3:.0f} ms\n"
                  f"    CPU:  bare {row['cpu_bare_best_s'] * 1e3:.0f} / {row['cpu_bare_median_s'] * 1e3:.0f} ms; "
                  f"floor +{row['cpu_floor_best_s'] * 1e3:.0f} / +{row['cpu_floor_median_s'] * 1e3:.0f} ms; "
                  f"cli +{row['cpu_cli_best_s'] * 1e3:.0f} / +{row['cpu_cli_median_s'] * 1e3:.0f} ms; "
                  f"up path +{row['cpu_up_best_s'] * 1e3:.0f} / +{row['cpu_up_median_s'] * 1e3:.0f} ms; "
                  f"with the profile loaded +{row['cpu_up_profile_best_s'] * 1e3:.0f} / "
                  f"+{row['cpu_up_profile_median_s'] * 1e3:.0f} ms\n"
                  f"    the up path's own share over the floor (CPU, best): "
                  f"+{(row['cpu_up_best_s'] - row['cpu_floor_best_s']) * 1e3:.0f} ms, with the profile loaded "
                  f"+{(row['cpu_up_profile_best_s'] - row['cpu_floor_best_s']) * 1e3:.0f} ms\n"
                  f"    the up path imports {len(mods)} modules; of {', '.join(NOT_ON_UP_PATH)}: "
                  f"{', '.join(row['heavy_loaded']) or 'none'}")
        if len(repos) == 2:
            b, c = (result["repos"][str(r)] for r in repos)
            keys = ("up_best_s", "up_median_s", "cpu_up_best_s", "cpu_up_median_s", "cpu_up_profile_best_s",
                    "cpu_up_profile_median_s")
            for k in keys:
                result[f"ratio_{k[:-2]}"] = c[k] / b[k]
            print("  second / first: " + ", ".join(f"{k[:-2].replace('_', ' ')} {c[k] / b[k]:.2f}x" for k in keys))
        if a.instructions:
            print("\ninstructions over a bare interpreter (valgrind --tool=callgrind, once each):")
            for r in repos:
                count = {side: instructions(SIDES[side], envs[str(r)], work) for side in ("bare", "floor", "up", "up_profile")}
                result["repos"][str(r)]["instructions"] = count
                print(f"  {r}: bare {count['bare'] / 1e6:.1f} M; " + ", ".join(
                    f"{side.replace('_', ' with ')} +{(count[side] - count['bare']) / 1e6:.1f} M"
                    for side in ("floor", "up", "up_profile")))
        for r in repos:
            rows = importtime(envs[str(r)], work)
            groups: dict[str, int] = {}
            for mod, self_us, _, _ in rows:
                groups[group_of(mod)] = groups.get(group_of(mod), 0) + self_us
            total = sum(groups.values())
            print(f"\n-X importtime of the up path ({r}): {total / 1e3:.0f} ms of imports, by their own time: "
                  + ", ".join(f"{g} {us / 1e3:.0f} ms" for g, us in sorted(groups.items(), key=lambda x: -x[1])))
            print(f"  slowest {a.top} by own time (ms, cumulative in brackets):")
            for mod, self_us, cum_us, _ in sorted(rows, key=lambda x: -x[1])[:a.top]:
                print(f"    {self_us / 1e3:6.1f}  ({cum_us / 1e3:.1f})  {mod}")
            result["repos"][str(r)]["importtime_ms"] = {g: us / 1e3 for g, us in groups.items()}
        result["load_end"] = os.getloadavg()
        print(f"\nload average at the end {result['load_end'][0]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
