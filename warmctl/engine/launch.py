"""Exec a command so that CRIU can later checkpoint its whole process tree.

:func:`command` is how warmctl starts an engine::

    unshare --pid --fork [--mount-proc] setsid python -m warmctl.engine.launch --stdio LOG -- COMMAND...

- ``unshare --pid --fork``: the tree lives in its own PID namespace, so a restore does not need
  the original host PIDs to be free. The namespace's PID 1 (this module, then ``COMMAND``) is
  the dump root.
- ``--mount-proc``, for CUDA engines only (``checkpoint.cuda`` profiles): the tree has its own
  mount namespace with a ``/proc`` of its own PID namespace, so ``getpid()`` and ``/proc/self``
  agree inside it. CUDA needs that: under ``unshare --pid`` alone, with the host's ``/proc``,
  the first CUDA call fails with error 304 ("OS call failed or operation not supported on this
  OS"; driver 580.159.04, H200, torch 2.11, measured 2026-12-04; ``nvidia-smi`` still works).
  CRIU then dumps the mount namespace, every mount in it but ``/`` and ``/proc`` as external
  (:func:`warmctl.checkpoint.criu.mount_flags`), and a restore recreates the dump host's mount
  layout, each mount bound from the restoring host's path of that name
  (:func:`warmctl.checkpoint.criu.restore_mount_flags`): a path that is on a mount of its own
  only on the restoring host is seen as what lies under that mount there. CPU engines keep the
  host's mount namespace, so their restore depends on no mount of the dump host.
- ``setsid``: the tree has its own session, so CRIU finds no outside session or terminal.
- ``--stdio LOG``: stdin ``/dev/null`` and stdout and stderr appended to ``LOG``, opened by the
  tree itself, inside its mount namespace where it has one (CRIU cannot place a descriptor
  opened through a mount outside it: ``Can't lookup mount=N for fd=0``). The file must exist
  at restore.

Then, before ``exec``, this module installs a
seccomp filter under which ``io_uring_setup(2)`` fails with ``ENOSYS``. The filter is inherited
by every child and survives a CRIU dump/restore. Why: uvloop's libuv always creates an
io_uring, and CRIU cannot dump io_uring instances; when the syscall is missing, libuv falls back
to epoll (verified on kernel 6.18, see ``docs/design.md``, "Making a vLLM tree checkpointable").

The filter is a classic-BPF program (``seccomp(2)``, ``SECCOMP_MODE_FILTER``): load the audit
architecture; if it is x86-64 or AArch64 and the syscall number is 425 (``io_uring_setup`` in
both tables), return ``SECCOMP_RET_ERRNO | ENOSYS``; allow everything else.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
ENOSYS = 38
NR_IO_URING_SETUP = 425
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_RET_K = 0x06


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def io_uring_block_filter(machine: str | None = None) -> bytes:
    """The BPF program (bytes of ``struct sock_filter[6]``) for ``machine`` (default: this one).

    Raises RuntimeError on an architecture whose audit constant is not known here.
    """
    machine = machine or os.uname().machine
    if machine not in AUDIT_ARCH:
        raise RuntimeError(f"io_uring seccomp filter: unsupported architecture {machine}")
    return b"".join(
        [
            _insn(_BPF_LD_W_ABS, 0, 0, 4),  # A = seccomp_data.arch
            _insn(_BPF_JEQ_K, 0, 3, AUDIT_ARCH[machine]),  # other arch -> allow
            _insn(_BPF_LD_W_ABS, 0, 0, 0),  # A = seccomp_data.nr
            _insn(_BPF_JEQ_K, 0, 1, NR_IO_URING_SETUP),
            _insn(_BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),
            _insn(_BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        ]
    )


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def block_io_uring() -> None:
    """Install the filter in this process. Raises OSError if the kernel refuses it."""
    libc = ctypes.CDLL(None, use_errno=True)
    prog_bytes = io_uring_block_filter()
    buf = ctypes.create_string_buffer(prog_bytes, len(prog_bytes))
    prog = _SockFprog(len(prog_bytes) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")


#: the programs between the caller and this module in :func:`command`, in order
WRAPPERS = ("unshare", "setsid")


def command(inner: list[str], log_path: str | os.PathLike[str], python: str | None = None, *,
            mount_proc: bool = False) -> list[str]:
    """The argv that starts ``inner`` checkpointable (see the module docstring), its stdin
    ``/dev/null`` and its output appended to ``log_path``. ``python``: the interpreter that runs
    this module (default: this one). ``mount_proc``: its own mount namespace and ``/proc``, which
    CUDA needs. Needs util-linux's ``unshare`` and ``setsid`` on ``PATH``."""
    return ["unshare", "--pid", "--fork", *(["--mount-proc"] if mount_proc else []), "setsid",
            python or sys.executable, "-m", "warmctl.engine.launch", "--stdio", str(log_path), "--", *inner]


def redirect_stdio(log_path: str | os.PathLike[str]) -> None:
    """Make fd 0 ``/dev/null`` and fds 1 and 2 ``log_path`` (created, appended), opened here."""
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for src, fd in ((null, 0), (log, 1), (log, 2)):
        os.dup2(src, fd)
    for fd in {null, log} - {0, 1, 2}:
        os.close(fd)


USAGE = "usage: python -m warmctl.engine.launch [--stdio LOG] -- COMMAND [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    log = None
    if argv[:1] == ["--stdio"]:
        if len(argv) < 2:
            sys.exit(USAGE)
        log, argv = argv[1], argv[2:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.exit(USAGE)
    if log is not None:
        redirect_stdio(log)
    block_io_uring()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
