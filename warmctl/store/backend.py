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
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from warmctl.errors import WarmctlError

log = logging.getLogger(__name__)


class ObjectNotFound(WarmctlError):
    """The object does not exist in the backend. ``location`` names where it was looked for."""

    exit_code = 5

    def __init__(self, key: str, location: str):
        super().__init__(f"object {key!r} not found at {location}")
        self.key = key
        self.location = location


class TransientBackendError(WarmctlError):
    """A failure that may succeed when retried (connection reset, 5xx, throttling, short read)."""


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

        Raises :class:`warmctl.errors.HostError` when the disk is full (naming the bytes
        needed), :class:`TransientBackendError` for retryable failures.
        """

    @abc.abstractmethod
    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset+length)`` of the object (to its end when ``length`` is None).

        Raises :class:`ObjectNotFound`, :class:`TransientBackendError`.
        """

    def load_into(self, key: str, buf: bytearray) -> memoryview:
        """The whole object as a memoryview, read into ``buf`` when the backend can (no
        allocation); an object larger than ``buf`` gets a new buffer (``view.obj``). The view
        is valid until ``buf`` is reused. The default loads and wraps the bytes.

        Raises :class:`ObjectNotFound`, :class:`TransientBackendError`.
        """
        return memoryview(self.load(key))

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

    def close(self) -> None:
        """Release connections; the default does nothing."""


class RetryingBackend(Backend):
    """Wraps a backend: retries :class:`TransientBackendError` with jittered exponential backoff.

    ``attempts``: total tries per call (>= 1). ``base_delay``/``max_delay``: seconds; the n-th
    retry waits ``min(max_delay, base_delay * 2**n)`` times a random factor in [0.5, 1].
    ``on_retry(op, key, attempt, error)`` is called before each wait (for logs and tests).
    """

    def __init__(
        self,
        inner: Backend,
        attempts: int = 6,
        base_delay: float = 0.2,
        max_delay: float = 10.0,
        on_retry: Callable[[str, str, int, Exception], None] | None = None,
    ):
        if attempts < 1:
            raise ValueError("attempts must be >= 1")
        self.inner = inner
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.on_retry = on_retry
        self.retries = 0  # total retries made, for reports and tests

    def _call(self, op: str, key: str, fn: Callable[[], object]):
        for attempt in range(self.attempts):
            try:
                return fn()
            except TransientBackendError as e:
                if attempt + 1 >= self.attempts:
                    raise TransientBackendError(
                        f"{op} {self.inner.location(key)} failed after {self.attempts} attempts: {e}"
                    ) from e
                self.retries += 1
                if self.on_retry:
                    self.on_retry(op, key, attempt + 1, e)
                log.warning("retrying %s %s (attempt %d): %s", op, key, attempt + 1, e)
                delay = min(self.max_delay, self.base_delay * (2**attempt))
                time.sleep(delay * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")

    @property
    def properties(self) -> BackendProperties:  # type: ignore[override]
        return self.inner.properties

    def location(self, key: str = "") -> str:
        return self.inner.location(key)

    def save(self, key: str, data: bytes | memoryview) -> None:
        self._call("save", key, lambda: self.inner.save(key, data))

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        return self._call("load", key, lambda: self.inner.load(key, offset, length))  # type: ignore[return-value]

    def load_into(self, key: str, buf: bytearray) -> memoryview:
        return self._call("load", key, lambda: self.inner.load_into(key, buf))  # type: ignore[return-value]

    def prefetch(self, key: str) -> None:
        self.inner.prefetch(key)

    def stat(self, key: str) -> ObjectInfo:
        return self._call("stat", key, lambda: self.inner.stat(key))  # type: ignore[return-value]

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Listing is materialised so a retry restarts cleanly rather than yielding duplicates.
        return iter(self._call("list", prefix, lambda: list(self.inner.list(prefix))))  # type: ignore[arg-type]

    def remove(self, key: str) -> None:
        self._call("remove", key, lambda: self.inner.remove(key))

    def list_tmp(self) -> Iterator[ObjectInfo]:
        return self.inner.list_tmp()

    def keep(self, key: str, data: bytes | memoryview) -> None:
        self.inner.keep(key, data)

    def forget(self, key: str) -> bool:
        return self.inner.forget(key)

    def close(self) -> None:
        self.inner.close()
