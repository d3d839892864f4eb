"""CLI commands for the snapshot store: push, pull, verify, gc, du (names through the catalog).

The local store is ``load_settings().store_dir`` (``$WARMCTL_HOME/store`` unless
``$WARMCTL_STORE`` says otherwise); remote URLs are directories, ``s3://bucket/prefix`` or ``oci://HOST/REPO``
(endpoint from ``$WARMCTL_S3_ENDPOINT``/``$AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import dataclasses

import typer

from warmctl.cli.output import JsonOpt, emit_json, table
from warmctl.cli.output import err as _console
from warmctl.cli.output import out as _out
from warmctl.cli.output import human as _human
from warmctl.base.errors import IntegrityError, WarmctlError


@contextmanager
def byte_progress(desc: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A rich progress bar (bytes, bytes/s, ETA) on stderr when stderr is a terminal, else
    nothing (the result line says what was moved); yields ``advance(n_bytes)``."""
    if not _console().is_terminal:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=_console(),
        transient=False,
    ) as prog:
        task = prog.add_task(desc, total=total)
        yield lambda n: prog.advance(task, n)


def _local(store: Optional[str]):
    from warmctl.records.config import load_settings
    from warmctl.store import open_store

    settings = load_settings()
    return open_store(store or settings.store_dir, settings=settings)


def _remote(url: Optional[str], flag: str):
    from warmctl.records.config import load_settings
    from warmctl.store import open_store

    settings = load_settings()
    url = url or settings.remote_store
    if not url:
        raise WarmctlError(f"no remote store: pass {flag} URL (a directory, s3://bucket/prefix or oci://HOST/REPO) or set WARMCTL_REMOTE_STORE")
    try:
        return open_store(url, settings=settings)
    except ValueError as e:
        raise WarmctlError(str(e)) from None


def _copy(src, dst, ref: str, verb: str, for_this_host: bool = False, json_out: bool = False,
          verify: bool = False, allow_rollback: bool = False, sign: bool = False) -> None:
    """Copy the catalog entries of ``ref`` with their data (:mod:`warmctl.naming.fleet`), one progress
    bar, one summary line per entry (``json_out``: a JSON list on stdout instead, one object
    per entry, docs/cli-json.md). ``verify`` (``pull``): only entries this node may act on, each
    checked against the trusted keys before anything is named (:func:`warmctl.naming.fleet.copy_entry`),
    refusing a rollback unless ``allow_rollback``. ``sign`` (``push``): entries without
    signatures are signed with the ``signing_key`` setting, when one is set. ``for_this_host``
    (``pull`` without ``--all``): the files the entry's processes map are then hashed into this
    host's digest cache (:func:`warmctl.pipelines.materialize.prehash`), off the next ``up``."""
    from warmctl.naming.catalog import Accepted, Ref
    from warmctl.records.config import load_settings
    from warmctl.naming.fleet import copy_entry, entries_to_copy

    r = Ref.parse(ref)
    fp = None
    settings = load_settings()
    if for_this_host:
        from warmctl.host import fingerprint

        fp = fingerprint(criu=settings.criu, image_digest=settings.image_digest)
    keys = settings.keys_dir if verify else None
    notes: list[str] = []
    try:
        entries = entries_to_copy(src, r, fp, driver=settings.match_driver, keys_dir=keys,
                                  accepted=Accepted.for_settings(settings) if verify else None,
                                  allow_rollback=allow_rollback, notes=notes)
        for line in notes:
            _console().print(line, markup=False, highlight=False)
        with byte_progress(f"{verb} {r}", sum(e.size for e in entries)) as advance:
            signer = settings.signing_key if sign else None
            done = [copy_entry(src, dst, e, progress=advance, keys_dir=keys, signer=signer) for e in entries]
        hashed = _prehash(dst, done, settings) if for_this_host else {}
    finally:  # locks released now, also on failure (not at interpreter exit)
        src.close()
        dst.close()
    rows = []
    for c in done:
        rep = c.report
        row = {"name": c.entry.name, "tag": c.entry.tag, "digest": rep.digest, "from": src.location,
               "to": dst.location, "chunks_total": rep.chunks_total, "chunks_copied": rep.chunks_copied,
               "bytes_copied": rep.bytes_copied, "logical": rep.logical, "seconds": rep.seconds}
        pre = hashed.get(rep.digest)
        if pre is not None:
            row.update(files_hashed=pre.files_hashed, hash_seconds=pre.seconds)
        rows.append(row)
        if json_out:
            continue
        rate = rep.bytes_copied / rep.seconds if rep.seconds else 0
        _console().print(
            f"{verb} {c.entry.name}:{c.entry.tag} ({rep.digest[:19]}) {src.location} -> {dst.location}: "
            f"{rep.chunks_copied}/{rep.chunks_total} chunks copied, {_human(rep.bytes_copied)} moved "
            f"({_human(rate)}/s), {_human(rep.logical)} of files, {rep.seconds:.1f} s",
            highlight=False,
            soft_wrap=True,
        )
        if pre is not None and pre.files_hashed:
            _console().print(f"  {pre.files_hashed} mapped file(s) hashed into this host's digest cache in "
                             f"{pre.seconds:.1f} s: `up` checks each with a stat", highlight=False, soft_wrap=True)
    if json_out:
        emit_json(rows)


