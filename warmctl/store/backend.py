"""The storage backend interface (restic style): a flat namespace of immutable objects.

Keys are ``/``-separated relative names (``chunks/blake3/ab/ab12...``). A backend saves whole
objects atomically (an object is either absent or complete), loads byte ranges, stats, lists
and removes. Nothing else: retries (:class:`RetryingBackend`) and caching
(:class:`warmctl.store.cache.CachingBackend`) are wrappers, verification lives in
:mod:`warmctl.store.chunkio`. What a backend is good at is declared in :class:`BackendProperties`
(restic's ``Properties``), so callers never ask which class it is.
"""

from __future__ import annotations

import abc
import heapq
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from warmctl.base.errors import IntegrityError, WarmctlError

log = logging.getLogger(__name__)


class ObjectNotFound(WarmctlError):
    """The object does not exist in the backend. ``location`` names where it was looked for."""


    def __init__(self, key: str, location: str):
        super().__init__(f"object {key!r} not found at {location}")
        self.key = key
        self.location = location


class TransientBackendError(WarmctlError):
    """A failure that may succeed when retried: connection refused/reset/closed, DNS failure,
    connect/read timeout, 5xx, throttling, a truncated body."""


class BackendUnavailable(TransientBackendError):
    """A backend kept failing transiently for longer than :class:`RetryingBackend`'s outage
    window. The message names the endpoint, the object and the last error; rerunning the
    operation later is safe (copies resume: only what is still missing is moved)."""


class RemoteTooSlow(WarmctlError):
    """A transfer with a remote (S3, an OCI registry) did not finish within its total
    deadline (:class:`TransferBound`: ``remote_deadline_floor_s`` + its size at
    ``remote_min_rate_bytes_s``): a server that trickles its answer (its head included), reads
    an upload slowly, or answers nothing, ends here instead of stretching the transfer
    without bound. The message names the operation, the object, the remote, the bytes moved and
    the seconds waited. Not retried: a retry of a trickle is one more trickle."""


#: Default ``remote_deadline_floor_s``: seconds every remote transfer may take whatever its size.
DEADLINE_FLOOR_S = 30.0
#: Default ``remote_min_rate_bytes_s``: the slowest transfer rate (bytes/s) a remote may keep.
MIN_RATE_BYTES_S = 1 << 20


@dataclass(frozen=True)
class TransferBound:
    """The total deadline of one remote transfer of ``size`` bytes: ``floor_s + size /
    min_rate`` seconds (:meth:`seconds`); the ``remote_deadline_floor_s`` and
    ``remote_min_rate_bytes_s`` settings. :meth:`start` starts a :class:`TransferClock`."""

    floor_s: float = DEADLINE_FLOOR_S
    min_rate: int = MIN_RATE_BYTES_S

    def seconds(self, size: int) -> float:
        return self.floor_s + max(0, size) / self.min_rate

    def start(self, what: str, size: int, t0: float | None = None) -> "TransferClock":
        """A clock for the transfer ``what`` (op, object and remote, for the message) of
        ``size`` bytes, started now (or at monotonic ``t0``)."""
        return TransferClock(self, what, size, time.monotonic() if t0 is None else t0)


class TransferClock:
    """The running deadline of one transfer (:meth:`TransferBound.start`). :meth:`check` after
    each piece moved raises :class:`RemoteTooSlow` once the deadline has passed; :meth:`left`
    is what remains (for clamping a socket timeout)."""

    def __init__(self, bound: TransferBound, what: str, size: int, t0: float):
        self.bound, self.what, self.size, self.t0 = bound, what, size, t0
        self.limit = bound.seconds(size)
        self.done = 0  # bytes moved at the last check

    def left(self) -> float:
        return self.t0 + self.limit - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0

    def check(self, done: int, verb: str = "received") -> None:
        self.done = done
        if self.expired():
            raise self.error(done, verb)

    def error(self, done: int, verb: str = "received", stalled: bool = False) -> RemoteTooSlow:
        """The error of this transfer past its deadline, ``done`` bytes moved (``verb``);
        ``stalled``: the request ended waiting on the server (no answer, or its head, yet)."""
        waited = time.monotonic() - self.t0
        moved = (f"stalled: no answer after {waited:.2f} s ({done:,} of {self.size:,} bytes {verb})" if stalled
                 else f"{done:,} of {self.size:,} bytes {verb} in {waited:.2f} s")
        return RemoteTooSlow(
            f"{self.what}: too slow: {moved}, over its "
            f"{self.limit:.2f} s bound (remote_deadline_floor_s {self.bound.floor_s:g} s + {self.size:,} bytes "
            f"at remote_min_rate_bytes_s {self.bound.min_rate:,} B/s); check the network path to the remote")


