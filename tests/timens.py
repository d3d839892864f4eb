"""Run a command in a new time namespace whose ``CLOCK_BOOTTIME`` is ``OFFSET`` seconds ahead:
``python tests/timens.py OFFSET -- ARGV...`` (root; Linux >= 5.6).

Inside it the boot instant is ``OFFSET`` seconds earlier, so ``/proc/stat``'s whole-second
``btime`` loses another fraction: psutil's creation times there are off by
:func:`boot_fraction` of it (a host whose boot time's fraction is near 1 s, made from
any host, with no hook in warmctl). Every process the command starts shares the namespace.
``unshare --boottime`` takes whole seconds only, hence this. Exits with the command's status
(a command killed by a signal kills this the same way).
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import subprocess
import sys
import time

CLONE_NEWTIME = 0x80


def boot_fraction() -> float:
    """The fraction of a second psutil's creation times lose on this host (or namespace)."""
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return boot - math.floor(boot)


def offset_for(fraction: float) -> float:
    """The ``CLOCK_BOOTTIME`` offset (seconds, in [0, 1)) that makes :func:`boot_fraction` read
    ``fraction`` inside a namespace made from this one."""
    return (boot_fraction() - fraction) % 1.0


def main(argv: list[str]) -> int:
    off = float(argv[0])
    cmd = argv[argv.index("--") + 1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWTIME) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unshare(CLONE_NEWTIME): {os.strerror(e)}")
    sec = math.floor(off)
    with open("/proc/self/timens_offsets", "w") as f:  # before the namespace's first process
        f.write(f"boottime {sec} {round((off - sec) * 1e9)}\n")
    rc = subprocess.call(cmd)
    if rc < 0:
        if -rc not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
