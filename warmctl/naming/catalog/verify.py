"""Signature checks on catalog entries: the signatures stored beside an entry
(:func:`entry_signatures`) and whether this node may act on an entry (:func:`accept`): its
manifest signed and intact, the entry itself signed by a trusted key, the two agreeing."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from warmctl.base.errors import IntegrityError
from warmctl.host import HostFingerprint
from warmctl.store.backend import ObjectNotFound, load_limited
from warmctl.store.layout import MAX_SIGNATURE_BYTES
from warmctl.naming.trust import EntrySignatures, TrustError, Verification, check_entry, load_trusted_keys, verify_manifest

from .model import CatalogEntry, _entry_key, _sig_key
from .rules import DriverPolicy, compat_key, select

log = logging.getLogger(__name__)


def entry_signatures(backend: Any, entry: CatalogEntry) -> EntrySignatures | None:
    """The signatures stored in ``backend`` beside ``entry`` (None: none). Raises
    :class:`TrustError` for an unreadable or oversized signature object, naming it."""
    key = _sig_key(entry.name, entry.tag, entry.manifest)
    try:
        data = load_limited(backend, key, MAX_SIGNATURE_BYTES, "entry signature")
        return EntrySignatures.model_validate_json(data)
    except ObjectNotFound:
        return None
    except (ValidationError, ValueError, IntegrityError) as e:
        raise TrustError(f"catalog entry signature {backend.location(key)} is unreadable: "
                         f"{str(e).splitlines()[0]}") from None


def accept(store: Any, e: CatalogEntry, fp: HostFingerprint | None, keys_dir: str | Path, *, insecure: bool = False,
           driver: DriverPolicy = "exact") -> tuple[Verification, str | None]:
    """Whether this node may act on entry ``e`` of ``store`` (a :class:`warmctl.store.Store`;
    ``e`` found under its own name and tag): its manifest's signature and bytes verify
    (:func:`verify_manifest`), a trusted key signed the entry itself
    (:func:`warmctl.naming.trust.check_entry`; an entry is a signed name, not a pointer to trust), and
    the signed manifest agrees with the entry (name, ``created``, profile digest, kind of host)
    and fits this host (``fp``; None: any host). Returns (the manifest's verification, the
    entry's key id; None when ``insecure`` let an unsigned entry through, with a warning added to
    the verification). Raises :class:`TrustError`, :class:`warmctl.base.errors.IntegrityError`."""
    backend = store.backend
    where = backend.location(_entry_key(e.name, e.tag, e.manifest))
    v = verify_manifest(store, e.manifest, keys_dir, insecure=insecure)
    m = v.manifest
    ref = f"{e.name}:{e.tag}"
    if m.name != e.name:
        raise TrustError(f"{ref} points at manifest {e.manifest} of {m.name!r}")
    ok, why = select([m], fp, driver=driver) if fp is not None else (m, [])
    if ok is None:
        raise TrustError(f"catalog entry {ref} -> {e.manifest}: the signed manifest's host does not fit: {why[0].reason}")
    for what, bad in (("created", m.created != e.created), ("profile digest", m.profile_digest != e.profile_digest),
                      ("host", compat_key(m.host) != e.compat or compat_key(e.host) != e.compat)):
        if bad:
            raise TrustError(f"catalog entry {ref} -> {e.manifest} ({where}): its {what} is not the signed manifest's")
    key: str | None = None
    try:
        key = check_entry(e, entry_signatures(backend, e), load_trusted_keys(keys_dir), where)
    except TrustError as err:
        if not insecure:
            raise
        note = f"INSECURE: using a catalog entry whose signature was not verified: {err}"
        log.warning(note)
        v = v.model_copy(update={"insecure": True, "warning": f"{v.warning}; {note}" if v.warning else note})
    return v, key
