"""Build and drive the fake NVIDIA driver (``fake_libcuda.c``) for tests.

:func:`build` compiles, with the system ``cc``, into a directory:
``full/libcuda.so.1`` (checkpoint API, r580-like), ``old/libcuda.so.1`` (no checkpoint symbols,
like a driver before 570) and ``bin/cuda-checkpoint`` (the utility stand-in, linked to ``full``).
:class:`FakeDriver` owns one state directory: GPUs, CUDA processes (real child processes of the
test), injected rules, and the event log written by the library.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
STATE_NAMES = {0: "RUNNING", 1: "LOCKED", 2: "CHECKPOINTED", 3: "FAILED"}


@dataclass
class Built:
    full: Path
    old: Path
    cli: Path


def build(out: Path) -> Built:
    """Compile the fake driver into ``out``. Raises CalledProcessError with the compiler's output."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on this machine")
    src = HERE / "fake_libcuda.c"
    (out / "full").mkdir(parents=True, exist_ok=True)
    (out / "old").mkdir(exist_ok=True)
    (out / "bin").mkdir(exist_ok=True)
    full = out / "full" / "libcuda.so.1"
    old = out / "old" / "libcuda.so.1"
    cli = out / "bin" / "cuda-checkpoint"
    run = lambda *a: subprocess.run([cc, *map(str, a)], check=True, capture_output=True, text=True)  # noqa: E731
    run("-O1", "-Wall", "-Werror", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", full, src)
    run("-O1", "-Wall", "-Wno-unused-function", "-shared", "-fPIC", "-DFAKE_NO_CHECKPOINT_API",
        "-Wl,-soname,libcuda.so.1", "-o", old, src)
    run("-O1", "-Wall", "-Werror", "-o", cli, HERE / "cuda_checkpoint_cli.c",
        f"-L{full.parent}", "-l:libcuda.so.1", f"-Wl,-rpath,{full.parent}")
    return Built(full, old, cli)


# A rank: maps a "device file" (so /proc/PID/maps shows it) when given one, then waits.
RANK_CODE = """
import mmap, sys, time
keep = []
for path in sys.argv[1:]:
    f = open(path, "r+b")
    keep.append(mmap.mmap(f.fileno(), 4096))
    keep.append(f)
print("ready", flush=True)
time.sleep(600)
"""


class FakeDriver:
    """One fake host: GPUs and CUDA processes in ``root`` (exported as WARMCTL_FAKE_CUDA_DIR)."""

    def __init__(self, root: Path, built: Built):
        self.root = root
        self.built = built
        (root / "procs").mkdir(parents=True, exist_ok=True)
        (root / "dev").mkdir(exist_ok=True)
        self.children: list[subprocess.Popen] = []
        self.gpu_uuids: list[str] = []

    # -- setup
    def add_gpu(self, uuid: str, total_bytes: int) -> str:
        with open(self.root / "gpus", "a") as f:
            f.write(f"{uuid} {total_bytes}\n")
        self.gpu_uuids.append(uuid)
        return uuid

    def register(self, pid: int, gpu: int, nbytes: int, state: int = 0) -> None:
        (self.root / "procs" / str(pid)).write_text(f"{state} {gpu} {nbytes} 0\n")

    def spawn(self, map_device: bool = False) -> subprocess.Popen:
        args = [sys.executable, "-c", RANK_CODE]
        if map_device:
            dev = self.root / "dev" / "nvidia0"
            if not dev.exists():
                dev.write_bytes(b"\0" * 4096)
            args.append(str(dev))
        p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        self.children.append(p)
        return p

    def spawn_rank(self, gpu: int, nbytes: int, map_device: bool = False) -> int:
        p = self.spawn(map_device)
        self.register(p.pid, gpu, nbytes)
        return p.pid

    def control(self, *lines: str) -> None:
        (self.root / "control").write_text("".join(line + "\n" for line in lines))

    # -- observation
    def proc(self, pid: int) -> dict:
        st, gpu, nbytes, poisoned = (self.root / "procs" / str(pid)).read_text().split()
        return {"state": STATE_NAMES[int(st)], "gpu": int(gpu), "bytes": int(nbytes), "poisoned": poisoned == "1"}

    def state(self, pid: int) -> str:
        return self.proc(pid)["state"]

    def events(self, op: str | None = None) -> list[tuple[int, str, str, int, int]]:
        """(monotonic_ns, begin|end, op, pid, rc) in the order written."""
        path = self.root / "events"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            t, what, o, pid, rc = line.split()
            if op is None or o == op:
                out.append((int(t), what, o, int(pid), int(rc)))
        return out

    def close(self) -> None:
        for p in self.children:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()


def wait_dead(pid: int, timeout: float = 5.0) -> bool:
    """True once ``pid`` no longer exists or is a zombie."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def env_for(driver: FakeDriver) -> dict[str, str]:
    return {"WARMCTL_FAKE_CUDA_DIR": str(driver.root)}


__all__ = ["Built", "FakeDriver", "build", "env_for", "wait_dead", "os"]
