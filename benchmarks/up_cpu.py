"""CPU time of the whole ``warmctl up`` process, one restore after another, in each checkout.

``benchmarks/up_imports.py`` measures the up path up to the profile load; what a change there
moves past that point (a model built at its first use, a module imported by the phase that
needs it) it cannot see. This measures the whole command instead: ``warmctl snapshot fake``
once (the two-process stand-in ``tests/fake_vllm.py``, real CRIU), then, ``--runs`` times,
interleaved across the checkouts, ``warmctl up fake --json`` (a restore from the image this
host keeps, the common ``up``) and ``warmctl down fake``. The figure is the ``up`` process's own
CPU time (user + system, ``getrusage(RUSAGE_SELF)`` at its exit; not CRIU's, the engine's or
the gate's, which are other processes), best and median.

Bytecode is compiled once beforehand into a temporary ``PYTHONPYCACHEPREFIX`` per checkout (as
an installed package has its ``.pyc`` files). The snapshot is made by the first checkout; every
checkout restores it (the manifest format is the same).

Usage (root, CRIU installed)::

    python benchmarks/up_cpu.py [--runs 7] [--repo BEFORE --repo AFTER] [--engine-port P] [--gate-port P]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import fake_env  # noqa: E402  (the fake profile and its environment)

#: Runs ``warmctl ARGS`` (``sys.argv[1:]``) as ``python -m warmctl`` does, writing the process's
#: own CPU seconds at its exit (the CLI runs ``atexit`` handlers before it ends) to ``$CPU_FILE``.
WRAPPER = """\
import atexit, os, resource, runpy, sys
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    with open(os.environ["CPU_FILE"], "w") as f:
        f.write(repr(r.ru_utime + r.ru_stime))
atexit.register(cpu)
sys.argv = ["warmctl", *sys.argv[1:]]
runpy.run_module("warmctl", run_name="__main__")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="restores per checkout (default 7)")
    ap.add_argument("--repo", type=Path, action="append", default=None,
                    help="checkout to measure (repeatable; default: this one)")
    ap.add_argument("--engine-port", type=int, default=int(os.environ.get("WARMCTL_TEST_ENGINE_PORT") or 18500))
    ap.add_argument("--gate-port", type=int, default=int(os.environ.get("WARMCTL_TEST_GATE_PORT") or 18580))
    a = ap.parse_args()
    repos = [p.resolve() for p in (a.repo or [REPO])]
    root = Path(tempfile.mkdtemp(prefix="warmctl-up-cpu-"))
    env = fake_env(root, a.engine_port, a.gate_port)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cpu_file = root / "cpu"

    def warmctl(repo: Path, *args: str) -> float:
        e = {**env, "PYTHONPATH": str(repo), "PYTHONPYCACHEPREFIX": str(root / f"pycache-{repos.index(repo)}"),
             "CPU_FILE": str(cpu_file)}
        r = subprocess.run([sys.executable, "-c", WRAPPER, *args], env=e, cwd=root, capture_output=True, text=True,
                           timeout=600)
        if r.returncode != 0:
            raise SystemExit(f"warmctl {' '.join(args)} ({repo}) exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return float(cpu_file.read_text())

    load = os.getloadavg()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} at the start")
    cpu: dict[Path, list[float]] = {r: [] for r in repos}
    try:
        warmctl(repos[0], "snapshot", "fake")
        for r in repos:  # bytecode written, the kept image made
            warmctl(r, "up", "fake", "--json")
            warmctl(r, "down", "fake")
        for _ in range(a.runs):
            for r in repos:
                cpu[r].append(warmctl(r, "up", "fake", "--json"))
                warmctl(r, "down", "fake")
    finally:
        subprocess.run([sys.executable, "-m", "warmctl", "down", "fake"], env={**env, "PYTHONPATH": str(repos[0])},
                       cwd=root, capture_output=True, timeout=300)
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n`warmctl up fake --json` (a restore from the kept image), the up process's CPU time, "
          f"best / median of {a.runs}:")
    for r in repos:
        print(f"  {r}: {min(cpu[r]) * 1e3:.0f} / {statistics.median(cpu[r]) * 1e3:.0f} ms")
    if len(repos) == 2:
        b, c = cpu[repos[0]], cpu[repos[1]]
        print(f"  second / first: best {min(c) / min(b):.2f}x, median {statistics.median(c) / statistics.median(b):.2f}x")
    end = os.getloadavg()
    print(f"load average at the end {end[0]:.2f}")


if __name__ == "__main__":
    main()