def _prehash(dst, done, settings) -> dict:
    """Manifest digest -> :class:`warmctl.pipelines.materialize.Prehashed` for each entry of
    ``done`` pulled into ``dst``; the files missing or differing here are warned about on stderr
    (``up`` would refuse the snapshot), and a failure of the hashing itself is a warning too
    (the pull stands: ``up`` hashes for itself)."""
    from warmctl.pipelines.materialize import prehash

    out = {}
    for c in done:
        name = f"{c.entry.name}:{c.entry.tag}"
        try:
            pre = out[c.report.digest] = prehash(dst.get_manifest(c.report.digest), settings)
        except (OSError, WarmctlError) as e:  # the snapshot is pulled; only the hashing ahead failed
            _console().print(f"warning: the files {name} maps were not hashed ahead ({type(e).__name__}: {e}); "
                             "`warmctl up` hashes them itself", markup=False, highlight=False, soft_wrap=True)
            continue
        if pre.problems:
            _console().print(
                f"warning: {len(pre.problems)} file(s) the processes of {name} map are missing or differ on this "
                "host: `warmctl up` will refuse it until the same engine environment is installed at the same "
                "path:\n  " + "\n  ".join(pre.problems[:5]), markup=False, highlight=False, soft_wrap=True)
    return out


def _digests(s, refs: Optional[list[str]]) -> Optional[list[str]]:
    """Manifest digests named by ``refs`` (``NAME[:TAG]`` or ``NAME@sha256:...``) in the catalog
    of store ``s``; ``None`` for no refs. Raises SnapshotNotFound for a name that names nothing."""
    if not refs:
        return None
    from warmctl.naming.catalog import Catalog, Ref
    from warmctl.base.errors import SnapshotNotFound

    cat, out = Catalog(s), []
    for ref in refs:
        r = Ref.parse(ref)
        found = [r.digest] if r.digest else [e.manifest for e in cat.entries(r.name, r.tag)]
        if not found:
            raise SnapshotNotFound(f"no snapshot {r} in the catalog at {cat.location()}")
        out += found
    return out


