"""Named snapshots between stores: ``push``, ``pull``, and what ``up`` keeps from a remote.

A fleet shares one remote store (a directory, ``s3://bucket/prefix`` or ``oci://HOST/REPO``); every node has its own
local store. What moves is always a catalog entry *with* everything it names, in the store
format's write order (``docs/store-format.md``, section 6): the chunks the destination lacks
(each verified on the way), then the manifest, then its signatures, then the catalog entry
(:meth:`warmctl.naming.catalog.Catalog.add`, which also moves the tag when it replaces an entry for the
same kind of host) and the profile record. A node that reads the destination's catalog
therefore never sees a name whose data is not all there; a killed copy, rerun, moves only what is
still missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from warmctl import diskspace
from warmctl.base import faults
from warmctl.naming.catalog import Accepted, Catalog, CatalogEntry, DriverPolicy, Ref, Rejection, entry_key, nothing_fits, select
from warmctl.records.config import Settings
from warmctl.base.errors import SnapshotNotFound, WarmctlError
from warmctl.host import HostFingerprint, fingerprint
from warmctl.records.manifest import Manifest
from warmctl.store import CopyReport, Store, copy_manifest, open_store
from warmctl.naming.trust import EntrySignatures, check_entry, load_trusted_keys, sign_entry, verify_manifest

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


@dataclass
class Copied:
    """One catalog entry copied to the destination, and what moving its data cost."""

    entry: CatalogEntry
    report: CopyReport


def copy_entry(src: Store, dst: Store, entry: CatalogEntry, progress: Progress | None = None, *,
               keys_dir: str | Path | None = None, signer: str | Path | None = None) -> Copied:
    """Copy ``entry`` and everything it names from ``src`` to ``dst`` (see the module doc): the
    chunks, the manifest and its signatures, then the entry's own signatures and the entry, and
    the profile record from the (digest-checked) manifest. ``signer`` (``push`` on a publisher
    with ``signing_key``): an entry that has no signatures (written by a warmctl before entries
    were signed) is signed with it on the way, so nodes accept it.

    ``keys_dir``: trusted keys; given, nothing is named in ``dst`` unless a trusted key signed
    the entry (checked before anything is copied) and the manifest as it now lies in ``dst``
    (checked after the copy, before the name is written): what ``pull`` and ``up`` do, so that
    nothing unsigned is ever named locally. ``progress(n)``: snapshot file bytes accounted for.
    Raises :class:`warmctl.naming.trust.TrustError` (``keys_dir``: unsigned or untrusted),
    :class:`warmctl.base.errors.IntegrityError` (a source chunk or the manifest is missing or
    corrupt: nothing is named in ``dst``), :class:`warmctl.base.errors.HostError` (disk full), the
    backends' errors (an outage that outlasts the retry window).
    """
    def advance(n: int) -> None:
        faults.point("transfer_chunks")  # a test's kill -9 amid the chunks
        if progress is not None:
            progress(n)

    src_cat = Catalog(src)
    sigs = src_cat.entry_signatures(entry)  # read once: what is checked is what is written
    if sigs is None and signer is not None:
        sigs = EntrySignatures(signatures=[sign_entry(entry, signer)])
    if keys_dir is not None:
        check_entry(entry, sigs, load_trusted_keys(keys_dir), src.backend.location(entry_key(entry)))
    require_space(src, dst, entry)
    report = copy_manifest(src, dst, entry.manifest, progress=advance)
    faults.point("transfer_catalog")  # chunks, manifest and signatures written; the name not yet
    m = dst.get_manifest(entry.manifest)
    if keys_dir is not None:
        verify_manifest(dst, entry.manifest, keys_dir)
    Catalog(dst).add(entry.model_copy(update={"published": _now()}),
                     profile=m.profile if m.profile_digest == entry.profile_digest else None, signatures=sigs)
    return Copied(entry, report)


def require_space(src: Store, dst: Store, entry: CatalogEntry) -> None:
    """Before copying ``entry`` into a ``dst`` on a local filesystem: raise
    :class:`~warmctl.base.errors.HostError` (exit 10, nothing written) when the filesystem cannot
    hold the chunks ``dst`` lacks, counted at their uncompressed size (the manifest records no
    compressed sizes: an upper bound), plus the manifest, with :mod:`warmctl.diskspace`'s margin.
    Any other ``dst`` (S3, OCI) is not checked."""
    from warmctl.store.chunks import is_zero_chunk
    from warmctl.store.local import LocalBackend

    b = dst.backend
    while not isinstance(b, LocalBackend) and getattr(b, "inner", None) is not None:
        b = b.inner
    if not isinstance(b, LocalBackend):
        return
    m = src.get_manifest(entry.manifest)
    missing: dict[str, int] = {}
    for f in m.files:
        for c in f.chunks:
            if c.digest not in missing and not is_zero_chunk(c.digest, c.size) and not dst.has_chunk(c.digest):
                missing[c.digest] = c.size
    diskspace.require([diskspace.Need(b.root, sum(missing.values()) + len(m.to_bytes()) if missing else 0,
                                      f"{len(missing)} chunk(s) to fetch of {len(m.chunk_digests())} and the manifest, "
                                      "at their uncompressed size (an upper bound)")],
                      f"pull {entry.name}:{entry.tag} ({entry.manifest[:19]}) into {b.root}")


def entries_to_copy(src: Store, ref: Ref, fp: HostFingerprint | None = None, *,
                    driver: DriverPolicy = "exact", only: str | None = None, keys_dir: str | Path | None = None,
                    accepted: Accepted | None = None, allow_rollback: bool = False,
                    notes: list[str] | None = None) -> list[CatalogEntry]:
    """The entries of ``ref`` (``NAME:TAG``) in ``src``'s catalog to copy: all of them, or with
    ``fp`` only the one this host would restore (``up``'s choice), or with ``only`` the one of
    that manifest digest.

    ``keys_dir`` (``pull``): only entries this node may act on (:meth:`Catalog.accept`: entry
    and manifest signed by trusted keys, agreeing with each other); with ``fp`` exactly
    :meth:`Catalog.resolve`'s choice (falling back past unusable newer entries, each reason
    appended to ``notes``; refusing a rollback below what ``accepted`` remembers unless
    ``allow_rollback``). Raises :class:`SnapshotNotFound` naming the catalog, or, with ``fp``,
    every candidate and why it does not fit; :class:`warmctl.naming.trust.TrustError` when none is
    usable."""
    cat = Catalog(src)
    if ref.digest:
        found = [e for t in cat.tags(ref.name) for e in cat.entries(ref.name, t) if e.manifest == ref.digest]
        if not found:
            raise SnapshotNotFound(f"no catalog entry names {ref} in the catalog at {cat.location()}")
        if keys_dir is not None:
            cat.accept(found[0], fp, keys_dir, driver=driver)
        return found[:1]
    if keys_dir is not None and fp is not None and not only:
        res = cat.resolve(ref.name, fp, keys_dir, tag=ref.tag, driver=driver, accepted=accepted,
                          allow_rollback=allow_rollback)
        if notes is not None:
            notes += [fallback_line(r) for r in res.skipped]
        return [res.entry]  # type: ignore[list-item]
    entries = cat.entries(ref.name, ref.tag)
    if only:
        entries = [e for e in entries if e.manifest == only]
    if not entries:
        raise SnapshotNotFound(f"no snapshot {ref} in the catalog at {cat.location()}")
    if keys_dir is not None:  # every kind of host's (pull --all): each must be usable
        for e in entries:
            cat.accept(e, None, keys_dir, driver=driver)
            if accepted is not None and not allow_rollback:
                accepted.check(e)
        return entries
    if fp is None:
        return entries
    chosen, rejections = select(entries, fp, driver=driver)
    if chosen is None:
        raise nothing_fits(str(ref), len(entries), fp, rejections, cat.location())
    return [chosen]


def pull(settings: Settings, src: Store, dst: Store, ref: Ref, *, progress: Progress | None = None,
         allow_rollback: bool = False, notes: list[str] | None = None) -> list[Copied]:
    """``warmctl pull NAME[:TAG]`` (or ``NAME@DIGEST``) from ``src`` into ``dst`` as a library
    call: the one entry this host would restore (:func:`entries_to_copy` with this host's
    fingerprint, ``settings.match_driver``), accepted only when trusted keys
    (``settings.keys_dir``) signed it and its manifest and it is no rollback below what this
    node accepted (unless ``allow_rollback``), copied by :func:`copy_entry` with every chunk
    verified on the way. Returns the one :class:`Copied`. Raises what those two raise
    (:class:`SnapshotNotFound`, :class:`warmctl.naming.trust.TrustError`,
    :class:`warmctl.base.errors.IntegrityError`, :class:`warmctl.base.errors.HostError`, the backends'
    errors); nothing is named in ``dst`` on a failure. The stores stay open (the caller closes)."""
    fp = fingerprint(criu=settings.criu, image_digest=settings.image_digest)
    entries = entries_to_copy(src, ref, fp, driver=settings.match_driver, keys_dir=settings.keys_dir,
                              accepted=Accepted.for_settings(settings), allow_rollback=allow_rollback, notes=notes)
    return [copy_entry(src, dst, e, progress, keys_dir=settings.keys_dir) for e in entries]


def fallback_line(r: Rejection) -> str:
    """The line saying that a newer candidate was passed over, and why."""
    return f"passed over {r.digest} (newer, {r.rule}): {r.reason.splitlines()[0]}; using the next valid one"


def transfer(src: Store, dst: Store, entries: list[CatalogEntry], progress: Progress | None = None) -> list[Copied]:
    """:func:`copy_entry` for each of ``entries`` in turn (chunks shared between them move once)."""
    return [copy_entry(src, dst, e, progress) for e in entries]


def snapshots(settings: Settings, url: str | None = None) -> list[tuple[CatalogEntry, Manifest | str]]:
    """Every catalog entry of the local store (or of the store at ``url``), with its manifest,
    or, when the manifest is missing or unreadable, the error saying so (also logged as a
    warning: an entry whose manifest cannot be read is listed, never hidden), sorted by name,
    tag, newest first."""
    store = open_store(url or settings.store_dir, settings=settings)
    out: list[tuple[CatalogEntry, Manifest | str]] = []
    for e in Catalog(store).all_entries():
        try:
            out.append((e, store.get_manifest(e.manifest)))
        except WarmctlError as err:
            log.warning("catalog entry %s:%s names manifest %s, which cannot be read: %s", e.name, e.tag, e.manifest, err)
            out.append((e, str(err)))
    return out


def remove_snapshot(settings: Settings, name: str, tag: str, *, remote: bool = True) -> dict[str, list[str]]:
    """Remove ``name:tag`` (every kind of host's entry) from the local store's catalog and, with
    ``remote``, from the catalog ``up`` reads (``settings.catalog_url``) when that is another
    store. Returns ``{catalog location: removed manifest digests}``. The data stays until gc."""
    urls = [str(settings.store_dir)]
    if remote and settings.catalog_url not in urls:
        urls.append(settings.catalog_url)
    out = {}
    for url in urls:
        cat = Catalog(open_store(url, settings=settings))
        out[cat.location()] = cat.remove_tag(name, tag)
    return out


def _now() -> datetime:
    return datetime.now(timezone.utc)
