"""What a ``warmctl`` command pays when warmctl's modules have no bytecode.

An editable install (``pip install -e``, as ``scripts/install.sh`` installs warmctl) compiles
nothing, and where ``PYTHONDONTWRITEBYTECODE=1`` (this project's hosts, many container images) no
process writes ``.pyc`` files either: every command then compiles each warmctl module it
imports. ``scripts/install.sh`` compiles them once (``compileall``). This measures, side by side
in one run, the CPU time (user + system, seconds) of short commands in fresh interpreters on two
copies of the checkout's package: one without ``__pycache__`` and one compiled; both run with
``PYTHONDONTWRITEBYTECODE=1``, so neither writes any, and with a home and config of their own in
a temporary directory, removed at the end. The installed packages (typer, pydantic, ...) read
their ``.pyc`` files on both sides.

Usage::

    python benchmarks/cli_bytecode.py [--runs 9]

Prints, per command, the best and median CPU of each side and their ratio (compiled / source).
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: short commands: every CLI start-up, a state read, a stop with nothing running, the catalog
COMMANDS = (("--help",), ("status",), ("down", "tiny"), ("ls",))


def _cpu_s(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    """CPU seconds (user + system) of one run of ``cmd``, a child waited for alone. Raises
    CalledProcessError when it does not exit 0 (a failing command is not the one measured)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=9, help="runs of each command on each side (default 9)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cli-bytecode-") as tmp:
        root = Path(tmp)
        sides = {}
        for side in ("source", "compiled"):
            shutil.copytree(REPO / "warmctl", root / side / "warmctl",
                            ignore=shutil.ignore_patterns("__pycache__"))
            sides[side] = root / side
        if not compileall.compile_dir(str(sides["compiled"] / "warmctl"), quiet=1, workers=0):
            raise SystemExit("compileall failed")
        cfg = root / "config.toml"
        cfg.write_text(f'home = "{root / "home"}"\nkeys_dir = "{root / "keys"}"\n')
        env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_") and k != "PYTHONPATH"}
        env.update(PYTHONDONTWRITEBYTECODE="1", WARMCTL_CONFIG=str(cfg))
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start; {args.runs} runs each, interleaved")
        print(f"{'command':<16} {'source best/median':>20} {'compiled best/median':>22} {'ratio (median)':>15}")
        for command in COMMANDS:
            cpu: dict[str, list[float]] = {s: [] for s in sides}
            for _ in range(args.runs):
                for side, cwd in sides.items():
                    cpu[side].append(_cpu_s([sys.executable, "-m", "warmctl", *command], {**env, "PYTHONPATH": str(cwd)}, cwd))
            best = {s: min(v) * 1000 for s, v in cpu.items()}
            med = {s: statistics.median(v) * 1000 for s, v in cpu.items()}
            print(f"{' '.join(command):<16} {best['source']:>9.0f} / {med['source']:<4.0f} ms "
                  f"{best['compiled']:>11.0f} / {med['compiled']:<4.0f} ms {med['compiled'] / med['source']:>14.2f}x")
        print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