def register(app: typer.Typer) -> None:
    """Add push, pull, verify, gc, seal and du to ``app``."""

    @app.command()
    def push(
        ref: str = typer.Argument(..., metavar="NAME[:TAG]", help="Snapshot in the local store (tag defaults to 'latest')."),
        to: Optional[str] = typer.Option(None, "--to", help="Destination store: a directory, s3://bucket/prefix or oci://HOST/REPO (default: WARMCTL_REMOTE_STORE)."),
        store: Optional[str] = typer.Option(None, "--store", help="Local store (default: the configured store_dir)."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Publish NAME:TAG to a remote store: for each of its catalog entries (one per kind of
        host), the chunks the remote lacks (verified), the manifest, its signatures, then the
        catalog entry and the profile record, last. Every node that reads the remote's catalog
        then sees it (a tag already there for the same kind of host moves to it).

        An entry written by a warmctl that did not sign entries yet is signed on the way with the
        signing_key setting, when one is set (nodes act only on signed entries).

        Safe to interrupt and rerun: only what is missing is sent. Example:
        `warmctl push tiny:latest --to s3://my-bucket/warmctl`
        """
        _copy(_local(store), _remote(to, "--to"), ref, "push", json_out=json_out, sign=True)

    @app.command()
    def pull(
        ref: str = typer.Argument(..., metavar="NAME[:TAG]", help="Snapshot in the remote store (tag defaults to 'latest')."),
        from_: Optional[str] = typer.Option(None, "--from", help="Source store: a directory, s3://bucket/prefix or oci://HOST/REPO (default: WARMCTL_REMOTE_STORE)."),
        store: Optional[str] = typer.Option(None, "--store", help="Local store (default: the configured store_dir)."),
        all_hosts: bool = typer.Option(False, "--all", help="Every kind of host's snapshot of NAME:TAG, not only this host's."),
        allow_rollback: bool = typer.Option(False, "--allow-rollback",
                                            help="Pull NAME:TAG even when it is older than the newest this node accepted (a rollback)."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Fetch NAME:TAG into the local store: the snapshot this host would restore (by the
        catalog's rules; `--all` for every kind of host), each chunk verified against its digest,
        then its manifest, signatures and catalog entry. `warmctl up NAME` then restores it
        without a remote. Nothing is named locally unless a trusted key (keys_dir) signed both the
        catalog entry and its manifest; an entry older than the newest this node accepted is
        refused (a rollback) unless --allow-rollback or NAME@DIGEST.

        Resumable: a killed pull, rerun, fetches only the chunks still missing; the name appears
        only once every chunk and the manifest are in place. Example:
        `warmctl pull tiny --from s3://my-bucket/warmctl`
        """
        _copy(_remote(from_, "--from"), _local(store), ref, "pull", for_this_host=not all_hosts, json_out=json_out,
              verify=True, allow_rollback=allow_rollback)

    @app.command()
    def verify(
        refs: Optional[list[str]] = typer.Argument(None, metavar="[NAME[:TAG]|NAME@DIGEST]...", help="Snapshots to check (default: every manifest)."),
        store: Optional[str] = typer.Option(None, "--store", help="Store to check: directory, s3://bucket/prefix or oci://HOST/REPO (default: local store)."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Re-hash every chunk of the store's snapshots; name each missing or corrupt chunk.

        Exits 5 when anything is missing or corrupt.
        """
        from warmctl.store import maintenance

        s = _remote(store, "--store") if store else _local(None)
        digests = _digests(s, refs)
        with byte_progress("verify", None) as advance:
            rep = maintenance.verify(s, digests, progress=advance)
        if json_out:
            emit_json({"store": s.location, "ok": rep.ok, **dataclasses.asdict(rep)})
        else:
            _out().print(str(rep), highlight=False)
        if not rep.ok:
            raise IntegrityError(f"store {s.location}: {len(rep.missing)} missing, {len(rep.corrupt)} corrupt chunk(s), {len(rep.bad_manifests)} bad manifest(s)")

    @app.command()
    def gc(
        grace: float = typer.Option(300.0, "--grace", help="Keep unreferenced objects younger than this many seconds."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Only report what would be removed."),
        store: Optional[str] = typer.Option(None, "--store", help="Store to clean: directory, s3://bucket/prefix or oci://HOST/REPO (default: local store)."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Remove snapshots that no catalog entry names any more, and chunks no kept manifest uses.

        The catalog is the naming layer: what it names (every NAME:TAG, for every kind of host)
        is kept; a snapshot whose tag moved on or was removed (`warmctl rm`) goes, with its
        signatures and the chunks no other snapshot shares. Objects younger than --grace are
        kept in any case. Takes the store's exclusive lock: refuses (exit 6) while a push, pull
        or snapshot is writing to the store.
        """
        from warmctl.naming.catalog import Catalog
        from warmctl.store import maintenance

        s = _remote(store, "--store") if store else _local(None)
        cat = Catalog(s)
        if not dry_run:
            cat.migrate()
        rep = maintenance.gc(s, keep=cat.referenced_manifests(), grace=grace, dry_run=dry_run)
        verb = "would remove" if dry_run else "removed"
        gone = None
        if store is None:  # the local store's gc also drops kept images of snapshots it no longer holds
            from warmctl.checkpoint.imagecache import ImageCache
            from warmctl.records.config import load_settings

            cache = ImageCache.for_settings(load_settings())
            gone = cache.prune(keep_digests=set(s.list_manifests()), unused_for=grace, dry_run=dry_run)
        if json_out:
            emit_json({"store": s.location, "grace_s": grace, **dataclasses.asdict(rep),
                       "images_removed": None if gone is None else [{"digest": e.digest, "bytes": e.bytes} for e in gone]})
            return
        _out().print(
            f"{verb} {rep.chunks_removed} chunks ({_human(rep.bytes_removed)}), {len(rep.manifests_removed)} manifests, "
            f"{rep.tmp_removed} temp files, {rep.locks_removed} stale locks; kept {rep.chunks_kept} chunks of "
            f"{rep.manifests_kept} manifests ({rep.chunks_too_new} unreferenced but younger than {grace:g} s)",
            highlight=False,
        )
        if gone:
            _out().print(f"{verb} {len(gone)} kept restore image(s) ({_human(sum(e.bytes for e in gone))}) "
                         f"from {cache.root}", highlight=False)

    @app.command()
    def seal(
        url: str = typer.Argument(..., metavar="STORE", help="Store to seal: a directory or s3://bucket/prefix."),
        key: Optional[Path] = typer.Option(None, "--key", help="Fleet key file (default: the configured seal_key)."),
        old_key: Optional[Path] = typer.Option(None, "--old-key", help="Rotate: the fleet key the store is sealed for now; its data key is re-wrapped for --key."),
        keep_old: bool = typer.Option(False, "--keep-old", help="With --old-key: the old key keeps opening the store too."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Seal a new, empty store for a fleet key, or rotate its fleet key: from then on every
        object but its config, lock files and sealed.json is encrypted and authenticated
        (AES-256-GCM) before it leaves a host, and only hosts whose seal_key is one the store
        is sealed for can read or write it. Rotating re-wraps the store's data key: no object
        is rewritten. A key file: `head -c 32 /dev/urandom | base64 > fleet.key; chmod 600
        fleet.key`. See docs/store-format.md, "Sealed stores"."""
        from warmctl.records.config import load_settings
        from warmctl.store import open_backend
        from warmctl.store.sealed import SealKeyError, key_id, load_key, seal_store

        settings = load_settings()
        path = key or settings.seal_key
        if path is None:
            raise SealKeyError("no fleet key: give --key FILE or set seal_key in the config")
        new = load_key(path)
        doc = seal_store(open_backend(url, unseal=False, settings=settings), new, load_key(old_key) if old_key else None, drop_old=not keep_old)
        if json_out:
            emit_json({"store": url, "data_key": doc["data_key"]["id"], "fleet_keys": sorted(doc["data_key"]["wrapped"])})
            return
        _out().print(f"store {url}: sealed, data key {doc['data_key']['id']}, opened by fleet key(s) "
                     f"{', '.join(sorted(doc['data_key']['wrapped']))} (this one: {key_id(new)})", highlight=False)

    @app.command()
    def du(
        store: Optional[str] = typer.Option(None, "--store", help="Store to measure: directory, s3://bucket/prefix or oci://HOST/REPO (default: local store)."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Disk used on this node, per snapshot: its chunks in the store and its kept image.

        Per snapshot: `files` (its file bytes), `stored` (its chunks, compressed), `unique`
        (stored bytes no other snapshot uses), `shared` (the rest), `zero` (all-zero bytes,
        never stored), `image` (the verified image kept for fast `up`s, its holes not counted;
        `*`: in use by a running engine) and `on node` = unique + image: what removing the
        snapshot (`warmctl rm`, then `gc`) would free here. Then the store's and the kept
        images' totals, the image budget (image_cache_bytes) and the free space of the
        filesystems holding them. With --store: that store's figures only.
        """
        from warmctl.naming.catalog import Catalog
        from warmctl.store import maintenance

        s = _remote(store, "--store") if store else _local(None)
        rep = maintenance.du(s, names=Catalog(s).names_of())
        if store is not None:
            if json_out:
                emit_json({"store": s.location, **dataclasses.asdict(rep), "images": None})
                return
            table(("manifest", "tags", "files", "stored", "unique", "shared", "zero"),
                  [(r.digest[:19] + ("" if not r.missing_chunks else f" ({r.missing_chunks} missing)"),
                    ", ".join(r.tags) or f"({r.name}, unnamed: gc removes it)",
                    _human(r.logical), _human(r.stored), _human(r.unique), _human(r.shared), _human(r.zero))
                   for r in rep.rows],
                  title=f"store {s.location}")
            _out().print(f"total stored {_human(rep.total_stored)} in {rep.chunk_count} chunks; "
                         f"unreferenced {_human(rep.unreferenced)}", highlight=False)
            return
        from warmctl.checkpoint.imagecache import ImageCache
        from warmctl.records.config import load_settings
        from warmctl.diskspace import node_report

        settings = load_settings()
        cache = ImageCache.for_settings(settings)
        node = node_report(rep, s.location, cache, budget_setting=str(settings.image_cache_bytes))
        if json_out:
            rows = [dataclasses.asdict(r) for r in node.rows]
            emit_json({"store": s.location, "rows": rows, "total_stored": node.store_bytes,
                       "shared": node.shared_bytes, "unreferenced": node.unreferenced, "chunk_count": node.chunk_count,
                       "images": [{"digest": r.digest, "bytes": r.image, "in_use": r.image_in_use}
                                  for r in node.rows if r.image],
                       "image_cache": {"root": node.image_cache, "bytes": node.images_bytes, "budget": node.budget,
                                       "setting": node.budget_setting},
                       "filesystems": node.filesystems})
            return
        table(("manifest", "tags", "files", "stored", "unique", "shared", "zero", "image", "on node"),
              [(r.digest[:19] + ("" if not r.missing_chunks else f" ({r.missing_chunks} missing)"),
                ", ".join(r.tags) or (f"({r.name}, unnamed: gc removes it)" if r.name else "(image only: no manifest here)"),
                _human(r.logical), _human(r.stored), _human(r.unique), _human(r.shared), _human(r.zero),
                (_human(r.image) + (" *" if r.image_in_use else "")) if r.image else "-", _human(r.node))
               for r in node.rows],
              title=f"store {s.location}, kept images {node.image_cache}")
        o = _out()
        o.print(f"store: {_human(node.store_bytes)} in {node.chunk_count} chunks ({_human(node.shared_bytes)} shared "
                f"between snapshots, {_human(node.unreferenced)} unreferenced)", highlight=False)
        budget = "no limit" if node.budget is None else f"{_human(node.budget)} (image_cache_bytes = {node.budget_setting})"
        n_img = len([r for r in node.rows if r.image])
        in_use = len([r for r in node.rows if r.image_in_use])
        o.print(f"kept images: {n_img}, {_human(node.images_bytes)} of a budget of {budget}"
                + (f"; {in_use} in use (*) by running engines" if in_use else ""), highlight=False)
        for f in node.filesystems:
            o.print(f"filesystem of {f['path']}: {_human(f['free'])} free of {_human(f['size'])}", highlight=False)