class DeadlineWatchdog:
    """One daemon thread (started on first use, named ``name``) that calls ``fire()`` of each
    armed watch once its ``deadline`` (monotonic seconds) has passed while it is not ``done``:
    what a remote backend uses to shut down the connection of a request still waiting at its
    :class:`TransferClock`'s deadline (a blocked read or write then returns at once), so the
    deadline covers the whole request, its answer's head included. Watches are
    :class:`TransferWatch` objects, armed by :meth:`watching`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, TransferWatch]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, w: TransferWatch) -> None:
        """Watch ``w`` until it is done (again, after its deadline moved)."""
        with self._cv:
            heapq.heappush(self._heap, (w.deadline, next(self._seq), w))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                at, _, w = self._heap[0]
                if w.done or w.deadline > at:  # finished, or re-armed later
                    heapq.heappop(self._heap)
                    continue
                wait = at - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                heapq.heappop(self._heap)
            w.fire()

    @contextmanager
    def watching(self, w: TransferWatch, tls: threading.local) -> Iterator[TransferWatch]:
        """Arm ``w`` for the block and make it ``tls.watch`` (the calling thread's watch, where the
        backend's connections look it up); on leaving, ``w`` is done (a late :meth:`TransferWatch.fire`
        does nothing) and the thread's outer watch, if any, is back."""
        outer = getattr(tls, "watch", None)
        tls.watch = w
        self.arm(w)
        try:
            yield w
        finally:
            with w.mu:
                w.done = True
            tls.watch = outer


class TransferWatch:
    """One request (or body read) under ``clock``'s deadline, watched by a :class:`DeadlineWatchdog`:
    ``fired`` says whether the deadline shut its connection down. Subclasses know the connection and
    say how in :meth:`shut_down`."""

    def __init__(self, clock: TransferClock):
        self.clock = clock
        self.fired = False
        self.done = False
        self.mu = threading.Lock()

    @property
    def deadline(self) -> float:
        """Monotonic seconds at which the watchdog fires."""
        return self.clock.t0 + self.clock.limit

    def fire(self) -> None:
        """Mark the watch fired and shut down the connection its request waits on (a blocked read
        or write returns at once); under :attr:`mu`, so a request that finished meanwhile (its
        connection perhaps back in the pool, another request's now) is left alone."""
        with self.mu:
            if self.done:
                return
            self.fired = True
            self.shut_down()

    def shut_down(self) -> None:
        """Shut down the socket of the request in flight; called under :attr:`mu`."""
        raise NotImplementedError


@dataclass(frozen=True)
class ObjectInfo:
    """An object's ``key``, ``size`` in bytes and ``mtime`` (seconds since the epoch)."""

    key: str
    size: int
    mtime: float


@dataclass(frozen=True)
class BackendProperties:
    """What a backend declares about itself (wrappers pass their inner backend's through).

    ``local``: objects are files on this host (cheap to read; a save leaves an ingest temp file
    when interrupted, see :meth:`Backend.list_tmp`). ``prefetch``: :meth:`Backend.prefetch`
    starts reading ahead, so hinting chunks before loading them pays. ``workers``: parallel
    requests that keep the backend busy, the store's default thread count (4 for a local disk:
    two cores verify what it reads; 16 for S3, whose requests each wait on a round trip).
    """

    local: bool = False
    prefetch: bool = False
    workers: int = 16


