"""The README's first command on a fresh machine: ``bash scripts/demo.sh`` in a clean Debian 12
root (debootstrap, this machine's package sources, the checkout at /src), so that an install
change is tried where nothing was installed by hand (the demo failed there twice, for
``libprotobuf-dev`` and ``libnuma1``).

Opt-in, never part of a default run: it takes many minutes (debootstrap, the CRIU build, the
3.4 GB engine venv, a cold start) and needs root plus the clean-root tool
(``../shared/tools/clean-root.sh`` next to the checkout, or ``WARMCTL_CLEAN_ROOT_TOOL``). Run it
with ``bash scripts/test.sh --clean-root tests/test_clean_root.py`` (or
``WARMCTL_TEST_CLEAN_ROOT=1 pytest tests/test_clean_root.py``) before calling an install change
done. The root shares this host's network: the demo's engine binds 127.0.0.1:18000 and its
public port 127.0.0.1:8000 (the shipped ``tiny`` profile), which must be free.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [
    pytest.mark.clean_root,
    pytest.mark.skipif(os.environ.get("WARMCTL_TEST_CLEAN_ROOT") != "1",
                       reason="opt-in (many minutes, needs root and the clean-root tool): "
                              "bash scripts/test.sh --clean-root, or WARMCTL_TEST_CLEAN_ROOT=1"),
]

TOOL = Path(os.environ.get("WARMCTL_CLEAN_ROOT_TOOL") or REPO.parent / "shared" / "tools" / "clean-root.sh")

# Inside the root: keep the CA bundle the root was given (this host's: it may hold a TLS proxy's CA
# that pip needs) before install.sh's ca-certificates package rewrites it from Debian's CAs alone;
# the venv outside /src so the checkout stays as it is; stop the engine before the root goes away.
INNER = ("cp /etc/ssl/certs/ca-certificates.crt /root/host-ca.crt && export PIP_CERT=/root/host-ca.crt; "
         "bash scripts/demo.sh; rc=$?; /root/venv/bin/warmctl down tiny; exit $rc")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_demo_answers_from_the_restored_engine_in_a_clean_debian_root():
    assert os.geteuid() == 0, "the clean root needs root"
    assert TOOL.is_file(), f"clean-root tool {TOOL} not found (set WARMCTL_CLEAN_ROOT_TOOL)"
    busy = [p for p in (8000, 18000) if not _port_free(p)]
    assert not busy, f"port(s) {busy} on 127.0.0.1 in use: the demo's tiny profile needs them"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")}  # the tool forwards WARMCTL_*
    env["WARMCTL_VENV"] = "/root/venv"
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(TOOL), "--", "bash", "-c", INNER], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=3 * 3600)
    took = time.monotonic() - t0
    out = r.stdout + r.stderr
    print(f"clean-root demo: exit {r.returncode} after {took:.0f} s")
    assert r.returncode == 0, f"exit {r.returncode} after {took:.0f} s; last output:\n{out[-8000:]}"
    assert "answer: 'Paris.'" in out, out[-8000:]
    assert "tiny up (restore)" in out, out[-8000:]  # up's result: the answer came from the restored engine
