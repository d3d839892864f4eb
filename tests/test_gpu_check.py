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
#: What the GPU machine has besides the standard library (issue 15: Python 3.12 with torch,
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
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests' / 'gpu_check_env'}:{ROOT}",
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
