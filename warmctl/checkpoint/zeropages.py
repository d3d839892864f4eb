"""All-zero pages out of a CRIU image: what a restore then neither reads nor writes.

CRIU dumps every page a process has touched, including pages whose content is all zero (memory
an allocator zeroed, a buffer never filled: 1.0 of the ``tiny`` engine's 2.3 GiB here). A
``criu restore`` copies each of them from ``pages-N.img`` into a freshly faulted page: work for
nothing, since a private anonymous page that is absent from the image is a zero page when the
process first touches it. It also costs twice on a first restore of a freshly written image
copy, where the store keeps those pages as holes: the kernel allocates and zeroes a page-cache
page for each hole CRIU reads (docs/benchmarks.md, "Where a restore's seconds go on this VM").

:func:`compact` rewrites a dumped image so that such pages are absent: for each task's
``pagemap-PID.img`` and the ``pages-ID.img`` it names, the all-zero 4 KiB pages that lie in a
plain private anonymous mapping (``mm-PID.img``'s VMA status has ``VMA_ANON_PRIVATE`` and
``VMA_AREA_REGULAR`` and none of the special kinds) leave the pages file, and the pagemap's
entries are split around them. Everything else stays as CRIU wrote it: a private *file*
mapping's page (absent, it would read the file's content, not zeros), shared memory (its own
``pagemap-shmem-*`` images, not touched), the vDSO and vvar, guard pages, plugin mappings. A
task whose pagemap holds any entry that is not simply present in this image (``in_parent``,
``PE_PARENT``, or lazy pages that are not present) is left whole.

Why it is safe, in CRIU 4.2's restore (``criu/mem.c``, ``criu/uffd.c``): a private anonymous
VMA is mapped afresh and only the pagemap's pages are written into it; a VMA a child inherited
from its parent (copy-on-write) has every page the parent restored but the child's image lacks
dropped with ``MADV_DONTNEED``, which leaves a zero page; with lazy pages
(``restore_pages = "lazy"``) a fault on an address no pagemap entry covers is answered with
``UFFDIO_ZEROPAGE``. The restored engine's canary, bit for bit against the original, is the end
check of every restore.

The image format (CRIU's ``images/pagemap.proto``, ``images/mm.proto``, ``images/vma.proto``,
``criu/include/magic.h`` and ``image.h``): each image starts with two 32-bit magics, then
protobuf messages, each after its 32-bit little-endian length; a pagemap holds one
``pagemap_head`` (``pages_id``) and then ``pagemap_entry`` messages (``vaddr``,
``compat_nr_pages``, ``in_parent``, ``flags``, ``nr_pages``: 4.x writes the count in
``nr_pages`` and 0 in ``compat_nr_pages``); the pages file is the entries' pages back to back,
in entry order. The few fields needed are read and written with the protobuf wire format
directly (:mod:`warmctl.checkpoint.criuimage`), so the module needs no CRIU Python package.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from warmctl.base.errors import CheckpointError
from warmctl.checkpoint import criuimage

#: Bytes of a page in the images (x86-64 and arm64 with 4 KiB pages: what CRIU dumps there).
PAGE = 4096
_ZERO = bytes(PAGE)
#: ``pagemap_entry.flags`` (``criu/include/pagemap.h``)
PE_PARENT, PE_LAZY, PE_PRESENT = 1 << 0, 1 << 1, 1 << 2
#: ``vma_entry.status`` bits (``criu/include/image.h``)
VMA_AREA_REGULAR = 1 << 0
VMA_ANON_PRIVATE = 1 << 9
#: status bits of mappings whose pages are never dropped, whatever their content: stack guard
#: and special kernel areas, file-backed and shared memory, SysV IPC, sockets, AIO rings,
#: memfd, shadow stacks, guard regions, uprobes, plugin mappings (a GPU's), unsupported ones
_SPECIAL = ((1 << 2) | (1 << 3) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 10) | (1 << 11) | (1 << 12) | (1 << 13)
            | (1 << 14) | (1 << 15) | (1 << 16) | (1 << 17) | (1 << 27) | (1 << 31))
#: bytes of the pages file read at a time
_BLOCK = 1 << 20


@dataclass
class Compacted:
    """What :func:`compact` did to one image directory: pages (4 KiB each) the pagemaps held
    before, pages dropped, and the tasks left whole (their PIDs, with why)."""

    pages: int = 0
    dropped: int = 0
    left_whole: dict[int, str] = field(default_factory=dict)

    @property
    def bytes_dropped(self) -> int:
        return self.dropped * PAGE


def compact(images_dir: Path) -> Compacted:
    """Drop the all-zero pages of plain private anonymous mappings from the CRIU image in
    ``images_dir``, in place (see the module's text for which pages and why). Returns the
    counts. Rewrites each changed ``pages-ID.img`` in place and then its ``pagemap-PID.img``
    through a temporary file and a rename; an image interrupted half-way is inconsistent, which
    is why this runs on a snapshot's own fresh dump only (a failed or killed snapshot's images
    are removed by its teardown, never stored).

    Raises :class:`~warmctl.base.errors.CheckpointError` for an image it cannot read (a short
    or unknown record, a pagemap whose pages run past its pages file), naming the file."""
    out = Compacted()
    for pm in sorted(images_dir.glob("pagemap-*.img")):
        m = re.fullmatch(r"pagemap-(\d+)\.img", pm.name)
        if m is None:  # pagemap-shmem-*: shared memory's pages, restored as such
            continue
        pid = int(m.group(1))
        magic, head, entries = _read_pagemap(pm)
        out.pages += sum(n for _, n, _ in entries)
        why = _unsupported(entries)
        if why is None and not (images_dir / f"mm-{pid}.img").exists():
            why = "no mm image"
        if why is not None:
            out.left_whole[pid] = why
            continue
        vmas = _read_vmas(images_dir / f"mm-{pid}.img")
        pages = images_dir / f"pages-{head}.img"
        new, dropped = _compact_pages(pages, entries, vmas)
        if dropped:
            tmp = pm.with_name(pm.name + ".tmp")
            tmp.write_bytes(_pagemap_bytes(magic, head, new))
            os.replace(tmp, pm)
        out.dropped += dropped
    return out


def _unsupported(entries: list[tuple[int, int, int]]) -> str | None:
    """Why a pagemap must stay as it is, or None when every entry is simply present here."""
    for vaddr, _, flags in entries:
        if flags < 0:
            return f"entry at {vaddr:#x} is in a parent image"
        if not flags & PE_PRESENT or flags & PE_PARENT:
            return f"entry at {vaddr:#x} has flags {flags:#x}"
    return None


def _compact_pages(pages: Path, entries: list[tuple[int, int, int]],
                   vmas: list[tuple[int, int]]) -> tuple[list[tuple[int, int, int]], int]:
    """Rewrite ``pages`` in place without the droppable zero pages of ``entries`` (vaddr, page
    count, flags, in file order), whose droppable ranges are ``vmas`` (start, end: the plain
    private anonymous mappings, sorted). Returns the new entries and the pages dropped."""
    need = sum(n for _, n, _ in entries) * PAGE
    size = pages.stat().st_size
    if size < need:
        raise CheckpointError(f"{pages}: {size} bytes, but its pagemap lists {need} bytes of pages: "
                              "the CRIU image is damaged")
    new: list[tuple[int, int, int]] = []
    dropped = 0
    vi = 0
    fd = os.open(pages, os.O_RDWR)
    try:
        rpos = wpos = 0
        for vaddr, n, flags in entries:
            run_start, run_len = 0, 0  # the kept run being built (vaddr, pages)
            done = 0
            while done < n:
                k = min(n - done, _BLOCK // PAGE)
                buf = os.pread(fd, k * PAGE, rpos)
                if len(buf) != k * PAGE:
                    raise CheckpointError(f"{pages}: short read at byte {rpos}: the CRIU image is damaged")
                at, rpos = rpos, rpos + len(buf)
                keep_from = None  # start (page index in buf) of the kept stretch being copied
                for i in range(k):
                    va = vaddr + (done + i) * PAGE
                    while vi < len(vmas) and vmas[vi][1] <= va:
                        vi += 1
                    zero = (vi < len(vmas) and vmas[vi][0] <= va
                            and buf[i * PAGE:(i + 1) * PAGE] == _ZERO)
                    if zero:
                        dropped += 1
                        if keep_from is not None:
                            wpos = _move(fd, buf, keep_from * PAGE, i * PAGE, at, wpos)
                            keep_from = None
                        if run_len:
                            new.append((run_start, run_len, flags))
                            run_len = 0
                    else:
                        if keep_from is None:
                            keep_from = i
                        if not run_len:
                            run_start = va
                        run_len += 1
                if keep_from is not None:
                    wpos = _move(fd, buf, keep_from * PAGE, len(buf), at, wpos)
                done += k
            if run_len:
                new.append((run_start, run_len, flags))
        if dropped:  # CRIU writes nothing after the pages; anything there moves with them
            tail = os.pread(fd, size - rpos, rpos) if size > rpos else b""
            os.ftruncate(fd, _move(fd, tail, 0, len(tail), rpos, wpos))
    finally:
        os.close(fd)
    return new, dropped


def _move(fd: int, buf: bytes, lo: int, hi: int, at: int, pos: int) -> int:
    """``buf[lo:hi]``, read from file offset ``at`` + ``lo``, written at ``pos`` (<= that
    offset: the file only shrinks), unless it is there already; the offset after it."""
    if at + lo != pos:
        view = memoryview(buf)[lo:hi]
        p = pos
        while view:
            n = os.pwrite(fd, view, p)
            view, p = view[n:], p + n
    return pos + hi - lo


# --- CRIU's image files: length-prefixed protobuf records ----------------------------------

def _read_pagemap(path: Path) -> tuple[bytes, int, list[tuple[int, int, int]]]:
    """A pagemap's magics, its ``pages_id`` and its entries (vaddr, pages, flags; flags -1 for
    an ``in_parent`` entry)."""
    magic, recs = criuimage.records(path)
    try:
        head = criuimage.fields(recs[0])[1][0]
        entries = []
        for r in recs[1:]:
            f = criuimage.fields(r)
            n = f[5][0] if 5 in f else f[2][0]
            flags = f.get(4, [PE_PRESENT])[0]
            if f.get(3, [0])[0]:
                flags = -1
            entries.append((f[1][0], n, flags))
    except (IndexError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: not a CRIU pagemap this version reads ({e!r})") from e
    return magic, head, entries


def _pagemap_bytes(magic: bytes, head: int, entries: list[tuple[int, int, int]]) -> bytes:
    """A pagemap image as CRIU 4.x writes it (``compat_nr_pages`` 0, the count in ``nr_pages``)."""
    out = [magic, criuimage.record(criuimage.varint_field(1, head))]
    for vaddr, n, flags in entries:
        fields = ((1, vaddr), (2, 0), (4, flags), (5, n))
        out.append(criuimage.record(b"".join(criuimage.varint_field(num, v) for num, v in fields)))
    return b"".join(out)


def _read_vmas(path: Path) -> list[tuple[int, int]]:
    """(start, end) of the plain private anonymous mappings in ``mm-PID.img``, sorted."""
    _, recs = criuimage.records(path)
    try:
        out = []
        for v in criuimage.fields(recs[0]).get(14, []):
            f = criuimage.fields(v)
            status = f[7][0]
            if status & VMA_AREA_REGULAR and status & VMA_ANON_PRIVATE and not status & _SPECIAL:
                out.append((f[1][0], f[2][0]))
    except (IndexError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: not a CRIU mm image this version reads ({e!r})") from e
    return sorted(out)
