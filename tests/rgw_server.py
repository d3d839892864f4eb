"""A throwaway one-node Ceph cluster with an RGW (S3 API) on loopback, for tests and benchmarks.

    from rgw_server import start_rgw
    from ports import free_port       # tests/ is on sys.path under pytest
    with start_rgw(workdir, mon_port, rgw_port) as (endpoint_url, access_key, secret_key):
        boto3.client("s3", endpoint_url=endpoint_url, ...)

Scripts outside pytest load it by path (``importlib.util.spec_from_file_location``) or put
``tests/`` on ``sys.path``. Uses Debian 12's Ceph 16.2 binaries (``scripts/install-test-services.sh``):
``monmaptool``, ``ceph-authtool``, ``ceph-mon``, ``ceph-osd``, ``radosgw``, ``ceph``,
``radosgw-admin``.

The cluster: one mon (msgr v2 on 127.0.0.1:``mon_port``), one memstore OSD (RAM only, 1 GiB),
radosgw with the beast frontend on 127.0.0.1:``rgw_port``, and **cephx** with keys generated
into ``workdir/keyring`` (``mon.``, ``client.admin``, ``osd.0``, ``client.rgw.t``), as in a
production deployment. Everything (config, keyring, mon store, logs) lives under ``workdir``;
nothing is written to /etc/ceph or /var/lib/ceph. Start-up takes about 10 s on 2 cores.

Why not ``auth none``: radosgw (unlike the other daemons and the ``ceph`` CLI) changes two
defaults before reading its config -- ``ms_mon_client_mode = secure`` and
``auth_client_required = cephx`` (``rgw_main.cc``). With auth none the mon can only offer the
``crc`` connection mode, so radosgw finds no usable mode and loops on ``send_auth_request
get_initial_auth_request returned -13`` (EACCES). Auth none works only with
``ms_mon_client_mode = crc`` as well; cephx needs no such override.

Every daemon runs in the foreground (``-f``) as a child of the caller, is killed by pid and
reaped when the context exits (also when start-up fails), and gets SIGKILL from the kernel if
the thread that started it dies (``PR_SET_PDEATHSIG``), so an interrupted test run leaves no
ceph process behind. A daemon that exits or does not come up within ``timeout`` raises
:class:`RGWStartError` with the tail of its log.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BINARIES = ("monmaptool", "ceph-authtool", "ceph-mon", "ceph-osd", "radosgw", "ceph", "radosgw-admin")
ACCESS_KEY, SECRET_KEY = "warmctltest", "warmctltestsecret"
RGW_NAME = "client.rgw.t"

CONF = """[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
mon initial members = a
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = {d}/keyring
ms bind ipv6 = false
public addr = 127.0.0.1
run dir = {d}/run
admin socket = {d}/run/$name.asok
log file = {d}/log/$name.log
log to stderr = false
err to stderr = true
mon data = {d}/mon/$cluster-$id
osd data = {d}/osd/$cluster-$id
{objectstore_conf}
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
osd max object name len = 460
osd max object namespace len = 64
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim allowed = false
mon data avail warn = 1
mon data avail crit = 0
# mon commands (each rgw pool is several) commit after paxos_propose_interval, 1 s by default
paxos propose interval = 0.05
paxos min wait = 0.01

[{rgw_name}]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw data = {d}/rgw
rgw enable usage log = false
rgw thread pool size = 16
"""

# (entity, caps) written into the one keyring that every daemon and client here reads
KEYS = (
    ("mon.", ("mon", "allow *")),
    ("client.admin", ("mon", "allow *", "osd", "allow *", "mgr", "allow *")),
    ("osd.0", ("mon", "allow profile osd", "mgr", "allow profile osd", "osd", "allow *")),
    (RGW_NAME, ("mon", "allow rw", "osd", "allow rwx", "mgr", "allow rw")),
)


class RGWStartError(RuntimeError):
    """The cluster or radosgw did not come up; the message carries the relevant log tails."""


def missing_binaries() -> list[str]:
    """The ceph binaries this module needs that are not on PATH."""
    return [b for b in BINARIES if shutil.which(b) is None]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"  ({path}: no such file)"
    return "\n".join(f"  {ln}" for ln in text.splitlines()[-lines:]) or f"  ({path}: empty)"


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Cluster:
    def __init__(self, workdir: Path, mon_port: int, rgw_port: int):
        self.d, self.mon_port, self.rgw_port = workdir, mon_port, rgw_port
        self.conf = workdir / "ceph.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    def log(self, name: str) -> Path:
        return self.d / "log" / f"{name}.log"

    def run(self, *argv: str, timeout: float = 30) -> str:
        try:
            r = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            self.check_alive()
            raise RGWStartError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s{self.tails()}") from e
        if r.returncode != 0:
            self.check_alive()  # a daemon that died is the better explanation
            raise RGWStartError(f"`{' '.join(argv)}` exited {r.returncode}:\n{(r.stderr or r.stdout).strip()[-2000:]}{self.tails()}")
        return r.stdout

    def spawn(self, name: str, *argv: str) -> None:
        out = open(self.d / "log" / f"{name}.stderr", "wb")  # noqa: SIM115 - the child keeps it
        try:
            self.procs[name] = subprocess.Popen(
                [*argv, "-f", "-c", str(self.conf)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent, close_fds=True,  # noqa: PLW1509 - only prctl, resolved before fork
            )
        finally:
            out.close()

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RGWStartError(
                    f"{name} (pid {p.pid}) exited with status {p.returncode} during start-up\n"
                    f"{self.log(name)}:\n{_tail(self.log(name))}\n"
                    f"{self.d / 'log' / (name + '.stderr')}:\n{_tail(self.d / 'log' / (name + '.stderr'), 10)}"
                )

    def tails(self) -> str:
        return "".join(f"\n{self.log(n)}:\n{_tail(self.log(n), 12)}" for n in ("mon.a", "osd.0", RGW_NAME) if self.log(n).exists())

    def wait_port(self, port: int, what: str, deadline: float) -> None:
        while not _port_open(port):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RGWStartError(f"{what} is not listening on 127.0.0.1:{port} after the start-up timeout{self.tails()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM in reverse start order (the OSD tells the mon it is going down and waits for
        its answer), SIGKILL whatever has not exited 3 s later; reap each."""
        for p in reversed(list(self.procs.values())):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _objectstore_conf(objectstore: str, capacity_bytes: int) -> str:
    if objectstore == "memstore":
        return f"osd objectstore = memstore\nmemstore device bytes = {int(capacity_bytes)}"
    if objectstore == "bluestore":  # one sparse file as the block device; small caches
        return ("osd objectstore = bluestore\nbluestore block create = true\n"
                f"bluestore block size = {int(capacity_bytes)}\nbluestore fsck on mkfs = false\n"
                "osd memory target = 1073741824\nbluestore cache autotune = false\nbluestore cache size = 268435456")
    raise ValueError(f"objectstore {objectstore!r}: memstore or bluestore")


@contextmanager
def start_rgw(workdir: Path, mon_port: int, rgw_port: int, timeout: float = 60.0,
              capacity_bytes: int = 1 << 30, objectstore: str = "memstore") -> Iterator[tuple[str, str, str]]:
    """Start mon, memstore OSD and radosgw under ``workdir`` (created; should be empty) and
    yield ``(endpoint_url, access_key, secret_key)`` of an S3 user with no buckets.

    Every daemon started is stopped (SIGTERM, then SIGKILL after 3 s) and reaped on exit, also
    when start-up fails. ``capacity_bytes``: the OSD's capacity (default 1 GiB); ``objectstore``:
    ``memstore`` (the default: objects held in RAM) or ``bluestore`` (on a sparse file under
    ``workdir``, for more data than RAM; caches capped at 256 MiB).
    Raises :class:`RGWStartError` (with log tails) when a step fails, a
    daemon exits, or radosgw does not listen within ``timeout`` seconds; RuntimeError when a
    binary is missing.
    """
    missing = missing_binaries()
    if missing:
        raise RuntimeError(f"ceph binaries missing: {', '.join(missing)} (run scripts/install-test-services.sh)")
    for port in (mon_port, rgw_port):
        if _port_open(port):
            raise RGWStartError(f"127.0.0.1:{port} is already in use (another RGW test or service?): pick free ports")
    workdir = Path(workdir).resolve()
    for sub in ("mon", "osd/ceph-0", "run", "log", "rgw"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    fsid = str(uuid.uuid4())
    c = _Cluster(workdir, mon_port, rgw_port)
    c.conf.write_text(CONF.format(fsid=fsid, mon_port=mon_port, rgw_port=rgw_port, rgw_name=RGW_NAME, d=workdir,
                                    objectstore_conf=_objectstore_conf(objectstore, capacity_bytes)))
    deadline = time.monotonic() + timeout
    keyring = str(workdir / "keyring")
    try:
        for i, (entity, caps) in enumerate(KEYS):
            cap_args = [a for k, v in zip(caps[::2], caps[1::2]) for a in ("--cap", k, v)]
            c.run("ceph-authtool", *(["--create-keyring"] if i == 0 else []), keyring, "--gen-key", "-n", entity, *cap_args)
        os.chmod(keyring, 0o600)
        monmap = str(workdir / "monmap")
        c.run("monmaptool", "--create", "--add", "a", f"v2:127.0.0.1:{mon_port}", "--fsid", fsid, monmap)
        c.run("ceph-mon", "-c", str(c.conf), "--mkfs", "-i", "a", "--monmap", monmap, "--keyring", keyring)
        c.spawn("mon.a", "ceph-mon", "-i", "a")
        c.wait_port(mon_port, "ceph-mon", deadline)
        osd_id = c.run("ceph", "-c", str(c.conf), "--connect-timeout", "20", "osd", "create", timeout=30).strip()
        if osd_id != "0":
            raise RGWStartError(f"`ceph osd create` returned id {osd_id!r}, expected 0 on a fresh cluster")
        c.run("ceph-osd", "-c", str(c.conf), "-i", "0", "--mkfs")
        c.spawn("osd.0", "ceph-osd", "-i", "0")
        c.spawn(RGW_NAME, "radosgw", "-n", RGW_NAME)  # waits for the OSD by itself, creates its pools
        c.wait_port(rgw_port, "radosgw", deadline)
        c.run(
            "radosgw-admin", "-c", str(c.conf), "user", "create", "--uid", "warmctl", "--display-name", "warmctl",
            "--access-key", ACCESS_KEY, "--secret", SECRET_KEY,
            timeout=max(10.0, deadline - time.monotonic()),
        )
        yield f"http://127.0.0.1:{rgw_port}", ACCESS_KEY, SECRET_KEY
    finally:
        c.stop()
