"""Imported at interpreter start when this directory is on PYTHONPATH: a process whose command
line names ``$WARMCTL_FAKE_CUDA_PROCESS`` (a script's file name) becomes a CUDA process of the
fake driver (``$WARMCTL_FAKE_CUDA_DIR/procs/<host pid>``: RUNNING on GPU 0, holding
``$WARMCTL_FAKE_CUDA_PROCESS_BYTES``), as the real driver knows every process that creates a
context. The host PID is the first of ``/proc/self/status``'s ``NSpid`` (the process may be
the first of its own PID namespace). Used by tests/test_gpu_bench.py for the benchmark's holders."""

import os

_script = os.environ.get("WARMCTL_FAKE_CUDA_PROCESS")
_dir = os.environ.get("WARMCTL_FAKE_CUDA_DIR")
if _script and _dir:
    with open("/proc/self/cmdline", "rb") as _f:
        _argv = _f.read().split(b"\0")
    if any(os.path.basename(a.decode(errors="replace")) == _script for a in _argv):
        with open("/proc/self/status") as _f:
            _host_pid = next(int(line.split()[1]) for line in _f if line.startswith("NSpid:"))
        _nbytes = int(os.environ.get("WARMCTL_FAKE_CUDA_PROCESS_BYTES", str(1 << 30)))
        with open(os.path.join(_dir, "procs", str(_host_pid)), "w") as _f:
            _f.write(f"0 0 {_nbytes} 0\n")
