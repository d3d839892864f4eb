"""Content digests of the host files a snapshot's processes map, with a local cache.

A snapshot records ``restore.required_digests`` (``{absolute path: "<algorithm>:<hex>"}``, the
store's digest algorithm, :data:`warmctl.store.chunks.DIGEST_ALGORITHM`) for every required
file (:mod:`warmctl.checkpoint.capture`): the interpreter's and the OS's libraries the engine
maps. CRIU checks only their sizes; a library rewritten in place with other bytes of the same
size would be mapped into the restored engine as is. ``up`` compares the digests before it
writes anything.

Hashing every required file costs seconds (the ``tiny`` engine maps 154 files, 1.36 GB: 3.9 s
of BLAKE3 from the page cache on the 2-core test host), so :class:`DigestCache` keeps each
file's digest in ``<home>/cache/file-digests.json`` keyed by what a change of its bytes
changes: ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``. An unchanged host pays one
``stat`` per file; ``ctime`` cannot be set back by a user, so a rewrite that restores the
mtime still misses the cache. The file is a cache: unreadable, it is rebuilt.

In a container the required files are on its root, an overlayfs, and overlayfs gives each mount
a new anonymous device number: every pod of the same image on a node sees the same files (the
same lower-layer inodes, sizes and times) under another ``st_dev``. The key's device is 0 for
files on an overlay mount (:func:`overlay_devices`), so the pods of a node share their digests;
an inode, size or time that changes still misses. (Before, a ``tiny`` engine pod hashed the
image's 128 libraries at every start: its materialize 1.5-2.1 s against the host's 0.9 s, 1.0 s
since; docs/benchmarks.md, "The pods' materialize: the digest cache".)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from warmctl.store.chunks import DIGEST_ALGORITHM, hasher

#: Bytes read per ``read`` while hashing.
READ_SIZE = 1 << 20


def file_key(st: os.stat_result, overlays: frozenset[int] = frozenset()) -> list[int]:
    """The cache key of a file: ``[st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns]``, with
    ``st_dev`` 0 when it is one of ``overlays`` (the device numbers of overlay mounts,
    :func:`overlay_devices`: made anew at each mount)."""
    return [0 if st.st_dev in overlays else st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def overlay_devices(mountinfo: str = "/proc/self/mountinfo") -> frozenset[int]:
    """The ``st_dev`` of every overlayfs mount this process sees (``mountinfo``: proc(5)'s
    format, field 3 ``major:minor``, the type after the `` - `` separator); empty when the file
    cannot be read."""
    devs = set()
    try:
        with open(mountinfo) as f:
            for line in f:
                fields, _, rest = line.partition(" - ")
                if rest.split(" ", 1)[0] == "overlay":
                    major, _, minor = fields.split(" ")[2].partition(":")
                    devs.add(os.makedev(int(major), int(minor)))
    except (OSError, ValueError, IndexError):
        return frozenset()
    return frozenset(devs)


def hash_file(path: str | Path, algorithm: str | None = None) -> str:
    """``<algorithm>:<hex>`` of the file's bytes (default: the store's algorithm). Raises OSError."""
    algo = algorithm or DIGEST_ALGORITHM
    h = hasher(algo)
    with open(path, "rb") as f:
        while block := f.read(READ_SIZE):
            h.update(block)
    return f"{algo}:{h.hexdigest()}"


class DigestCache:
    """Digests of files by :func:`file_key`, persisted as JSON at ``path``
    (``{path: [st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns, digest]}``).

    ``hashed``: paths hashed (cache misses) since this object was made."""

    def __init__(self, path: Path | None) -> None:
        self.path = Path(path) if path else None
        self.entries: dict[str, list] = {}
        self.hashed: list[str] = []
        self._dirty = False
        self._overlays: frozenset[int] | None = None
        if self.path is not None:
            try:
                data = json.loads(self.path.read_text())
                if isinstance(data, dict):
                    self.entries = {k: v for k, v in data.items() if isinstance(v, list) and len(v) == 6}
            except (OSError, ValueError):
                self.entries = {}

    @classmethod
    def for_settings(cls, settings) -> "DigestCache":
        """The cache of a :class:`warmctl.records.config.Settings`: ``<home>/cache/file-digests.json``."""
        return cls(settings.cache_dir / "file-digests.json")

    def digest(self, path: str, st: os.stat_result | None = None, algorithm: str | None = None) -> str:
        """The digest of ``path`` (``st``: its ``os.stat``, if already taken): from the cache
        when its key still matches and the algorithm is the one asked for, else hashed (and
        cached). Raises OSError."""
        st = st or os.stat(path)
        if self._overlays is None:
            self._overlays = overlay_devices()
        key = file_key(st, self._overlays)
        hit = self.entries.get(path)
        if hit is not None and hit[:5] == key and (algorithm is None or hit[5].startswith(algorithm + ":")):
            return hit[5]
        d = hash_file(path, algorithm)
        if file_key(os.stat(path), self._overlays) == key:  # unchanged while hashed: cacheable
            self.entries[path] = [*key, d]
            self._dirty = True
        self.hashed.append(path)
        return d

    def save(self) -> None:
        """Write the cache (atomically: temp file + rename) if it changed; a failure to write is
        ignored (the next run hashes again)."""
        if self.path is None or not self._dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".file-digests.")
        except OSError:
            return
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f)
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError:
            Path(tmp).unlink(missing_ok=True)


def digests_of(paths, cache: DigestCache) -> dict[str, str]:
    """``{path: digest}`` of every path (see :meth:`DigestCache.digest`); the cache is saved.
    Raises OSError for a file that cannot be read."""
    out = {p: cache.digest(p) for p in sorted(paths)}
    cache.save()
    return out
