"""What the GPU check (scripts/gpu-check.sh) brings and needs, proven here on the CPU machine:
its Python import chain needs only what the GPU machine has (torch, httpx, psutil and the
standard library), and its CRIU bundle runs from wherever it is copied."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: What the GPU machine has besides the standard library (Python 3.12 with torch,
#: httpx and psutil; no pydantic).
GPU_MACHINE_HAS = {"torch", "httpx", "psutil"}
#: Import names of the distributions in pyproject's dependencies, where they differ.
IMPORT_NAMES = {"nvidia-ml-py": "pynvml", "prometheus-client": "prometheus_client"}
#: Not declared by warmctl but present in this venv, and not on the GPU machine.
ALSO_ABSENT = {"vllm", "numpy", "safetensors", "transformers", "huggingface_hub", "yaml", "requests", "starlette"}


def blocked_imports() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0] for d in deps}
    return ({IMPORT_NAMES.get(n, n.replace("-", "_")) for n in names} | ALSO_ABSENT) - GPU_MACHINE_HAS


def run_blocked(code: str) -> subprocess.CompletedProcess:
    # scripts/ too: a script's own directory is the first entry of its sys.path (json_http).
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests' / 'gpu_check_env'}:{ROOT}:{ROOT / 'scripts'}",
               WARMCTL_BLOCK_IMPORTS=",".join(sorted(blocked_imports())))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_gpu_check_imports_with_only_torch_httpx_and_psutil():
    blocked = blocked_imports()
    assert {"pydantic", "typer", "rich", "fastapi", "boto3", "zstandard"} <= blocked
    # The blocker works: every blocked package that is installed here fails to import.
    installed = [n for n in sorted(blocked) if _importable(n)]
    assert "pydantic" in installed
    probe = "\n".join(f"try:\n    import {n}\n    print('IMPORTED {n}')\nexcept ImportError:\n    pass" for n in installed)
    r = run_blocked(probe)
    assert r.returncode == 0 and "IMPORTED" not in r.stdout, r.stdout + r.stderr

    # What the check runs: scripts/gpu_check.py (loaded as a module; main() is not called),
    # the launcher it starts with `python -m`, and every import of the server it starts.
    server = ast.parse((ROOT / "scripts" / "gpu_check_server.py").read_text())
    server_imports = sorted({a.name for n in server.body if isinstance(n, ast.Import) for a in n.names}
                            | {n.module for n in server.body if isinstance(n, ast.ImportFrom) and n.module})
    assert "warmctl.engine.worker_ext" in server_imports
    assert ".numpy()" not in (ROOT / "scripts" / "gpu_check_server.py").read_text()  # torch without numpy
    code = (
        "import importlib, importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('gpu_check', 'scripts/gpu_check.py')\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert callable(m.main)\n"
        "import warmctl.engine.launch\n"
        f"for name in {server_imports!r}: importlib.import_module(name)\n"
        "print('ok', sorted(k for k in sys.modules if k.startswith('warmctl')))\n"
    )
    r = run_blocked(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ok") and "warmctl.checkpoint.ranks" in r.stdout


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd")
def test_the_criu_bundle_runs_from_any_directory(tmp_path):
    """scripts/criu-bundle.sh copies CRIU and every library ldd lists; the bundle, moved
    elsewhere and run with an empty environment, passes `criu --version` (and `criu check` as
    root), and is small enough to carry to the GPU machine (64 MiB limit for everything)."""
    from warmctl.checkpoint import criu

    try:
        src = criu.criu_binary()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no CRIU here: {e}")
    made = tmp_path / "made"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "criu-bundle.sh"), src, str(made)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    moved = tmp_path / "elsewhere" / "criu-bundle"
    moved.parent.mkdir()
    made.rename(moved)
    assert (moved / "MANIFEST").read_text().startswith(f"source: {src}")
    libs = {p.name for p in (moved / "lib").iterdir()}
    assert any(n.startswith("libc.so") for n in libs) and any(n.startswith("ld-linux") for n in libs)
    out = subprocess.run([str(moved / "criu"), "--version"], env={}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and re.search(r"Version:\s*4\.", out.stdout), out.stdout + out.stderr
    size = sum(p.stat().st_size for p in moved.rglob("*") if p.is_file())
    assert size < 32 * 2**20, f"bundle is {size / 2**20:.1f} MiB"
    if os.geteuid() == 0:
        chk = subprocess.run([str(moved / "criu"), "check"], env={}, capture_output=True, text=True, timeout=60)
        assert chk.returncode == 0, chk.stdout + chk.stderr
    # The bundle stays out of git where gpu-check.sh looks for it.
    for where in ("criu-bundle/criu", "shared/criu-bundle/criu"):
        assert subprocess.run(["git", "check-ignore", "-q", where], cwd=ROOT).returncode == 0, where


# --------------------------------------------------- clean-up on failure, timeout and SIGTERM

def _load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_wait_ends_before_the_limit_less_the_cleanup_reserve():
    gc = _load_gpu_check()
    b = gc.Budget(gc.CLEANUP_RESERVE_S + 5)
    assert b.left(600, "criu dump") <= 5  # CRIU's own 600 s default never reaches the driver of the check
    assert b.left(2) == 2
    with pytest.raises(gc.CheckTimeout, match="criu restore"):
        gc.Budget(gc.CLEANUP_RESERVE_S).left(30, "criu restore")
    assert gc.CLEANUP_TIMEOUT_S < gc.CLEANUP_RESERVE_S


# The script the test runs under `timeout`: the check's own pieces (start_in_pid_namespace,
# install_sigterm, Cleanup) around a real tree in a PID namespace whose two children are CUDA
# processes of the fake driver, one LOCKED and one CHECKPOINTED when the SIGTERM comes.
TERM_SCRIPT = r"""
import importlib.util, json, os, sys, time
from pathlib import Path
root_dir, libcuda, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
sys.path.insert(0, root_dir)
spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(root_dir, "scripts", "gpu_check.py"))
gc = importlib.util.module_from_spec(spec); spec.loader.exec_module(gc)
from warmctl.checkpoint import cuda
from warmctl.base.proc import tree_pids
inner_code = (
    "import subprocess, sys, time\n"
    "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']) for _ in range(2)]\n"
    "time.sleep(600)\n"
)
api = cuda.DriverAPI(libcuda)
gc.install_sigterm()
clean = gc.Cleanup(api)
budget = gc.Budget(60)
log = open(work / "tree.log", "a")
try:
    launcher, root = gc.start_in_pid_namespace([sys.executable, "-c", inner_code], log, dict(os.environ), budget, clean)
    end = time.monotonic() + 20
    while len(tree_pids(root)) < 3 and time.monotonic() < end:
        time.sleep(0.05)
    ranks = [p for p in tree_pids(root) if p != root]
    for p in ranks:
        (work / "driver" / "procs" / str(p)).write_text("0 0 1073741824 0\n")
    api.lock(ranks[0]); api.lock(ranks[1]); api.checkpoint(ranks[1])
    clean.ranks += ranks
    print(json.dumps({"launcher": launcher.pid, "root": root, "ranks": ranks}), flush=True)
    time.sleep(120)
    print("not interrupted", flush=True)
