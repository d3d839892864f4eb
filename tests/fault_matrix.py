"""The fault matrix: which (remote, sealed, path, fault) cells tests/test_fault_matrix.py runs, and
what each must end in. Pure data (no pytest, no warmctl imports): the test parametrizes over
:data:`MATRIX`, and scripts/reliability_table.py writes docs/reliability.md's table from it, so
the table cannot drift from what is tested (tests/test_fault_matrix.py checks the doc).

Remotes: ``dir`` (a directory remote), ``rgw`` (S3 on the real Ceph RGW on loopback,
tests/rgw_server.py) and ``oci`` (a repository of a real Distribution registry on loopback,
tests/registry_server.py: chunks in pack blobs read with ranged GETs), each ``plain`` or
``sealed`` (``warmctl seal``; the node holds the fleet key). Paths: ``push`` (node A to a fresh remote), ``pull``, ``up`` (the image written first),
``up-stream`` (``restore_stream = auto``: CRIU reads the image while it is written),
``agent-up`` (the agent's ``POST /v1/engines/NAME/up`` job), ``verify --store REMOTE``,
``gc --store REMOTE``. Faults, at the remote: :data:`FAULTS`.

A cell applies when the fault can happen on that path: damage to a stored object (a flipped
byte, a truncated object, another object's bytes, an object gone) is a fault of what a path
reads, so not of ``push`` (which writes: damage on its side is the local store's) nor of ``gc``
(which reads no chunk); an object that vanishes while its body is read, or a remote that
stalls, trickles or answers 5xx, is a network fault, so only of S3 and OCI (a directory has no network,
and a file deleted while it is read stays readable through its open descriptor); a trickle is
a fault of a transfer's body, so not of ``gc`` (it moves only small listings and deletes). A
streamed ``up`` reads the remote as ``up`` does, so it is tried under the faults of what it
reads (damage, an object gone or cut mid-read); the agent's ``up`` under :data:`AGENT_FAULTS`.
The ``up``-family cells restore one at a time (tests/test_fault_matrix.py): each one costs the
matrix's wall time, which is why these two are trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass

REMOTES = ("dir", "rgw", "oci")
SEALS = ("plain", "sealed")
PATHS = ("push", "pull", "up", "up-stream", "agent-up", "verify", "gc")

#: fault -> how it is injected (the table's wording)
FAULTS = {
    "flip": "one byte flipped in the middle of a chunk object (OCI: of the chunk's range of its pack blob)",
    "truncate": "a chunk object cut to half its length (OCI: its pack blob cut in the middle of the chunk)",
    "swap": "a chunk object holding another chunk's object (OCI: another chunk's bytes over the chunk's range, to its length)",
    "vanish": "a chunk object deleted while the manifest names it (OCI: its pack blob deleted from the registry's storage)",
    "cut": ("a chunk object deleted while its body is being read: the connection cut (RST) 4 KiB into the "
            "answer and the object deleted at that instant (tests/tcp_proxy.py's `cut`); the retry finds it gone"),
    "stall": ("the endpoint accepts connections and answers nothing (tests/tcp_proxy.py); the request ends at "
              "its total deadline (`remote_deadline_floor_s` 3 s here, shorter than `s3_read_timeout_s`), "
              "naming it and the seconds waited, not retried"),
    "trickle": ("the endpoint trickles its answers (reads: 64 KiB, then a byte every 0.2 s) or takes uploads "
                "slowly (20 KiB/s; tests/tcp_proxy.py); each request, its answer's head included, ends at its "
                "total deadline"),
    "5xx": ("every request for a chunk (OCI: a pack's ranged GETs; a push's blob uploads), all requests for gc, answered "
            "503 SlowDown (tests/test_store_proxy.py)"),
}
DATA = ("flip", "truncate", "swap", "vanish")
NET = ("cut", "stall", "trickle", "5xx")

#: the settings every cell runs under (environment of the failing and the next run)
#: (the floor leaves a real RGW on a loaded 2-core host, the cells side by side, time to answer)
SETTINGS = {"WARMCTL_REMOTE_DEADLINE_FLOOR_S": "3", "WARMCTL_REMOTE_MIN_RATE_BYTES_S": str(64 << 20),
            "WARMCTL_S3_OUTAGE_S": "2", "WARMCTL_S3_READ_TIMEOUT_S": "6"}

#: what the rerun of a CLI command (the fault lifted) runs under, over :data:`SETTINGS`: a floor
#: that leaves a loaded RGW time to answer. With the 3 s floor, two verify reruns failed at
#: load 17 on the 2-core AMD VM (2026-12-07): a stat of ``sealed.json`` got "no answer after 3.0 s"
#: from the real Ceph RGW, no fault between them. The failing run keeps the 3 s floor.
RERUN_SETTINGS = {"WARMCTL_REMOTE_DEADLINE_FLOOR_S": "30"}

#: seconds each failing command must end within, by fault: interpreter start and a few requests
#: on a loaded 2-core host (the cells run side by side), plus the fault's own bound
#: (remote_deadline_floor_s 3 s + size at 64 MiB/s; s3_outage_s 2 s). The bound tells a command
#: that ends from one that retries for ever or waits out a request's timeout (600 s); a hung
#: one is killed at twice it. On the slowest host of this kind (2-core AMD EPYC, the whole suite
#: beside it, load average up to 16) the failing commands took 2-9 s, the Ceph RGW ones up to
#: 24 s and one 32.7 s: 30 s was not enough there.
BOUND_S = {"flip": 60, "truncate": 60, "swap": 60, "vanish": 60, "cut": 60, "stall": 60, "trickle": 60, "5xx": 60}

#: what is left after the failure, by path
LEFT = {
    "push": "remote names nothing new, every object under its final name verifies; the rerun sends only what is missing",
    "pull": "chunks committed before the fault (verified); nothing named; the rerun fetches only what is missing",
    "up": "fetched chunks committed (verified); nothing named, no process or /dev/shm file; the rerun fetches only what is missing",
    "up-stream": "as `up`",
    "agent-up": "the job failed with the error; as `up`; the rerun (a new job) fetches only what is missing",
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
    if fault in DATA or fault == "cut":
        gone = fault in ("vanish", "cut")
        if path == "verify":
            return "IntegrityError", "missing" if gone else "corrupt"
        return ("ChunkMissing", "missing") if gone else ("ChunkCorrupt", "corrupt")
    if fault in ("stall", "trickle"):
        return "RemoteTooSlow", "too slow"
    return "BackendUnavailable", "unavailable"


#: the faults the agent's ``up`` is tried under: it runs the same ``up`` in its own process, so
#: one damage, one object cut and gone mid-read and one outage show its job's reporting (the
#: ``up``-family cells restore one at a time: each costs the matrix's wall time)
AGENT_FAULTS = ("flip", "cut", "stall")


def applies(remote: str, path: str, fault: str) -> bool:
    if path == "agent-up" and fault not in AGENT_FAULTS:
        return False
    if fault in DATA:
        return path not in ("push", "gc")
    if remote == "dir":
        return False
    if fault == "cut":
        return path not in ("push", "gc")
    if fault == "trickle":
        return path not in ("gc", "up-stream")
    return path != "up-stream"  # a streamed up reads the remote as `up` does: its own faults are data


MATRIX: list[Cell] = [Cell(r, s, p, f, *expect(p, f))
                      for r in REMOTES for s in SEALS for p in PATHS for f in FAULTS if applies(r, p, f)]
