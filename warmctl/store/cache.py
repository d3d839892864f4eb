"""The read cache as a backend wrapper (like restic's ``internal/cache/backend.go``).

:class:`CachingBackend` puts a near backend (a local store's) in front of a remote one for
immutable, content-addressed objects (chunks): a load tries the cache first; a miss loads the
remote, and the copy is written to the cache only when the caller has verified it
(``Backend.keep``, called by :func:`warmctl.store.chunkio.load_verified`). A cached copy that
fails verification is dropped (``Backend.forget``) and the next load reads the remote, whose
verified bytes then replace it. Everything else (tags, manifests, config, locks, listings,
locations in messages) is the remote's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from warmctl.store.backend import Backend, BackendProperties, ObjectInfo, ObjectNotFound


@dataclass
class Fetched:
    """Stored (compressed) bytes of the chunks a read loaded, by where they came from:
    ``remote`` (a remote store) and ``local`` (the local store, or the local cache in front of a
    remote). Filled by :meth:`warmctl.store.Store.read_file`; thread-safe."""

    remote: int = 0
    local: int = 0
    _mu: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, where: str, n: int) -> None:
        """Count ``n`` bytes loaded from ``where`` (``"remote"`` or ``"local"``)."""
        with self._mu:
            setattr(self, where, getattr(self, where) + n)

    def as_dict(self) -> dict[str, int]:
        return {"remote": self.remote, "local": self.local}


class CachingBackend(Backend):
    """``remote`` with ``cache`` in front of it for keys under ``prefixes`` (default: chunks).

    ``before_fill()``: called before a copy is written to the cache (the cache's store takes
    its writer lock there). ``fetched``: counts the stored bytes each load took from the
    remote and from the cache. ``batch``: a :class:`~warmctl.store.local.SaveBatch` of the
    cache to put the copies in, owned by the caller (a :class:`warmctl.store.CacheFill`, whose
    commit may come later: :meth:`flush` and :meth:`discard` then leave it alone); by default
    one of its own, committed by :meth:`flush`. Keep/forget refer to the calling thread's last
    load of a key. Properties (parallelism, prefetch) are the remote's. Thread-safe.
    """

    def __init__(
        self,
        remote: Backend,
        cache: Backend,
        prefixes: tuple[str, ...] = ("chunks/",),
        before_fill: Callable[[], None] | None = None,
        fetched: Fetched | None = None,
        batch=None,
    ):
        self.remote = remote
        self.fetched = fetched
        self.cache = cache
        self.prefixes = prefixes
        self.before_fill = before_fill
        self._tls = threading.local()  # see _tried
        # a local cache is filled in one batch of fsyncs (committed by flush()), not one per chunk
        self._own = batch is None
        self._batch = batch if batch is not None else cache.batch(workers=8) if hasattr(cache, "batch") else None

    def __repr__(self) -> str:
        return f"CachingBackend({self.remote!r}, cache={self.cache!r})"

    @property
    def properties(self) -> BackendProperties:  # type: ignore[override]
        return self.remote.properties

    def _cached(self, key: str) -> bool:
        return key.startswith(self.prefixes)

    def location(self, key: str = "") -> str:
        return self.remote.location(key)

    def endpoint(self) -> str:
        return self.remote.endpoint()

    def _tried(self) -> tuple[dict[str, str], set[str]]:
        """This thread's last load of each key: ``"cache"`` or ``"remote"``, noted before the
        load is tried (so a load that raised is known by where it was tried), and the keys whose
        cached copy it dropped (their next load goes to the remote)."""
        t = self._tls
        if not hasattr(t, "source"):
            t.source, t.dropped = {}, set()
        return t.source, t.dropped

    def _from_cache(self, key: str, load: Callable[[Backend], object]):
        """``load(cache)`` for a cached key not just dropped by this thread, else
        ``load(remote)``, noting which one was tried last (for keep/forget)."""
        source, dropped = self._tried()
        if key in dropped:  # its cached copy failed verification: go to the remote
            dropped.discard(key)
        else:
            source[key] = "cache"  # a copy that cannot be read (IntegrityError) is the cache's too
            try:
                out = load(self.cache)
                self._count("local", out)
                return out
            except ObjectNotFound:
                pass
        source[key] = "remote"
        out = load(self.remote)
        self._count("remote", out)
        return out

    def _count(self, where: str, out: object) -> None:
        if self.fetched is not None:
            self.fetched.add(where, len(out))  # type: ignore[arg-type]

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if self._cached(key) and offset == 0 and length is None:  # only whole objects are kept
            return self._from_cache(key, lambda b: b.load(key))
        return self.remote.load(key, offset, length)

    def load_into(self, key: str, buf: bytearray, limit: int | None = None) -> memoryview:
        if self._cached(key):
            return self._from_cache(key, lambda b: b.load_into(key, buf, limit))
        return self.remote.load_into(key, buf, limit)

    def keep(self, key: str, data: bytes | memoryview) -> None:
        source, _ = self._tried()
        if source.pop(key, None) != "remote":  # a cache hit, or not a cached key: nothing to write
            return
        if self.before_fill is not None:
            self.before_fill()
        if self._batch is not None:
            self._batch.save(key, data)
        else:
            self.cache.save(key, data)

    def flush(self) -> int:
        """Make the copies kept since the last flush durable and visible in the cache (one
        :class:`~warmctl.store.local.SaveBatch` commit; a cache without batches saved each copy
        already). Returns how many were committed. Until then a copy is a temporary file of the
        cache's store: a second load of the same key reads the remote again. Raises OSError /
        HostError from the cache's disk. With a caller's ``batch``: nothing (0), its owner commits."""
        return self._batch.commit() if self._batch is not None and self._own else 0

    def discard(self) -> None:
        """Drop the copies kept since the last flush (their temporary files removed); with a
        caller's ``batch``: nothing, its owner decides."""
        if self._batch is not None and self._own:
            self._batch.abort()

    def forget(self, key: str) -> bool:
        """True only when this thread's last load of ``key`` was served (or tried) from the
        cache: that copy is removed and the next load reads the remote. When the bytes came
        from the remote (or the key is not cached here), the remote's own answer: nothing of
        the cache's was involved, so a retry would read the same bytes again."""
        source, dropped = self._tried()
        if source.pop(key, None) != "cache":  # the remote's own bytes failed
            return self.remote.forget(key)
        self.cache.remove(key)
        dropped.add(key)  # this thread's next load reads the remote even if removal failed
        return True

    def save(self, key: str, data: bytes | memoryview) -> None:
        self.remote.save(key, data)

    def prefetch(self, key: str) -> None:
        self.remote.prefetch(key)

    def stat(self, key: str) -> ObjectInfo:
        return self.remote.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.remote.list(prefix)

    def remove(self, key: str) -> None:
        self.remote.remove(key)
        if self._cached(key):
            self.cache.remove(key)

    def list_tmp(self) -> Iterator[ObjectInfo]:
        return self.remote.list_tmp()

    def close(self) -> None:
        self.discard()
        self.remote.close()
