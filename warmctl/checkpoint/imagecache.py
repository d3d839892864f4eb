"""Verified CRIU images kept between ``up``\\ s of one snapshot.

Without this, every ``up`` rewrote the whole CRIU image (2.7 GiB for ``tiny``) from the store
into a run directory, restored from it and deleted it: seconds of copying and hashing per
``up``, and a freshly written image whose dirty pages the kernel writes back while CRIU reads
them. A snapshot's image is fixed by its manifest digest, so it only needs writing once per
host.

Layout (``<home>/cache/images``, created mode 0700, owned by the user running warmctl: root)::

    <root>/<algorithm>-<hex>/      one entry per manifest digest (``sha256:ab..`` -> ``sha256-ab..``)
        images/                    the manifest's ``image`` files (CRIU's image directory)
        weights/                   its ``weights`` files (loaded into the engine after restore)
        shm/                       its ``/dev/shm`` files, copied to /dev/shm at every restore
        verified.json              written last: digest, and (size, mtime_ns, inode) per file
        used.json                  last use: {"seq": n, "at": unix seconds}, rewritten on reuse
    <root>/.partial-*              an entry being written (removed on failure, swept after 1 h)

An entry is *verified once, when written*: every chunk is checked against its digest by
:meth:`warmctl.store.Store.read_file` on the way in, the files are made read-only, the marker
written, and the directory renamed into place (so a crash never leaves an entry that looks
complete). On reuse the entry is trusted only if its marker names the same digest, every file
still has the size, mtime and inode recorded at write time, and neither the root nor the entry
is writable by anyone but its owner (then nobody but root changed it, and not through a normal
write); anything else removes the entry and the image is written again.

``/dev/shm`` files are put back for every ``up`` (the restored tree changes them), but from a
verified copy in the entry (``shm/``), copied region by region so their holes stay holes
(:meth:`ImageCache.put_back_shm`: 400 MiB with 80 MiB of data for ``tiny`` in ~80 ms, where
decompressing and verifying them from the store took 200-500 ms). Bundled files are written
back from the store when missing or changed, as before.

Budget: the entries may take :attr:`ImageCache.budget` bytes on disk (allocated
blocks: holes count nothing; the ``image_cache_bytes`` setting, by default half the filesystem
holding the cache). Before an entry is written, the least recently used entries are removed
until it fits; an entry in use by a running engine of this home (its state names the digest
and its tree is alive: a lazily restored engine reads its image until its last page is copied)
is never removed, nor the one being written. Last use is recorded in ``<entry>/used.json`` on
every reuse, with a sequence number one above the newest (the order does not depend on the
clock or on mtimes, which ``touch``, copies and clock steps change). An image larger than the
budget (every image when the budget is 0: "keep no image") is written outside the cache, into
the run directory of the engine restored from it (``scratch``), and removed once the restore
no longer needs it (:meth:`ImageCache.release`).

Free space: before writing, the bytes the entry takes (the non-zero bytes of its files) and the
caller's other needs (``also``: chunks fetched into the local store, ``/dev/shm``) are checked
against the filesystems' free space (:mod:`warmctl.diskspace`); when the disk cannot hold them
within the budget, more unused entries are removed (oldest first) if that is enough, else
nothing is removed or written and :class:`HostError` names the numbers.

``warmctl gc`` (of the local store) removes entries whose manifest that store no longer holds
(unused for longer than its ``--grace``);
``warmctl du`` reports the space each snapshot takes on this node, kept image included.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from warmctl.base.errors import HostError
from warmctl.records.manifest import Manifest
from warmctl.base.proc import pid_alive
from warmctl.store import chunks as ck

if TYPE_CHECKING:
    from warmctl import diskspace

#: Version of ``verified.json``.
MARKER_FORMAT = 1
MARKER = "verified.json"
#: Last use of an entry (see module doc).
USED = "used.json"
#: A ``.partial-*`` directory older than this is left over from a crash and is removed.
PARTIAL_STALE_S = 3600.0
#: Roles kept in an entry, and the subdirectory each goes to.
CACHED_ROLES = {"image": "images", "weights": "weights", "shm": "shm"}


def entry_name(digest: str) -> str:
    """Directory name of the entry for manifest ``digest`` (``sha256:<hex>`` -> ``sha256-<hex>``).
    Raises :class:`ValueError` for a digest that is not ``<algorithm>:<hex>``."""
    alg, _, hexpart = digest.partition(":")
    if not alg.isalnum() or not hexpart or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not a manifest digest: {digest!r}")
    return f"{alg}-{hexpart}"


@dataclass
class CachedImage:
    """A usable entry: ``images`` is CRIU's image directory, ``weights`` the weights directory
    (may not exist when the snapshot has no weights files). ``written``: True if this call
    wrote it (False: reused). ``kept``: False when it was written outside the cache (larger
    than the budget, or a budget of 0), ``not_kept`` then says why; :meth:`ImageCache.release`
    removes such an image. ``evicted``: entries removed to make room for it."""

    digest: str
    path: Path
    written: bool
    kept: bool = True
    not_kept: str = ""
    evicted: list = None  # type: ignore[assignment]

    @property
    def images(self) -> Path:
        return self.path / "images"

    @property
    def weights(self) -> Path:
        return self.path / "weights"


@dataclass
class CacheEntry:
    """One entry as listed by :meth:`ImageCache.entries`: ``bytes`` on disk (allocated blocks,
    so holes count as nothing), ``last_used`` (Unix seconds), ``valid`` (marker readable),
    ``seq`` (use order: higher is more recent; 0 for an entry never marked), ``in_use`` (a
    running engine of this home was restored from it)."""

    digest: str
    path: Path
    bytes: int
    last_used: float
    valid: bool
    seq: int = 0
    in_use: bool = False


def _cached_files(m: Manifest) -> list:
    return [f for f in m.files if f.role in CACHED_ROLES]


def image_bytes(m: Manifest) -> int:
    """Bytes an entry of ``m`` takes once written: the non-zero chunks of its image, weights and
    shm files (zero chunks stay holes; hard links take nothing)."""
    return sum(c.size for f in _cached_files(m) if f.hardlink_to is None for c in f.chunks
               if not ck.is_zero_chunk(c.digest, c.size))


def live_digests(run_dir: Path) -> set[str]:
    """Manifest digests of the engines of ``run_dir`` whose tree is alive (their entries are in use)."""
    from warmctl.records.state import all_states

    return {st.manifest_digest for st in all_states(run_dir) if st.manifest_digest and st.engine_alive()}


def entry_sizes(m: Manifest) -> dict[str, int]:
    """Each file an entry of ``m`` writes (not its hard links), by its name in the entry
    (``images/pages-4.img``, ``shm/psm_1a2b``), with its size in bytes: what
    :class:`warmctl.checkpoint.stream.ImageStreamer` serves while :meth:`ImageCache.get` writes."""
    return {_rel(f): f.size for f in _cached_files(m) if f.hardlink_to is None}


def _rel(f) -> str:
    sub = CACHED_ROLES[f.role]
    # weights entries are stored under their base name (warmctl.engine.sleep loads by rank file)
    return f"{sub}/{Path(f.path).name}" if f.role == "weights" else f"{sub}/{f.path}"


def _owner_only(path: Path) -> str | None:
    """None if ``path`` is a directory owned by us and writable by nobody else; else why not."""
    try:
        st = path.lstat()
    except OSError as e:
        return f"{path}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class ImageWatch(Protocol):
    """A reader of an entry being written (see :meth:`ImageCache.get`): ``opened(rel, tmp)``
    once the file ``rel`` (relative to the entry, e.g. ``images/pages-4.img``) exists at its
    full size at ``tmp`` (open it there: it is renamed later); ``written(rel, end)`` each time
    its bytes ``[0, end)`` are verified and written."""

    def opened(self, rel: str, tmp: Path) -> None: ...

    def written(self, rel: str, end: int) -> None: ...


class _RelWatch:
    """:class:`warmctl.store.chunkio.FileWatch` by index -> :class:`ImageWatch` by entry name."""

    def __init__(self, watch: ImageWatch, rels: list[str]):
        self.watch, self.rels = watch, rels

    def opened(self, index: int, tmp: Path) -> None:
        self.watch.opened(self.rels[index], tmp)

    def written(self, index: int, end: int) -> None:
        self.watch.written(self.rels[index], end)


class ImageCache:
    """The image cache under ``root`` (see module doc). ``budget``: bytes its entries may take
    (None: no limit; 0: keep none, :meth:`get` then writes the image outside the cache and
    :meth:`release` removes it). ``in_use``: digests whose entries a running engine uses (never
    removed), asked before each removal."""

    def __init__(self, root: Path, budget: int | None = None, in_use: Callable[[], set[str]] | None = None):
        self.root = Path(root)
        self.budget = budget
        self.in_use = in_use or (lambda: set())

    @classmethod
    def for_settings(cls, settings) -> "ImageCache":
        """The cache of a :class:`warmctl.records.config.Settings`: ``<home>/cache/images``, its budget
        ``image_cache_bytes`` (:meth:`~warmctl.records.config.Settings.image_cache_budget`), in use: the
        live engines of ``<home>/run``."""
        run_dir = settings.run_dir
        return cls(Path(settings.home) / "cache" / "images", budget=settings.image_cache_budget(),
                   in_use=lambda: live_digests(run_dir))

    # -- reading -------------------------------------------------------------------------

    def _ensure_root(self) -> None:
        """Create the root 0700; raise :class:`HostError` if it exists with looser rights or
        another owner (a cache others can write would let them change what root restores)."""
        if not self.root.exists():
            self.root.mkdir(parents=True, mode=0o700)
            os.chmod(self.root, 0o700)
        problem = _owner_only(self.root)
        if problem:
            raise HostError(f"image cache {self.root} is unsafe: {problem}; remove it or fix its owner and mode (0700)")

    def lookup(self, m: Manifest, digest: str) -> CachedImage | None:
        """The verified entry of ``digest`` if it is intact (see module doc); an entry that is
        not is removed and None returned. Marks the entry used (its marker's mtime)."""
        path = self.root / entry_name(digest)
        if not path.exists() or _owner_only(self.root):
            return None
        why = self._invalid(path, m, digest)
        if why:
            shutil.rmtree(path, ignore_errors=True)
            return None
        self._mark_used(path)
        return CachedImage(digest, path, written=False)

    def _mark_used(self, path: Path) -> None:
        """Record a use of the entry at ``path``: ``used.json`` with the next sequence number."""
        seq = max((e.seq for e in self.entries()), default=0) + 1
        tmp = path / f".{USED}.{os.getpid()}"
        tmp.write_text(json.dumps({"seq": seq, "at": time.time()}))
        os.replace(tmp, path / USED)

    def _invalid(self, path: Path, m: Manifest, digest: str) -> str | None:
        problem = _owner_only(path)
        if problem:
            return problem
        try:
            marker = json.loads((path / MARKER).read_text())
        except (OSError, ValueError) as e:
            return f"marker unreadable: {e}"
        if marker.get("format") != MARKER_FORMAT or marker.get("manifest") != digest:
            return "marker names another manifest or format"
        files: dict = marker.get("files", {})
        if set(files) != {_rel(f) for f in _cached_files(m)}:
            return "entry's file list differs from the manifest"
        for rel, rec in files.items():
            try:
                st = (path / rel).stat()
            except OSError:
                return f"{rel} missing"
            if [st.st_size, st.st_mtime_ns, st.st_ino] != rec:
                return f"{rel} changed since it was verified"
        return None

    # -- writing -------------------------------------------------------------------------

    def get(self, store, m: Manifest, digest: str, progress: Callable[[int], None] | None = None,
            cache=None, fetched=None, also: "Iterable[diskspace.Need] | Callable[[], Iterable[diskspace.Need]]" = (),
            scratch: Path | None = None,
            command: str = "", fill=None, watch: "ImageWatch | None" = None) -> CachedImage:
        """The entry of ``digest``: reused if intact, else written from ``store`` (every chunk
        verified; ``cache``: the local store that keeps chunks read from a remote ``store``;
        ``fetched``: counts the stored bytes loaded from each, as in ``read_file``).
        ``progress(n)``: bytes written (or, for a reused entry, skipped) since the last call.

        First, unused entries over the budget are removed (a budget lowered since; with a budget
        of 0 every unused entry, this digest's too, so it is written and not kept). Before
        writing, room is made within the budget (least recently used entries not in
        use removed) and the free space checked for the entry and ``also`` (the caller's other
        writes, :mod:`warmctl.diskspace`; a callable is called only when the entry is written,
        never for a reused one), removing more unused entries if that is enough; an
        image that does not fit the budget at all is written to ``scratch`` (default: a
        ``.unkept-*`` directory in the root) and not kept. ``command`` names the command in a
        refusal. ``fill``: a :class:`warmctl.store.CacheFill` of ``cache``, in which the fetched
        chunks are left uncommitted for the caller (else they are committed before this returns).
        The caller holds the host's CRIU lock (two writers of one entry never race).
        ``watch``: told of each file's progress while an entry is written (:class:`ImageWatch`,
        files named as in the entry, e.g. ``images/pages-4.img``; ``/dev/shm`` files first), so
        a reader (:class:`warmctl.checkpoint.stream.ImageStreamer`) can serve them before the
        entry is complete; not called for a reused entry.

        Raises :class:`IntegrityError` on a bad chunk, :class:`HostError` when the cache root is
        unsafe or the disk cannot hold what will be written (then nothing was removed or
        written); on any failure no partial entry is left.
        """
        self._ensure_root()
        if self.budget is not None:  # a budget lowered since (0: keep none): unused entries over it go first
            self.prune(protect={digest} if self.budget else ())
        hit = self.lookup(m, digest)
        if hit is not None:
            if progress:
                progress(sum(f.size for f in _cached_files(m) if f.hardlink_to is None))
            return hit
        from warmctl import diskspace  # only to write an entry (a reused one needs none)

        self._sweep_partials()
        need = image_bytes(m)
        keep = self.budget is None or (self.budget > 0 and need <= self.budget)
        not_kept = "" if keep else (
            "the image cache keeps no image (image_cache_bytes = 0)" if self.budget == 0 else
            f"the image ({diskspace.human(need)}) is larger than the image cache's budget "
            f"(image_cache_bytes: {diskspace.human(self.budget or 0)})")
        if keep:
            tmp = self.root / f".partial-{entry_name(digest)}-{os.getpid()}"
        else:
            tmp = Path(scratch) if scratch is not None else self.root / f".unkept-{entry_name(digest)}-{os.getpid()}"
        evict = self._make_room(need, [diskspace.Need(tmp.parent, need, f"image of {m.name} ({digest[:19]})"),
                                       *(also() if callable(also) else also)], protect={digest} if keep else set(), within_budget=keep,
                                command=command or f"the image of {m.name} ({digest[:19]})")
        for e in evict:
            shutil.rmtree(e.path, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700, parents=True)
        try:
            for sub in set(CACHED_ROLES.values()):
                (tmp / sub).mkdir(mode=0o700)
            # /dev/shm files first (a streamed restore puts them back before CRIU starts), then
            # CRIU's small metadata files, then its pages files, which CRIU reads last
            whole = sorted((f for f in _cached_files(m) if f.hardlink_to is None),
                           key=lambda f: (f.role != "shm", Path(f.path).name.startswith("pages-")))
            # every file's chunks through one pool: no drain between the image's hundred files
            store.read_files([(f.chunks, tmp / _rel(f)) for f in whole], progress=progress, cache=cache, fetched=fetched,
                             fill=fill, watch=None if watch is None else _RelWatch(watch, [_rel(f) for f in whole]))
            for f in whole:
                os.chmod(tmp / _rel(f), f.mode & 0o555)  # read-only: CRIU and the weights loader only read
            for f in _cached_files(m):
                if f.hardlink_to is not None:
                    dest = tmp / _rel(f)
                    os.link(dest.parent / f.hardlink_to, dest)
            if not keep:
                return CachedImage(digest, tmp, written=True, kept=False, not_kept=not_kept, evicted=evict)
            files = {}
            for f in _cached_files(m):
                st = (tmp / _rel(f)).stat()
                files[_rel(f)] = [st.st_size, st.st_mtime_ns, st.st_ino]
            marker = tmp / MARKER
            marker.write_text(json.dumps({"format": MARKER_FORMAT, "manifest": digest, "files": files,
                                          "verified_at": time.time()}))
            final = self.root / entry_name(digest)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._mark_used(final)
        return CachedImage(digest, final, written=True, evicted=evict)

    def _make_room(self, need: int, needs: list, protect: set[str], within_budget: bool,
                   command: str) -> list[CacheEntry]:
        """The entries to remove before writing an entry of ``need`` bytes (see :meth:`get`):
        with ``within_budget``, least recently used first until the cache and ``need`` fit the
        budget; then more, oldest first, while the disk cannot hold ``needs``. Never an entry in
        ``protect`` or in use. Raises :class:`HostError` (:func:`warmctl.diskspace.require`)
        when even removing every such entry would not be enough; nothing is removed here."""
        from warmctl import diskspace

        busy = self.in_use() | protect
        entries = self.entries()
        candidates = [e for e in reversed(entries) if e.digest not in busy]  # oldest first
        evict: list[CacheEntry] = []
        if within_budget and self.budget is not None:
            total = sum(e.bytes for e in entries if e.digest not in protect)
            while candidates and total + need > self.budget:
                e = candidates.pop(0)
                evict.append(e)
                total -= e.bytes
        try:
            dev = os.stat(self.root).st_dev
        except OSError:
            dev = -1
        freed = {dev: sum(e.bytes for e in evict)}
        while candidates and diskspace.shortfall(needs, freed):
            e = candidates.pop(0)
            evict.append(e)
            freed[dev] += e.bytes
        held = [e for e in entries if e.digest in busy]
        kept_note = "" if not held else (
            f"; {len(held)} kept image(s) in {self.root} ({diskspace.human(sum(e.bytes for e in held))}) "
            "are in use by running engines and stay")
        diskspace.require(needs, command, freed,
                          hint="free space (`warmctl du` shows what takes it) or lower image_cache_bytes, and retry"
                          + kept_note)
        return evict

    def put_back_shm(self, img: "CachedImage | Callable[[str], Path]", m: Manifest,
                     shm_dir: Path = Path("/dev/shm")) -> list[Path]:
        """Copy the snapshot's ``/dev/shm`` files from ``img`` (an entry, or a function giving
        where to read each file by its name in the entry, e.g. ``shm/psm_1a2b``: an entry still
        being written, :meth:`warmctl.checkpoint.stream.ImageStreamer.wait`) into ``shm_dir``
        (data regions only: holes stay holes; ``hardlink_to`` entries as hard links, as CRIU's
        link_remap files must be). Returns the paths written. Raises :class:`HostError` if one
        exists already (another restore of this snapshot is running); on any failure the files
        written so far are removed."""
        source = (lambda rel: img.path / rel) if isinstance(img, CachedImage) else img
        written: list[Path] = []
        try:
            for f in sorted((f for f in m.files if f.role == "shm"), key=lambda f: f.hardlink_to is not None):
                dest = shm_dir / f.path
                if f.hardlink_to is not None:
                    os.link(shm_dir / f.hardlink_to, dest)
                else:
                    _sparse_copy(source(_rel(f)), dest, f.mode)
                written.append(dest)
        except FileExistsError as e:
            for p in written:
                p.unlink(missing_ok=True)
            raise HostError(f"{e.filename} exists already: another restore of this snapshot is running on this "
                            "host; `warmctl down` it first") from None
        except BaseException:
            for p in written:
                p.unlink(missing_ok=True)
            raise
        return written

    def release(self, img: CachedImage, busy: bool = False) -> None:
        """Done restoring from ``img``: an image not kept (:attr:`CachedImage.kept` False) is
        removed, unless ``busy`` (a lazy restore's daemon still reads it: the engine's teardown
        removes it with its run directory)."""
        if not img.kept and not busy:
            shutil.rmtree(img.path, ignore_errors=True)

    # -- housekeeping --------------------------------------------------------------------

    def _sweep_partials(self) -> None:
        now = time.time()
        for p in [*self.root.glob(".partial-*"), *self.root.glob(".unkept-*")]:
            try:
                if now - p.stat().st_mtime > PARTIAL_STALE_S or not pid_alive(int(p.name.rsplit("-", 1)[1])):
                    shutil.rmtree(p, ignore_errors=True)
            except (OSError, ValueError):
                continue

    def entries(self) -> list[CacheEntry]:
        """Every entry, most recently used first (by ``used.json``'s sequence number, then by
        the time of last use; an entry never marked by its marker's mtime)."""
        out: list[CacheEntry] = []
        if not self.root.is_dir():
            return out
        try:
            busy = self.in_use()
        except Exception:  # noqa: BLE001 - a listing never fails for a bad state file
            busy = set()
        for p in self.root.iterdir():
            if p.name.startswith(".") or not p.is_dir():
                continue
            alg, _, hexpart = p.name.partition("-")
            marker = p / MARKER
            try:
                used, valid = marker.stat().st_mtime, True
            except OSError:
                used, valid = p.stat().st_mtime, False
            seq = 0
            try:
                rec = json.loads((p / USED).read_text())
                seq, used = int(rec["seq"]), float(rec["at"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
            digest = f"{alg}:{hexpart}"
            out.append(CacheEntry(digest, p, _disk_bytes(p), used, valid, seq, digest in busy))
        out.sort(key=lambda e: (e.seq, e.last_used), reverse=True)
        return out

    def prune(self, keep_digests: Iterable[str] | None = None, protect: Iterable[str] = (),
              unused_for: float = 0.0, dry_run: bool = False) -> list[CacheEntry]:
        """Remove entries: the least recently used while the cache is over its :attr:`budget`,
        those without a readable marker, and (when ``keep_digests`` is given: ``warmctl gc``)
        those whose digest is not in it and that were not used for ``unused_for`` seconds (an
        ``up`` from a remote catalog keeps no manifest in the local store); never those in
        ``protect`` or in use by a running engine. Returns what was (or, with ``dry_run``,
        would be) removed."""
        keep_set = None if keep_digests is None else set(keep_digests)
        entries = self.entries()
        busy = set(protect) | {e.digest for e in entries if e.in_use}
        removed = []
        now = time.time()
        for e in entries:
            if e.digest in busy:
                continue
            orphan = keep_set is not None and e.digest not in keep_set and now - e.last_used >= unused_for
            if orphan or not e.valid:
                removed.append(e)
        total = sum(e.bytes for e in entries if e not in removed)
        if self.budget is not None:
            for e in reversed(entries):  # oldest first
                if total <= self.budget:
                    break
                if e.digest in busy or e in removed:
                    continue
                removed.append(e)
                total -= e.bytes
        if not dry_run:
            for e in removed:
                shutil.rmtree(e.path, ignore_errors=True)
        return removed

    def du(self) -> int:
        """Bytes the cache takes on disk (allocated blocks)."""
        return sum(e.bytes for e in self.entries())


def _sparse_copy(src: Path, dest: Path, mode: int) -> None:
    """Copy ``src`` to a new file ``dest`` (``O_EXCL``), only its data regions
    (``SEEK_DATA``/``SEEK_HOLE``, ``sendfile``); the rest stays a hole of the same size."""
    fi = os.open(src, os.O_RDONLY)
    created = False
    try:
        fo = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode & 0o777)
        created = True
        try:
            size = os.fstat(fi).st_size
            os.ftruncate(fo, size)
            off = 0
            while off < size:
                try:
                    data = os.lseek(fi, off, os.SEEK_DATA)
                except OSError:  # ENXIO: only a hole is left
                    break
                end = os.lseek(fi, data, os.SEEK_HOLE)
                os.lseek(fo, data, os.SEEK_SET)
                pos = data
                while pos < end:
                    n = os.sendfile(fo, fi, pos, end - pos)
                    if n == 0:
                        raise OSError(f"{src} shrank while being copied")
                    pos += n
                off = end
            os.fchmod(fo, mode & 0o777)
        finally:
            os.close(fo)
    except BaseException:
        if created:  # never a file that was there before
            dest.unlink(missing_ok=True)
        raise
    finally:
        os.close(fi)


def _disk_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                continue
    return total
