"""Imported at interpreter start when this directory is on PYTHONPATH: a process whose command
line names ``$WARMCTL_FAKE_CUDA_PROCESS`` (a script's file name) becomes a CUDA process of the
fake driver (RUNNING on GPU 0, holding ``$WARMCTL_FAKE_CUDA_PROCESS_BYTES``), as the real driver
knows every process that creates a context. It registers as
``$WARMCTL_FAKE_CUDA_DIR/procs/ns-<its PID namespace's inode>-<its PID there>``: in its own PID
and mount namespaces (as warmctl starts engines) its ``/proc`` does not show its host PID; the
fake driver renames the file to ``procs/<host pid>`` at its next lookup. Used by
tests/test_gpu_bench.py for the benchmark's holders."""

import os

_script = os.environ.get("WARMCTL_FAKE_CUDA_PROCESS")
_dir = os.environ.get("WARMCTL_FAKE_CUDA_DIR")
if _script and _dir:
    with open("/proc/self/cmdline", "rb") as _f:
        _argv = _f.read().split(b"\0")
    if any(os.path.basename(a.decode(errors="replace")) == _script for a in _argv):
        _name = f"ns-{os.stat('/proc/self/ns/pid').st_ino}-{os.getpid()}"
        _nbytes = int(os.environ.get("WARMCTL_FAKE_CUDA_PROCESS_BYTES", str(1 << 30)))
        with open(os.path.join(_dir, "procs", _name), "w") as _f:
            _f.write(f"0 0 {_nbytes} 0\n")
