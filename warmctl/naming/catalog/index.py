"""The :class:`Catalog` type: the catalog kept in a store's backend (layout: the package
docstring, :mod:`warmctl.naming.catalog`). It writes and reads entries and profile records and resolves
``NAME:TAG`` for a host; the rules, the signature checks, the rollback record and the legacy
migration it uses live beside it (:mod:`.rules`, :mod:`.verify`, :mod:`.accepted`, :mod:`.legacy`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from warmctl.base.errors import ImageMismatch, IntegrityError, SnapshotNotFound, WarmctlError
from warmctl.host import HostFingerprint
from warmctl.records.manifest import Manifest
from warmctl.store.backend import ObjectNotFound, load_limited
from warmctl.store.layout import MAX_ENTRY_BYTES, MAX_PROFILE_BYTES
from warmctl.naming.trust import EntrySignatures, TrustError, Verification, sign_entry, sign_manifest, verify_manifest

from .accepted import Accepted
from .errors import CatalogError, RollbackRefused
from .legacy import legacy_tags, migrate
from .model import (
    _DIGEST_RE,
    CATALOG_FORMAT,
    CATALOG_PREFIX,
    DEFAULT_TAG,
    NAME_RE,
    CatalogEntry,
    ProfileRecord,
    Resolution,
    _check_name,
    _entry_key,
    _sig_key,
    entry_for,
)
from .rules import DriverPolicy, Rejection, nothing_fits, ranked, select
from .verify import accept, entry_signatures

log = logging.getLogger(__name__)


class Catalog:
    """The catalog kept in ``store.backend`` (see the module docstring for the layout).

    ``store``: a :class:`warmctl.store.Store` (from :func:`warmctl.store.open_store`); only
    ``store.backend`` (save/load/list/remove/exists/location) and ``store.get_manifest`` are used.
    """

    def __init__(self, store: Any):
        self.store = store
        self.backend = store.backend

    def location(self) -> str:
        """Where the catalog lives, for messages (``s3://bucket/prefix/catalog/`` or a path)."""
        return self.backend.location(CATALOG_PREFIX)

    # -- writing

    def publish(
        self,
        manifest_digest: str,
        manifest: Manifest,
        tag: str = DEFAULT_TAG,
        signer: str | Path | Any | None = None,
    ) -> CatalogEntry:
        """Name ``manifest`` (already in the store, with its chunks) ``manifest.name``:``tag``.

        Signs it first when ``signer`` (an ed25519 private key or its file) is given; an
        unsigned entry is published too, but ``up`` refuses it without the insecure flag.
        Replaces the entry of the same tag with the same :func:`compat_key` and writes
        ``catalog/<name>/profile.json`` (:meth:`add`). Raises :class:`CatalogError` when
        ``manifest_digest`` is not ``manifest``'s digest or the manifest is not in the store;
        :class:`TrustError` for an unusable key.
        """
        name = _check_name("snapshot name", manifest.name)
        _check_name("tag", tag)
        if manifest.digest() != manifest_digest:
            raise CatalogError(f"publish {name}:{tag}: manifest digest is {manifest.digest()}, not {manifest_digest}")
        try:
            self.store.get_manifest(manifest_digest)
        except WarmctlError as e:
            raise CatalogError(
                f"publish {name}:{tag}: manifest {manifest_digest} is not readable from the store at "
                f"{self.backend.location()} (push it first): {e}"
            ) from None
        signed_by: list[str] = []
        if signer is not None:
            signed_by.append(sign_manifest(self.store, manifest_digest, signer).key_id)
        entry = entry_for(manifest, manifest_digest, tag, signed_by=signed_by)
        sigs = EntrySignatures(signatures=[sign_entry(entry, signer)]) if signer is not None else None
        self.add(entry, profile=manifest.profile, signatures=sigs)
        return entry

    def add(self, entry: CatalogEntry, profile: dict[str, Any] | None = None,
            signatures: EntrySignatures | None = None) -> None:
        """Write ``entry`` (its manifest must already be in this store: the entry is always the
        last object written, after ``signatures``, its :class:`~warmctl.naming.trust.EntrySignatures`),
        then remove the entries of the same name and tag whose
        :func:`compat_key` is the same (a tag holds one snapshot per kind of host: the tag
        *moves*). ``profile``: the validated profile to record as ``catalog/<name>/profile.json``.
        """
        _check_name("snapshot name", entry.name)
        _check_name("tag", entry.tag)
        if not _DIGEST_RE.match(entry.manifest):
            raise CatalogError(f"catalog entry {entry.name}:{entry.tag}: malformed manifest digest {entry.manifest!r}")
        self.migrate()
        key, body = _entry_key(entry.name, entry.tag, entry.manifest), entry.model_dump_json().encode()
        sig_key = _sig_key(entry.name, entry.tag, entry.manifest)
        commit = getattr(self.store, "commit", None)
        if commit is None:
            if signatures is not None:
                self.backend.save(sig_key, signatures.model_dump_json().encode())
            self.backend.save(key, body)
        else:  # a Store: under its writer lock, checked before and after (LockLost)
            self.store.check_lock(f"catalog entry {entry.name}:{entry.tag}")
            if not self.store.has_manifest(entry.manifest):
                raise CatalogError(f"catalog entry {entry.name}:{entry.tag}: manifest {entry.manifest} is not in the "
                                   f"store at {self.backend.location()}; an entry is written after what it names")
            if signatures is not None:
                commit(sig_key, signatures.model_dump_json().encode(), f"signature of catalog entry {entry.name}:{entry.tag}")
            commit(key, body, f"catalog entry {entry.name}:{entry.tag}")
        for old in self.entries(entry.name, entry.tag):
            if old.compat == entry.compat and old.manifest != entry.manifest:
                self.backend.remove(_entry_key(entry.name, entry.tag, old.manifest))
                self.backend.remove(_sig_key(entry.name, entry.tag, old.manifest))
        if profile is not None:
            doc = {"format": CATALOG_FORMAT, "name": entry.name, "profile_digest": entry.profile_digest, "profile": profile}
            self.backend.save(f"{CATALOG_PREFIX}{entry.name}/profile.json", json.dumps(doc, sort_keys=True).encode())

    def remove(self, name: str, tag: str, digest: str) -> bool:
        """Remove the entry of ``digest`` from ``name``:``tag``; ``True`` if it existed. The
        manifest, chunks and signatures stay until ``gc`` (which then no longer keeps them)."""
        self.migrate()
        key = _entry_key(_check_name("snapshot name", name), _check_name("tag", tag), digest)
        existed = self.backend.exists(key)
        self.backend.remove(key)  # the name first: an entry never outlives its signature unseen
        self.backend.remove(_sig_key(name, tag, digest))
        return existed

    def remove_tag(self, name: str, tag: str) -> list[str]:
        """Remove every entry of ``name``:``tag`` (one per kind of host); returns their manifest
        digests (``[]`` when the tag names nothing)."""
        gone = [e.manifest for e in self.entries(name, tag)]
        for d in gone:
            self.remove(name, tag, d)
        return gone

    def migrate(self) -> int:
        """Turn the earlier layout's store tags (``tags/<name>/<tag>``) into catalog entries and
        remove them; returns how many were migrated (:func:`warmctl.naming.catalog.legacy.migrate`)."""
        return migrate(self.store)

    # -- reading

    def _legacy_tags(self) -> dict[tuple[str, str], str]:
        return legacy_tags(self.backend)

    def entries(self, name: str, tag: str = DEFAULT_TAG) -> list[CatalogEntry]:
        """Entries of ``name``:``tag``, newest ``created`` first (an earlier layout's store tag
        without an entry is read as one). Unreadable entry objects are skipped with a logged
        warning naming them. Unknown name/tag: ``[]``."""
        _check_name("snapshot name", name)
        _check_name("tag", tag)
        out: list[CatalogEntry] = []
        prefix = f"{CATALOG_PREFIX}{name}/{tag}/"
        for info in self.backend.list(prefix):
            if not info.key.endswith(".json") or "/" in info.key[len(prefix) :]:
                continue
            where = self.backend.location(info.key)
            try:
                e = CatalogEntry.model_validate_json(load_limited(self.backend, info.key, MAX_ENTRY_BYTES, "catalog entry"))
            except (ValidationError, ValueError, IntegrityError) as err:
                log.warning("skipping unreadable catalog entry %s: %s", where, str(err).splitlines()[0])
                continue
            # its content must say where it lives: an entry copied under another name, tag or
            # digest is not used (an entry under tiny/latest saying "other")
            if (e.name, e.tag) != (name, tag) or not _DIGEST_RE.match(e.manifest) or \
                    info.key != _entry_key(name, tag, e.manifest):
                log.warning("skipping catalog entry %s: it names %s:%s -> %s, which is not where it lives",
                            where, e.name, e.tag, e.manifest)
                continue
            out.append(e)
        legacy = self._legacy_tags().get((name, tag))
        if legacy and all(e.manifest != legacy for e in out):
            try:
                out.append(entry_for(self.store.get_manifest(legacy), legacy, tag))
            except WarmctlError as e:
                log.warning("skipping store tag %s:%s -> %s: %s", name, tag, legacy, e)
        out.sort(key=lambda e: (e.created, e.manifest), reverse=True)
        return out

    def newest(self, name: str, tag: str = DEFAULT_TAG) -> str | None:
        """The manifest digest of ``name:tag``'s newest entry (for a store one kind of host
        writes, the one it names), or ``None``. To choose for a host, use :meth:`resolve`."""
        found = self.entries(name, tag)
        return found[0].manifest if found else None

    def all_entries(self) -> list[CatalogEntry]:
        """Every entry of every name and tag, sorted by name, tag, then newest first."""
        return [e for n in self.names() for t in self.tags(n) for e in self.entries(n, t)]

    def names(self) -> list[str]:
        """Every name that has a profile or at least one entry, sorted."""
        found = {n for n, _ in self._legacy_tags()}
        for info in self.backend.list(CATALOG_PREFIX):
            parts = info.key[len(CATALOG_PREFIX) :].split("/")
            if len(parts) >= 2 and NAME_RE.match(parts[0]):
                found.add(parts[0])
        return sorted(found)

    def tags(self, name: str) -> list[str]:
        """Tags of ``name`` that hold at least one entry, sorted."""
        _check_name("snapshot name", name)
        prefix = f"{CATALOG_PREFIX}{name}/"
        found = {t for n, t in self._legacy_tags() if n == name}
        for info in self.backend.list(prefix):
            parts = info.key[len(prefix) :].split("/")
            if len(parts) == 2 and parts[1].endswith(".json"):
                found.add(parts[0])
        return sorted(found)

    def profile(self, name: str) -> dict[str, Any] | None:
        """``{"name", "profile_digest", "profile"}`` last published for ``name``, or ``None``."""
        _check_name("snapshot name", name)
        key = f"{CATALOG_PREFIX}{name}/profile.json"
        where = self.backend.location(key)
        try:
            data = load_limited(self.backend, key, MAX_PROFILE_BYTES, "profile record")
        except ObjectNotFound:
            return None
        except IntegrityError as e:
            raise CatalogError(str(e)) from None
        try:
            rec = ProfileRecord.model_validate_json(data)
        except ValidationError as e:
            why = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'document'}: {x['msg']}" for x in e.errors()[:3])
            raise CatalogError(f"profile record {where} is unusable: {why}") from None
        if rec.name != name:
            raise CatalogError(f"profile record {where} is of {rec.name!r}, not {name!r}")
        return rec.model_dump()

    def entry_signatures(self, entry: CatalogEntry) -> EntrySignatures | None:
        """The signatures stored beside ``entry`` (None: none). Raises :class:`TrustError` for an
        unreadable or oversized signature object, naming it
        (:func:`warmctl.naming.catalog.verify.entry_signatures`)."""
        return entry_signatures(self.backend, entry)

    def referenced_manifests(self) -> set[str]:
        """Digests of every manifest some catalog entry (or earlier-layout store tag) names, for
        every name and tag: the roots that garbage collection keeps."""
        out: set[str] = set(self._legacy_tags().values())
        for info in self.backend.list(CATALOG_PREFIX):
            parts = info.key[len(CATALOG_PREFIX) :].split("/")
            if len(parts) == 3 and parts[2].endswith(".json"):
                algo, _, hexpart = parts[2][: -len(".json")].partition("-")
                if algo and hexpart:
                    out.add(f"{algo}:{hexpart}")
        return out

    def names_of(self) -> dict[str, list[str]]:
        """Manifest digest -> the ``name:tag`` references that name it (for listings)."""
        out: dict[str, list[str]] = {}
        for e in self.all_entries():
            out.setdefault(e.manifest, []).append(f"{e.name}:{e.tag}")
        return out

    def resolve(
        self,
        name: str,
        fp: HostFingerprint,
        keys_dir: str | Path,
        *,
        tag: str = DEFAULT_TAG,
        digest: str | None = None,
        insecure: bool = False,
        driver: DriverPolicy = "exact",
        accepted: Accepted | None = None,
        allow_rollback: bool = False,
    ) -> Resolution:
        """What ``up NAME`` restores on this host: among ``name``:``tag``'s entries that fit
        this host (newest first), the first that is usable (:meth:`accept`: the entry signed by
        a trusted key, its manifest signed, intact and agreeing with it, not older than what
        ``accepted`` remembers unless ``allow_rollback``); or the manifest ``digest`` itself
        (``NAME@sha256:...``, named by a tag or not; never a rollback). Each unusable newer
        candidate is in ``resolution.skipped`` with why (``up`` says it fell back). The chosen
        entry is recorded in ``accepted``. Nothing is pulled or materialized here.

        Raises :class:`SnapshotNotFound` when no entry exists or none fits (the message lists
        every rejected candidate with its one reason), :class:`TrustError` (no fitting candidate
        is usable: unsigned, untrusted, bad signature, a rollback, or the signed manifest
        contradicts its entry; ``insecure`` downgrades the signature part to a warning in
        ``resolution.verification.warning``), :class:`warmctl.base.errors.IntegrityError` (the
        candidates' manifests are missing or corrupt).
        """
        ref = f"{name}@{digest}" if digest else f"{name}:{tag}"
        if digest:
            if not self.store.has_manifest(digest):
                raise SnapshotNotFound(f"no snapshot {ref}: no manifest {digest} in the store at {self.backend.location()}")
            v = verify_manifest(self.store, digest, keys_dir, insecure=insecure)
            if v.manifest.name != name:
                raise TrustError(f"{ref} points at manifest {digest} of {v.manifest.name!r}")
            ok, why = select([v.manifest], fp, driver=driver)
            if ok is None:
                cls = ImageMismatch if why[0].rule == "image" else SnapshotNotFound
                raise cls(f"snapshot {ref} does not fit this host ({fp.summary()}): {why[0].reason}")
            return Resolution(digest=digest, entry=None, verification=v)
        entries = self.entries(name, tag)
        if not entries:
            raise SnapshotNotFound(f"no snapshot {ref} in the catalog at {self.location()}")
        fits, rejections = ranked(entries, fp, driver=driver)
        if not fits:
            raise nothing_fits(ref, len(entries), fp, rejections)
        skipped: list[Rejection] = []
        failures: list[WarmctlError] = []
        for e in fits:
            try:
                v, key = self.accept(e, fp, keys_dir, insecure=insecure, driver=driver)
                if accepted is not None and not allow_rollback:
                    accepted.check(e)
            except (TrustError, IntegrityError, CatalogError) as err:
                rule = "rollback" if isinstance(err, RollbackRefused) else \
                    "signature" if isinstance(err, TrustError) else "integrity"
                skipped.append(Rejection(digest=e.manifest, rule=rule, reason=str(err)))
                failures.append(err)
                continue
            if accepted is not None:
                accepted.record(e, self.location())
            return Resolution(digest=e.manifest, entry=e, verification=v, rejections=rejections + skipped,
                              skipped=skipped, entry_key=key)
        if len(failures) == 1:
            raise failures[0]
        lines = "\n".join(f"  - {r.digest} ({r.rule}): {r.reason}" for r in skipped)
        raise type(failures[0])(f"none of the {len(fits)} snapshot(s) of {ref} that fit this host is usable:\n{lines}")

    def accept(self, e: CatalogEntry, fp: HostFingerprint | None, keys_dir: str | Path, *, insecure: bool = False,
               driver: DriverPolicy = "exact") -> tuple[Verification, str | None]:
        """Whether this node may act on entry ``e`` (found under its own name and tag):
        :func:`warmctl.naming.catalog.verify.accept` on this catalog's store. Returns (the manifest's
        verification, the entry's key id or None); raises :class:`TrustError`,
        :class:`warmctl.base.errors.IntegrityError`."""
        return accept(self.store, e, fp, keys_dir, insecure=insecure, driver=driver)