except BaseException as e:
    print(json.dumps({"error": type(e).__name__}), flush=True)
finally:
    print(json.dumps({"cleanup": clean.run()}), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid needs root")
def test_sigterm_unlocks_the_ranks_and_kills_the_namespace(tmp_path):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("fake_libcuda_harness_gc", ROOT / "tests" / "fake_libcuda" / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = harness
    spec.loader.exec_module(harness)
    built = harness.build(tmp_path / "fake")
    drv = harness.FakeDriver(tmp_path / "driver", built)
    drv.add_gpu("GPU-11111111-2222-3333-4444-555555555500", 80 * 2**30)
    (tmp_path / "script.py").write_text(TERM_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), WARMCTL_FAKE_CUDA_DIR=str(drv.root))
    # `timeout` sends SIGTERM to the script, as gpu-check.sh's does to gpu_check.py.
    r = subprocess.run(["timeout", "-k", "30", "8", sys.executable, str(tmp_path / "script.py"), str(ROOT),
                        str(built.full), str(tmp_path)], env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == 124, r.stdout + r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    started, err, done = lines[0], lines[1], lines[2]["cleanup"]
    assert err == {"error": "Terminated"} and "not interrupted" not in r.stdout
    rank_locked, rank_ckpt = started["ranks"]
    # Nothing left locked or checkpointed in the driver before the kill...
    assert drv.state(rank_locked) == "RUNNING" and drv.state(rank_ckpt) == "RUNNING"
    unlocked = {p for _, w, _, p, rc in drv.events("unlock") if w == "end" and rc == 0}
    assert unlocked == {rank_locked, rank_ckpt}
    assert done["not_running"] == {}
    # ...then the namespace's first process (not only the launcher) and its tree were killed.
    assert started["root"] in done["killed"] and started["launcher"] in done["killed"]
    assert done["left"] == []
    for p in (started["root"], rank_locked, rank_ckpt, started["launcher"]):
        assert harness.wait_dead(p, 5), p
