"""Copying a snapshot's content between stores by manifest digest: :func:`copy_manifest`.

Owns the copy order (chunks the destination lacks, each verified on the way, then the
manifest, then its attachments), which makes a killed copy restartable. Names travel one
layer up: :mod:`warmctl.fleet` copies catalog entries, each after the content it names.
"""

from __future__ import annotations

import logging
import time

import pydantic_core

from warmctl.errors import HostError, IntegrityError
from warmctl.manifest import ChunkRef, Manifest
from warmctl.store import chunks as ck
from warmctl.store.backend import ObjectNotFound, load_limited
from warmctl.store.chunkio import Progress, load_verified, ordered_map, thread_buffers
from warmctl.store.layout import MAX_SIGNATURE_BYTES, attachment_prefixes, manifest_key
from warmctl.store.reports import CopyReport
from warmctl.store.store import Store

log = logging.getLogger(__name__)


def copy_manifest(src: Store, dst: Store, digest: str, progress: Progress | None = None, workers: int | None = None) -> CopyReport:
    """Copy manifest ``digest`` and what it needs from ``src`` to ``dst``: chunks first (only
    those ``dst`` lacks, each verified on the way), then the manifest, then its attachments
    (signatures). Restartable: a killed copy, rerun, moves only what is still missing.

    ``progress(n)``: snapshot file bytes accounted for (copied, already present, or zero).
    Raises IntegrityError (the manifest or a source chunk is missing or corrupt), HostError
    (disk full: bytes needed named).
    """
    t0 = time.monotonic()
    data = src.get_manifest_bytes(digest)
    try:
        manifest = Manifest.from_bytes(data)
    except ValueError as e:
        raise IntegrityError(f"manifest {digest} at {src.location}: {e}") from None
    rep = CopyReport(digest=digest, logical=manifest.total_size())
    refs: dict[str, int] = {}
    zero = 0
    for f in manifest.files:
        for c in f.chunks:
            if ck.is_zero_chunk(c.digest, c.size):
                zero += c.size
            elif c.digest not in refs:
                refs[c.digest] = c.size
    rep.chunks_total = len(refs)
    what = f"{manifest.name} ({digest[:19]})"
    dst.lock_for_write(f"copy {what} from {src.location}")
    if progress and zero:
        progress(zero)
    remaining = [sum(refs.values())]

    def work(d: str) -> tuple[int, int]:
        size = refs[d]
        if dst.has_chunk(d):
            return size, 0
        blob, _ = load_verified(src.backend, ChunkRef(digest=d, size=size), thread_buffers(), f"{what} in {src.location}")
        try:
            dst.put_chunk_blob(d, blob)
        except HostError as e:
            raise HostError(f"{e}; about {remaining[0]:,} more bytes (uncompressed, at most) remain to copy for {what}") from None
        return size, len(blob)

    for size, copied in ordered_map(work, list(refs), workers or max(src.workers, dst.workers)):
        remaining[0] -= size
        if copied:
            rep.chunks_copied += 1
            rep.bytes_copied += copied
        if progress:
            progress(size)
    # Manifest bytes are copied verbatim (same digest), after every chunk is in place.
    dst.check_lock(f"copy {what}")  # LockLost: chunks seen above may be gone
    if not dst.has_manifest(digest):
        dst.put_manifest(manifest)
        if not dst.has_manifest(digest):  # pragma: no cover - would mean to_bytes is not canonical
            dst.backend.save(manifest_key(digest), data)
    # Attachments of the manifest (signatures, see warmctl.trust) travel with it.
    # Each must be what the store writes there (a small JSON object; issue 31: a "signature" that
    # was a link to /etc/shadow travelled onward): anything else is left behind, with a warning.
    for prefix in attachment_prefixes(digest):
        for o in src.backend.list(prefix):
            try:
                blob = load_limited(src.backend, o.key, MAX_SIGNATURE_BYTES, "signature")
                if not o.key.endswith(".json") or not isinstance(pydantic_core.from_json(blob), dict):
                    raise ValueError("not a JSON object named *.json")
            except ObjectNotFound:
                continue
            except (IntegrityError, ValueError) as e:
                log.warning("not copying %s with %s: %s", src.backend.location(o.key), what, str(e).splitlines()[0])
                continue
            try:
                if load_limited(dst.backend, o.key, MAX_SIGNATURE_BYTES, "signature") == blob:
                    continue
            except (ObjectNotFound, IntegrityError):
                pass
            dst.commit(o.key, blob, f"copy of {what}")
    rep.seconds = time.monotonic() - t0
    return rep