class Backend(abc.ABC):
    """A flat store of immutable objects addressed by key. Implementations are thread-safe."""

    #: see :class:`BackendProperties`; a backend overrides it when it differs from the default
    properties = BackendProperties()

    @abc.abstractmethod
    def location(self, key: str = "") -> str:
        """Human-readable place of ``key`` (a local path or ``s3://bucket/key``), for messages."""

    @abc.abstractmethod
    def save(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` (bytes or a bytes-like view) under ``key`` atomically, replacing any
        object there.

        Raises :class:`warmctl.base.errors.HostError` when the disk is full (naming the bytes
        needed), :class:`TransientBackendError` for retryable failures.
        """

    def save_sealed(self, key: str, sealed: bytes, plain: bytes | memoryview) -> None:
        """Store ``sealed``, the sealed form of ``plain`` (:class:`warmctl.store.sealed.SealedBackend`),
        under ``key``, as :meth:`save` does. A backend whose layout reads what it stores (an OCI
        registry lists the packs a manifest's chunks lie in) overrides it to read ``plain``; the
        default saves ``sealed``. Raises what :meth:`save` raises."""
        self.save(key, sealed)

    @abc.abstractmethod
    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset+length)`` of the object (to its end when ``length`` is None).

        Raises :class:`ObjectNotFound`, :class:`TransientBackendError`.
        """

    def load_into(self, key: str, buf: bytearray, limit: int | None = None) -> memoryview:
        """The whole object as a memoryview, read into ``buf`` when the backend can (no
        allocation); an object larger than ``buf`` gets a new buffer (``view.obj``). The view
        is valid until ``buf`` is reused. ``limit``: an object of more than this many bytes
        raises :class:`~warmctl.base.errors.IntegrityError` and is not read whole (a chunk object
        is never larger than its frame can be). The default reads at most ``limit + 1``
        bytes (a ranged read) and wraps them.

        Raises :class:`ObjectNotFound`, :class:`TransientBackendError`, IntegrityError.
        """
        if limit is None:
            return memoryview(self.load(key))
        info = self.stat(key)
        if info.size > limit:
            raise too_large(self.location(key), info.size, limit, "object")
        data = self.load(key, 0, info.size) if info.size else self.load(key)
        if len(data) > limit:
            raise too_large(self.location(key), len(data), limit, "object")
        return memoryview(data)

    def prefetch(self, key: str) -> None:
        """Hint that ``key`` will be loaded soon (local disk: start reading it into the page
        cache). Never raises; the default does nothing."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime of ``key``. Raises :class:`ObjectNotFound`."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (no order promised)."""

    @abc.abstractmethod
    def remove(self, key: str) -> None:
        """Delete ``key``; removing a missing object is not an error."""

    def exists(self, key: str) -> bool:
        """True when ``key`` exists."""
        try:
            self.stat(key)
        except ObjectNotFound:
            return False
        return True

    def list_tmp(self) -> Iterator[ObjectInfo]:
        """Leftovers of interrupted saves (local disk: ingest temp files), which gc deletes
        with :meth:`remove` once old. The default: none."""
        return iter(())

    def keep(self, key: str, data: bytes | memoryview) -> None:
        """The caller verified ``data``, which this thread just loaded for ``key``: a caching
        wrapper keeps a copy now (never before verification). The default does nothing."""

    def forget(self, key: str) -> bool:
        """What this thread just loaded for ``key`` failed verification: a caching wrapper
        drops its copy so the next load reads the source. Returns True when a copy was dropped
        (the next load reads something else), False when the load came from the source itself
        (the default: no copies)."""
        return False

    def endpoint(self) -> str:
        """The server this backend talks to (a URL), for messages; the default is
        :meth:`location`."""
        return self.location()

    def close(self) -> None:
        """Release connections; the default does nothing."""


def too_large(where: str, size: int, limit: int, what: str) -> IntegrityError:
    """The error for an object at ``where`` of ``size`` bytes, more than the ``limit`` a
    ``what`` may have (it is refused unread: a hostile store cannot make a reader allocate it)."""
    return IntegrityError(f"{what} {where} is {size:,} bytes, more than the {limit:,} bytes a {what} may have; "
                          "refusing to read it (the store was damaged or written by someone else)")


def load_limited(backend: Backend, key: str, limit: int, what: str) -> bytes:
    """The bytes of the small object ``key`` (a catalog entry, signature, profile record,
    manifest, lock, config: ``what``, for the message), refused unread when it is larger than
    ``limit`` bytes: its size is checked first (a stat, a HEAD on S3), then at most that many
    bytes are read (a ranged read), so memory stays bounded even for an object that grows
    meanwhile. Raises :class:`ObjectNotFound`, :class:`~warmctl.base.errors.IntegrityError` (too
    large), the backend's errors."""
    info = backend.stat(key)
    if info.size > limit:
        raise too_large(backend.location(key), info.size, limit, what)
    data = backend.load(key, 0, info.size) if info.size else backend.load(key)
    if len(data) > limit:
        raise too_large(backend.location(key), len(data), limit, what)
    return data


#: Seconds :class:`RetryingBackend` keeps retrying a remote backend that stopped answering
#: (a restarting S3 endpoint or load balancer typically needs well under a minute).
DEFAULT_OUTAGE_WINDOW = 60.0
#: A failure streak shorter than this many seconds is retried silently (isolated 503s,
#: throttling); a longer one is announced once, with its recovery.
OUTAGE_NOTICE_AFTER = 1.0


class _Peeked:
    """An iterator whose first item is fetched at construction (so :class:`RetryingBackend`'s
    retry covers the first request of a listing)."""

    def __init__(self, it: Iterator[ObjectInfo]):
        self._it = it
        try:
            self._first: list[ObjectInfo] = [next(it)]
        except StopIteration:
            self._first = []

    def __iter__(self) -> Iterator[ObjectInfo]:
        yield from self._first
        yield from self._it


class ForwardingBackend(Backend):
    """A wrapper that passes every call to ``inner`` unchanged; wrappers (retry, sealing)
    subclass it and override what they change."""

    def __init__(self, inner: Backend):
        self.inner = inner

    @property
    def properties(self) -> BackendProperties:  # type: ignore[override]
        return self.inner.properties

    def location(self, key: str = "") -> str:
        return self.inner.location(key)

    def save(self, key: str, data: bytes | memoryview) -> None:
        self.inner.save(key, data)

    def save_sealed(self, key: str, sealed: bytes, plain: bytes | memoryview) -> None:
        self.inner.save_sealed(key, sealed, plain)

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.load(key, offset, length)

    def load_into(self, key: str, buf: bytearray, limit: int | None = None) -> memoryview:
        return self.inner.load_into(key, buf, limit)

    def prefetch(self, key: str) -> None:
        self.inner.prefetch(key)

    def endpoint(self) -> str:
        return self.inner.endpoint()

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def remove(self, key: str) -> None:
        self.inner.remove(key)

    def list_tmp(self) -> Iterator[ObjectInfo]:
        return self.inner.list_tmp()

    def keep(self, key: str, data: bytes | memoryview) -> None:
        self.inner.keep(key, data)

    def forget(self, key: str) -> bool:
        return self.inner.forget(key)

    def close(self) -> None:
        self.inner.close()


class RetryingBackend(ForwardingBackend):
    """Wraps a backend: retries :class:`TransientBackendError` with jittered exponential
    backoff for up to ``window`` seconds of outage, then raises :class:`BackendUnavailable`.

    ``window``: seconds (>= 0; 0 = no retry). An outage starts at the first transient failure
    after a success; every call failing in it gives up ``window`` seconds after that (so
    parallel workers give up together), and a call failing on its own while others succeed
    (one bad object) gives up ``window`` seconds after its own first failure. A call already
    running when the window closes finishes its attempt first, so the worst case is the
    window plus one attempt (bounded by the backend's connect/read timeouts).
    ``attempts``: optional cap on tries per call (None: only the window limits).
    ``base_delay``/``max_delay``: seconds; the n-th retry waits ``min(max_delay,
    base_delay * 2**(n-1))`` times a random factor in [0.5, 1], never past the window's end
    (where one last attempt is made). ``setting``: the name of the setting that controls the
    window, quoted in the final error. ``on_retry(op, key, attempt, error)`` is called
    before each wait (for logs and tests).

    Outages are logged at WARNING once when a failure streak lasts
    :data:`OUTAGE_NOTICE_AFTER` seconds, and once when the backend answers again; single
    retries are logged at DEBUG. ``retries`` counts retries, ``outages`` announced outages.
    """

    def __init__(
        self,
        inner: Backend,
        window: float = DEFAULT_OUTAGE_WINDOW,
        attempts: int | None = None,
        base_delay: float = 0.2,
        max_delay: float = 5.0,
        on_retry: Callable[[str, str, int, Exception], None] | None = None,
        setting: str | None = None,
    ):
        if attempts is not None and attempts < 1:
            raise ValueError("attempts must be >= 1")
        if window < 0:
            raise ValueError("window must be >= 0 seconds")
        super().__init__(inner)
        self.window = window
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.on_retry = on_retry
        self.setting = setting
        self.retries = 0  # total retries made, for reports and tests
        self.outages = 0  # outages announced (each lasted >= OUTAGE_NOTICE_AFTER s)
        self._mu = threading.Lock()
        self._down_since: float | None = None  # monotonic start of the current failure streak
        self._announced = False

    def _failed(self, now: float, op: str, key: str, e: Exception) -> float:
        """Record a transient failure; returns the start of the current outage."""
        with self._mu:
            if self._down_since is None:
                self._down_since, self._announced = now, False
            since = self._down_since
            if not self._announced and now - since >= OUTAGE_NOTICE_AFTER:
                self._announced = True
                self.outages += 1
                log.warning(
                    "remote store %s not answering (%s); retrying for up to %g s",
                    self.inner.endpoint(), e, self.window,
                )
        return since

    def _answered(self) -> None:
        if self._down_since is None:  # the common case: no lock
            return
        with self._mu:
            if self._down_since is None:
                return
            if self._announced:
                log.warning(
                    "remote store %s answering again after %.1f s",
                    self.inner.endpoint(), time.monotonic() - self._down_since,
                )
            self._down_since = None

    def _call(self, op: str, key: str, fn: Callable[[], object]):
        first: float | None = None
        attempt = 0
        while True:
            attempt += 1
            try:
                result = fn()
            except TransientBackendError as e:
                now = time.monotonic()
                if first is None:
                    first = now
                since = self._failed(now, op, key, e)
                deadline = min(first, since) + self.window
                if now >= deadline or (self.attempts is not None and attempt >= self.attempts):
                    how = f"{self.setting} = {self.window:g} s" if self.setting else f"{self.window:g} s"
                    raise BackendUnavailable(
                        f"remote store {self.inner.endpoint()} unavailable: still failing after "
                        f"{now - min(first, since):.1f} s, {attempt} attempts (outage window {how}); "
                        f"last error: {e}; rerun when it answers again (copies resume where they stopped)"
                    ) from e
                self.retries += 1
                if self.on_retry:
                    self.on_retry(op, key, attempt, e)
                log.debug("retrying %s %s (attempt %d): %s", op, key, attempt, e)
                delay = min(self.max_delay, self.base_delay * (2 ** (attempt - 1))) * random.uniform(0.5, 1.0)
                time.sleep(max(0.0, min(delay, deadline - now)))
                continue
            except ObjectNotFound:
                self._answered()  # the server answered
                raise
            self._answered()
            return result

    def save(self, key: str, data: bytes | memoryview) -> None:
        self._call("save", key, lambda: self.inner.save(key, data))

    def save_sealed(self, key: str, sealed: bytes, plain: bytes | memoryview) -> None:
        self._call("save", key, lambda: self.inner.save_sealed(key, sealed, plain))

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        return self._call("load", key, lambda: self.inner.load(key, offset, length))

    def load_into(self, key: str, buf: bytearray, limit: int | None = None) -> memoryview:
        return self._call("load", key, lambda: self.inner.load_into(key, buf, limit))

    def stat(self, key: str) -> ObjectInfo:
        return self._call("stat", key, lambda: self.inner.stat(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """The inner listing, streamed (a listing of any length holds one page at a time, not
        every key, however many a hostile remote holds); a transient failure midway restarts it after the retry wait and
        skips the keys already yielded (only their names are remembered)."""
        seen: set[str] = set()
        first: float | None = None
        while True:
            it = self._call("list", prefix, lambda: _Peeked(self.inner.list(prefix)))
            try:
                for o in it:
                    if o.key not in seen:
                        seen.add(o.key)
                        yield o
                return
            except TransientBackendError as e:  # a later page failed: restart within the window
                now = time.monotonic()
                first = first if first is not None else now
                if now - first >= self.window:
                    raise BackendUnavailable(f"remote store {self.inner.endpoint()} unavailable: listing {prefix!r} "
                                             f"kept failing for {now - first:.0f} s: {e}") from e
                self.retries += 1
                time.sleep(min(self.max_delay, self.base_delay) * random.uniform(0.5, 1.0))

    def remove(self, key: str) -> None:
        self._call("remove", key, lambda: self.inner.remove(key))
