"""Free space checked before writing: ``up`` and ``pull`` add up
what they will write on each filesystem and refuse, naming the numbers, before writing anything.

What a command will write is known from the manifest before the first byte moves: the
non-zero bytes of the image files an ``up`` writes into the image cache (all-zero chunks stay
holes), the non-zero bytes of the ``/dev/shm`` files it puts back, and the chunks a ``pull`` (or
an ``up`` from a remote store) must fetch into the local store because it does not hold them yet.
The manifest records each chunk's uncompressed size, not its stored (compressed) size, so a
chunk to fetch counts with its uncompressed size: an upper bound, exact for incompressible data
(weights) and for a store that holds everything already (nothing to fetch counts nothing).

Each need is charged to the filesystem holding its path (``st_dev`` of the nearest existing
parent); several needs on one filesystem add up. A filesystem must keep :func:`margin` bytes
free beyond them (1% of its size, at most :data:`MARGIN_MAX`): a disk filled to its last block
fails other writers (logs, state files) and slows the filesystem. Free space is ``statvfs``'s
``f_bavail`` (what an unprivileged writer may use; root's reserved blocks are not counted).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from warmctl.base.errors import HostError

#: Fraction of a filesystem's size kept free beyond what a command writes.
MARGIN_FRACTION = 0.01
#: At most this many bytes of margin (1 GiB).
MARGIN_MAX = 1 << 30


@dataclass
class Need:
    """``bytes`` a command will write under ``path`` (a file or directory, existing or not),
    and ``what`` they are (for the message)."""

    path: Path
    bytes: int
    what: str


@dataclass
class Space:
    """A filesystem: ``dev`` (``st_dev``), ``free`` and ``size`` in bytes, ``at`` the existing
    path it was measured at."""

    dev: int
    free: int
    size: int
    at: Path


def existing_parent(path: Path | str) -> Path:
    """``path`` if it exists, else its nearest existing parent."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def space(path: Path | str) -> Space:
    """The filesystem holding ``path`` (or its nearest existing parent). Raises OSError."""
    at = existing_parent(path)
    st = os.statvfs(at)
    return Space(os.stat(at).st_dev, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, at)


def margin(size: int) -> int:
    """Bytes kept free on a filesystem of ``size`` bytes: 1% of it, at most 1 GiB."""
    return min(MARGIN_MAX, int(size * MARGIN_FRACTION))


