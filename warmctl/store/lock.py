"""Store locks (restic style): writers hold shared locks, gc holds an exclusive one.

A lock is an object ``locks/<id>`` holding JSON ``{"kind": "shared"|"exclusive", "host",
"pid", "start", "boot", "time", "purpose", "stale_after"}`` (``start``/``boot``: the holder's
start in clock ticks since boot and the boot id, :class:`warmctl.base.proc.ProcessId`). Its holder rewrites it every ``stale_after/3``
seconds. A lock is stale when not refreshed for its ``stale_after`` seconds (the holder's
lifetime, recorded in the lock; default :data:`DEFAULT_STALE_AFTER`, 120 s, or
``$WARMCTL_LOCK_STALE_S``), or when it was taken on this host by a process that no longer
exists (a killed push; its PID now another process's, or recorded in an earlier boot, counts
as gone: :func:`holder_gone`); stale locks are ignored and gc removes them.

A holder that could not refresh its lock in time (paused by SIGSTOP or a suspended VM, a
store unreachable for longer than the lifetime) has *lost* it: a gc may have judged it stale
and removed what the holder was about to reference. :meth:`Lock.check` then raises
:class:`LockLost`, and the store's writer calls it before and after each commit (manifest,
signature, catalog entry), so such a writer stops instead of naming data that may be gone.

Protocol: take = write own lock, then list the others. A writer that sees a live exclusive
lock removes its own and waits; gc that sees any other live lock removes its own and fails
with :class:`StoreLocked`. With a strongly consistent backend (local disk, S3) a push and a
gc can therefore never run at the same time.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

import pydantic_core

from warmctl.base.errors import IntegrityError, WarmctlError
from warmctl.base.proc import ProcessId, boot_id, pid_alive, start_ticks
from warmctl.store.backend import Backend, ObjectNotFound, load_limited
from warmctl.store.layout import MAX_LOCK_BYTES

log = logging.getLogger(__name__)

LOCK_PREFIX = "locks/"
#: Seconds a lock lives without a refresh, by default (the ``lock_stale_s`` setting,
#: ``$WARMCTL_LOCK_STALE_S``, sets it per store: :func:`warmctl.store.open_store`).
DEFAULT_STALE_AFTER = 120.0
#: A holder counts its lock lost once this fraction of the lifetime passed without a
#: successful refresh (a margin for the clock of the host that judges staleness).
LOST_AFTER = 5 / 6


#: A lock's recorded lifetime counts up to this many seconds (a lock claiming a longer one, or
#: a time ahead of its object's mtime by more than :data:`CLOCK_SKEW`, was not written by a
#: warmctl: a forged lock that would hold every writer off).
MAX_LIFETIME = 600.0
CLOCK_SKEW = 60.0


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


class StoreLocked(WarmctlError):
    """Another process holds a conflicting lock on the store."""


class LockLost(WarmctlError):
    """This process's store lock was not refreshed within its lifetime: a gc may have removed
    objects it relies on, so it stopped before committing anything that would reference them."""


class Lock:
    """A held lock; :meth:`release` removes it. Refreshed by a daemon thread while held;
    :meth:`check` raises :class:`LockLost` once a refresh came too late."""

    def __init__(self, backend: Backend, kind: str, purpose: str, stale_after: float):
        self.backend = backend
        self.kind = kind
        self.purpose = purpose
        self.stale_after = stale_after
        self.key = f"{LOCK_PREFIX}{uuid.uuid4().hex}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_ok = time.monotonic()  # when the body last saved was made
        self.lost: str | None = None  # why the lock was lost (sticky)
        self._last_error: BaseException | None = None

    def _body(self) -> bytes:
        return json.dumps(
            {"kind": self.kind, "host": socket.gethostname(), "pid": os.getpid(), "start": start_ticks(os.getpid()),
             "boot": boot_id(), "time": time.time(),
             "purpose": self.purpose, "stale_after": self.stale_after}
        ).encode()

    def write(self) -> None:
        t = time.monotonic()
        self.backend.save(self.key, self._body())
        self._last_ok = t

    def _late(self, now: float) -> str | None:
        gap = now - self._last_ok
        if gap <= self.stale_after * LOST_AFTER:
            return None
        why = f": last error {self._last_error}" if self._last_error else " (process paused?)"
        return f"not refreshed for {gap:.1f} s, lifetime {self.stale_after:g} s{why}"

    def check(self, what: str = "commit") -> None:
        """Raise :class:`LockLost` (naming ``what`` was stopped) if the lock was not kept alive
        continuously since it was taken; else return."""
        why = self.lost or self._late(time.monotonic())
        if why:
            self.lost = why
            raise LockLost(
                f"store {self.backend.location()}: lost the {self.kind} lock of {self.purpose} ({why}); "
                f"a gc may have removed data it relies on, so {what} was stopped and nothing was named; run it again"
            )

    def _once(self) -> Backend:
        """The backend without its retry wrapper: refreshing and releasing are best effort
        (staleness is the fallback) and must not wait out a remote store's outage window."""
        return getattr(self.backend, "inner", self.backend)

    def start_refresh(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.stale_after / 3):
                t = time.monotonic()
                why = self._late(t)
                if why:  # too late already (paused): a gc may have run; refreshing now hides nothing
                    self.lost = self.lost or why
                    return
                try:
                    self._once().save(self.key, self._body())
                    self._last_ok, self._last_error = t, None
                except Exception as e:  # noqa: BLE001 - next round retries; check() reports it if too late
                    self._last_error = e

        self._thread = threading.Thread(target=loop, name=f"warmctl-lock-{self.key}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self._once().remove(self.key)
        except Exception:  # noqa: BLE001 - a leftover lock goes stale
            pass


def holder_gone(d: dict) -> bool:
    """True if the lock body ``d``, written on a host of this name, names a process that is
    gone: its PID is not alive, or (a lock that records ``start`` in this boot) that PID is
    another process now. A lock of another boot id (an earlier boot, or another machine with
    the same host name: the two cannot be told apart) and one from before ``start`` was kept
    are judged by the PID alone, as before. False without a PID."""
    pid = d.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    start = d.get("start")
    if not isinstance(start, int) or isinstance(start, bool):
        return not pid_alive(pid)  # a lock from before start ticks were kept
    boot = d.get("boot") if isinstance(d.get("boot"), str) else None
    if boot is not None and boot != boot_id():
        return not pid_alive(pid)
    return not ProcessId(pid, 0.0, start=start, boot=boot).alive()


def describe(info: dict) -> str:
    age = time.time() - (_num(info.get("time")) or 0.0)
    return f"{info.get('kind')} lock by {info.get('purpose', '?')} (host {info.get('host')}, pid {info.get('pid')}, refreshed {age:.0f}s ago)"


def other_locks(backend: Backend, own_key: str | None, stale_after: float) -> tuple[list[dict], list[str]]:
    """(live locks other than ``own_key``, keys of stale locks). A lock is judged by the
    lifetime it records (``stale_after`` in its body), else by ``stale_after``."""
    live, stale = [], []
    host = socket.gethostname()
    now = time.time()
    for info in backend.list(LOCK_PREFIX):
        if info.key == own_key:
            continue
        try:
            d = pydantic_core.from_json(load_limited(backend, info.key, MAX_LOCK_BYTES, "store lock"))
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
        except ObjectNotFound:
            continue
        except (ValueError, IntegrityError):
            d = {"kind": "exclusive", "time": info.mtime, "purpose": "unreadable lock"}
        # The time it records counts only up to the object's own mtime (the store's clock, for a
        # lock rewritten at each refresh): a lock dated in the future is judged by its mtime.
        t = _num(d.get("time"))
        t = info.mtime if t is None or t > info.mtime + CLOCK_SKEW else max(t, info.mtime)
        future = t > now + CLOCK_SKEW  # even its object dated ahead: not a warmctl's lock
        dead = future or d.get("host") == host and holder_gone(d)
        life = _num(d.get("stale_after"))
        life = min(life, MAX_LIFETIME) if life is not None and life > 0 else stale_after
        if dead or now - t > life:
            stale.append(info.key)
        else:
            d["key"] = info.key
            live.append(d)
    return live, stale


def acquire(backend: Backend, kind: str, purpose: str, stale_after: float = DEFAULT_STALE_AFTER, wait: float = 300.0) -> Lock:
    """Take a ``kind`` lock (``shared`` or ``exclusive``) on the store behind ``backend``.

    A shared lock waits up to ``wait`` seconds for an exclusive holder to finish; an exclusive
    lock does not wait. Raises :class:`StoreLocked` naming the conflicting holder.
    """
    deadline = time.monotonic() + wait
    delay = 0.05
    announced = False
    while True:
        lock = Lock(backend, kind, purpose, stale_after)
        lock.write()
        live, _ = other_locks(backend, lock.key, stale_after)
        conflict = [d for d in live if kind == "exclusive" or d.get("kind") == "exclusive"]
        if not conflict:
            lock.start_refresh()
            return lock
        lock.release()
        if kind != "exclusive" and not announced and time.monotonic() < deadline:
            announced = True  # never a silent wait: one line naming the holder and the limit
            log.warning("store %s: waiting up to %.0f s for the %s to finish", backend.location(), wait,
                        describe(conflict[0]))
        if kind == "exclusive" or time.monotonic() > deadline:
            raise StoreLocked(
                f"store {backend.location()} is in use: {describe(conflict[0])}; "
                + ("retry when it finishes" if kind == "exclusive" else f"gave up after {wait:.0f}s")
            )
        time.sleep(delay)
        delay = min(delay * 2, 2.0)
