"""The fault matrix: which (remote, sealed, path, fault) cells tests/test_fault_matrix.py runs, and
what each must end in. Pure data (no pytest, no warmctl imports): the test parametrizes over
:data:`MATRIX`, and scripts/reliability_table.py writes docs/reliability.md's table from it, so
the table cannot drift from what is tested (tests/test_fault_matrix.py checks the doc).

Remotes: ``dir`` (a directory remote) and ``s3`` (moto on loopback), each ``plain`` or
``sealed`` (``warmctl seal``; the node holds the fleet key). Paths: ``push`` (node A to a fresh
remote), ``pull``, ``up`` (the image written first), ``up-stream`` (``restore_stream = auto``:
CRIU reads the image while it is written), ``verify --store REMOTE``, ``gc --store REMOTE``.
Faults, at the remote: :data:`FAULTS`.

A cell applies when the fault can happen on that path: damage to a stored object (a flipped
byte, a truncated object, another object's bytes, an object gone) is a fault of what a path
reads, so not of ``push`` (which writes: damage on its side is the local store's) nor of ``gc``
(which reads no chunk); a remote that stalls, trickles or answers 5xx is a network fault, so
only of S3 (a directory has no network); a trickle is a fault of a transfer's body, so not of
``gc`` (it moves only small listings and deletes).
"""

from __future__ import annotations

from dataclasses import dataclass

REMOTES = ("dir", "s3")
SEALS = ("plain", "sealed")
PATHS = ("push", "pull", "up", "up-stream", "verify", "gc")

#: fault -> how it is injected (the table's wording)
FAULTS = {
    "flip": "one byte flipped in the middle of a chunk object",
    "truncate": "a chunk object cut to half its length",
    "swap": "a chunk object holding another chunk's object",
    "vanish": "a chunk object deleted while the manifest names it",
    "stall": ("the endpoint accepts connections and answers nothing (tests/tcp_proxy.py); a request whose answer "
              "never starts is bounded by `s3_read_timeout_s` (3 s here), retried for `s3_outage_s`"),
    "trickle": ("the endpoint trickles its answers (reads: 64 KiB, then a byte every 0.2 s) or takes uploads "
                "slowly (20 KiB/s; tests/tcp_proxy.py); an upload that fits the socket buffers then waits for "
                "its answer, which `s3_read_timeout_s` ends, not the total deadline"),
    "5xx": "every request for a chunk (all requests for gc) answered 503 SlowDown (tests/test_store_proxy.py)",
}
DATA = ("flip", "truncate", "swap", "vanish")
NET = ("stall", "trickle", "5xx")

#: the settings every cell runs under (environment of the failing and the next run)
SETTINGS = {"WARMCTL_REMOTE_DEADLINE_FLOOR_S": "1", "WARMCTL_REMOTE_MIN_RATE_BYTES_S": str(64 << 20),
            "WARMCTL_S3_OUTAGE_S": "2", "WARMCTL_S3_READ_TIMEOUT_S": "3"}

#: seconds each failing command must end within, by fault: interpreter start and a few requests
#: on a loaded 2-core host, plus the fault's own bound (remote_deadline_floor_s 1 s + size at
#: 64 MiB/s; s3_outage_s 2 s; a stalled request: s3_read_timeout_s 3 s)
BOUND_S = {"flip": 30, "truncate": 30, "swap": 30, "vanish": 30, "stall": 30, "trickle": 30, "5xx": 30}

#: what is left after the failure, by path
LEFT = {
    "push": "remote names nothing new, every object under its final name verifies; the rerun sends only what is missing",
    "pull": "chunks committed before the fault (verified); nothing named; the rerun fetches only what is missing",
    "up": "fetched chunks committed (verified); nothing named, no process or /dev/shm file; the rerun fetches only what is missing",
    "up-stream": "as `up`",
    "verify": "nothing (read only); the rerun passes",
    "gc": "no lock object; the remote verifies; the rerun passes",
}


@dataclass(frozen=True)
class Cell:
    """One cell: ``exit`` the error class the failing command must exit with (its code:
    warmctl.base.errors.EXIT_CODES), ``says`` a word the error line must hold for the fault."""

    remote: str
    seal: str
    path: str
    fault: str
    exit: str
    says: str

    @property
    def id(self) -> str:
        return f"{self.remote}-{self.seal}-{self.path}-{self.fault}"

    @property
    def bound_s(self) -> int:
        return BOUND_S[self.fault]


def expect(path: str, fault: str) -> tuple[str, str]:
    """(error class, word the error names the fault with) of ``path`` under ``fault``."""
    if fault in DATA:
        if path == "verify":
            return "IntegrityError", "missing" if fault == "vanish" else "corrupt"
        return ("ChunkMissing", "missing") if fault == "vanish" else ("ChunkCorrupt", "corrupt")
    if fault == "trickle":
        return "RemoteTooSlow", "too slow"
    return "BackendUnavailable", "unavailable"


def applies(remote: str, path: str, fault: str) -> bool:
    if fault in DATA:
        return path not in ("push", "gc")
    if remote != "s3":
        return False
    if fault == "trickle":
        return path != "gc"
    return path != "up-stream" or fault == "5xx"


MATRIX: list[Cell] = [Cell(r, s, p, f, *expect(p, f))
                      for r in REMOTES for s in SEALS for p in PATHS for f in FAULTS if applies(r, p, f)]