def human(n: float) -> str:
    """``n`` bytes in binary units, one decimal (``512 B``, ``1.5 GiB``, ``1,536.0 TiB``): the
    one byte formatter, for messages and the CLI's tables alike."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"


def shortfall(needs: list[Need], freed: dict[int, int] | None = None) -> list[tuple[Space, int, list[Need]]]:
    """Filesystems that cannot hold ``needs``: ``(space, missing bytes, its needs)`` for each
    whose free space, plus ``freed[dev]`` (bytes the command removes first), is less than the
    needs on it plus :func:`margin`. A path whose filesystem cannot be measured is skipped."""
    by_dev: dict[int, tuple[Space, list[Need]]] = {}
    for n in needs:
        if n.bytes <= 0:
            continue
        try:
            sp = space(n.path)
        except OSError:
            continue
        by_dev.setdefault(sp.dev, (sp, []))[1].append(n)
    out = []
    for dev, (sp, ns) in by_dev.items():
        want = sum(n.bytes for n in ns) + margin(sp.size)
        have = sp.free + (freed or {}).get(dev, 0)
        if want > have:
            out.append((sp, want - have, ns))
    return out


def require(needs: list[Need], command: str, freed: dict[int, int] | None = None, hint: str = "") -> None:
    """Raise :class:`HostError` (exit 10) when a filesystem cannot hold ``needs`` (see
    :func:`shortfall`), naming for each the path, what would be written and how much, the free
    bytes and the margin; ``command`` (``"up tiny"``) and ``hint`` (what to do) start and end
    the message. Nothing is written or removed by this check."""
    short = shortfall(needs, freed)
    if not short:
        return
    parts = []
    for sp, _, ns in short:
        need = sum(n.bytes for n in ns)
        got = (freed or {}).get(sp.dev, 0)
        freed_s = f" (+{got:,} bytes it would remove first)" if got else ""
        parts.append(f"on the filesystem of {sp.at}: needed {need:,} bytes ({human(need)}: "
                     + "; ".join(f"{n.what}: {human(n.bytes)} under {n.path}" for n in ns)
                     + f"), {sp.free:,} bytes free{freed_s}, keeping {margin(sp.size):,} bytes free")
    raise HostError(f"not enough disk space for {command}, nothing written: " + " / ".join(parts)
                    + f"; {hint or 'free space (`warmctl du` shows what takes it) and retry'}")


@dataclass
class NodeRow:
    """One snapshot on this node: the store's :class:`~warmctl.store.reports.DuRow` figures
    (``stored``, ``unique``, ``shared`` bytes of its chunks), ``image`` (bytes of its kept image,
    0 when none), ``image_in_use`` (a running engine was restored from it), and ``node``: what
    it costs here, ``unique + image`` (what removing it, then ``gc``, would free)."""

    digest: str
    name: str
    tags: list[str]
    logical: int
    stored: int
    unique: int
    shared: int
    zero: int
    image: int
    image_in_use: bool
    node: int
    missing_chunks: int = 0


@dataclass
class NodeReport:
    """:func:`node_report`: ``rows`` per snapshot in the store (and per kept image whose
    manifest the store lacks: ``name`` empty); the store's totals (``store_bytes`` in
    ``chunk_count`` chunks, ``shared_bytes`` used by more than one snapshot, ``unreferenced``);
    the kept images (``images_bytes``, their ``budget``: ``image_cache_bytes`` in bytes, None
    unlimited, and the ``budget_setting`` as configured) and the ``filesystems`` holding the
    store and the image cache (``[{"path", "free", "size"}]``, one per filesystem)."""

    rows: list[NodeRow]
    store: str
    store_bytes: int
    shared_bytes: int
    unreferenced: int
    chunk_count: int
    image_cache: str
    images_bytes: int
    budget: int | None
    budget_setting: str
    filesystems: list[dict]


def node_report(rep, store_location: str, cache, budget_setting: str = "") -> NodeReport:
    """What the local store at ``store_location`` (``rep``: its
    :func:`warmctl.store.maintenance.du`, a :class:`warmctl.store.DuReport`) and the image
    ``cache`` (:class:`warmctl.checkpoint.imagecache.ImageCache`) take on this node, per
    snapshot. Never raises for a damaged store (its missing chunks are counted in ``rep``)."""
    entries = {e.digest: e for e in cache.entries()}
    rows = []
    for r in rep.rows:
        e = entries.pop(r.digest, None)
        img = e.bytes if e else 0
        rows.append(NodeRow(r.digest, r.name, r.tags, r.logical, r.stored, r.unique, r.shared, r.zero, img,
                            bool(e and e.in_use), r.unique + img, r.missing_chunks))
    for e in entries.values():  # an image kept for a snapshot restored from a remote, its manifest not kept here
        rows.append(NodeRow(e.digest, "", [], 0, 0, 0, 0, 0, e.bytes, e.in_use, e.bytes))
    seen: set[int] = set()
    fs = []
    for p in (Path(store_location), cache.root):
        try:
            sp = space(p)
        except OSError:
            continue
        if sp.dev not in seen:
            seen.add(sp.dev)
            fs.append({"path": str(sp.at), "free": sp.free, "size": sp.size})
    return NodeReport(rows, store_location, rep.total_stored, _shared_once(rep), rep.unreferenced, rep.chunk_count,
                      str(cache.root), sum(r.image for r in rows), cache.budget, budget_setting, fs)


def _shared_once(rep) -> int:
    """Stored bytes of chunks that more than one snapshot uses, each chunk counted once."""
    return rep.total_stored - rep.unreferenced - sum(r.unique for r in rep.rows)
