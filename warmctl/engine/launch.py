"""Exec a command so that CRIU can later checkpoint its whole process tree.

Run as ``python -m warmctl.engine.launch -- COMMAND...``. Before ``exec`` it installs a
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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m warmctl.engine.launch -- COMMAND [ARGS...]")
    block_io_uring()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
