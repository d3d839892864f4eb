"""The catalog: names (with tags) -> a profile and the snapshots published for each kind of host.

The catalog is warmctl's **only naming layer**: the store underneath knows snapshots by digest
alone (like containerd's content store under its metadata store). ``snapshot``, ``push``,
``pull``, ``ls``, ``up``, ``gc`` and the agent's snapshot routes all name snapshots through
it, and garbage collection keeps exactly the manifests it names (:meth:`Catalog.referenced_manifests`).

The catalog lives in a store's backend, next to the chunks and manifests (local directory or
S3), as small JSON objects; the format is specified in ``catalog/README.md``:

- ``catalog/<name>/<tag>/<algo>-<hex>.json``: one :class:`CatalogEntry` per published manifest.
  One object per entry, so two hosts publishing at once never overwrite each other; publishing
  replaces the entry of the same tag whose host has the same :func:`compat_key` (it is
  superseded), so a tag holds at most one snapshot per kind of host.
- ``catalog/<name>/profile.json``: the profile last published under that name (digest + the
  validated profile), so a host that fits no snapshot can cold-start from it.

Stores written before the catalog was the only naming layer also hold ``tags/<name>/<tag>``
objects (``"<manifest digest>\n"``). They are read as entries (:meth:`Catalog.entries`), kept by
gc, and turned into entries by :meth:`Catalog.migrate`, which every writing command runs first.

:func:`select` picks, among candidates, the one this host can restore, by the rules in
``catalog/README.md`` (:data:`RULES`); every other candidate gets exactly one :class:`Rejection`
reason, the first rule it fails.

The package, by concern (everything is importable from ``warmctl.naming.catalog``):

- :mod:`.rules`: the compatibility rules (:func:`select`, :func:`ranked`, :func:`check`,
  :func:`compat_key`, :class:`Rejection`); nothing there reads a store.
- :mod:`.model`: references, entries, profile records, :class:`Resolution`, object keys.
- :mod:`.verify`: signature checks on entries (:func:`~.verify.accept`).
- :mod:`.accepted`: rollback protection (:class:`Accepted`, :class:`RollbackRefused`).
- :mod:`.legacy`: the earlier layout's store tags and their migration.
- :mod:`.index`: the :class:`Catalog` type over a store's backend.
- :mod:`.errors`: :class:`CatalogError` and :class:`RollbackRefused`.
"""

from __future__ import annotations

from .accepted import Accepted
from .errors import CatalogError, RollbackRefused
from .index import Catalog
from .legacy import legacy_tags, migrate
from .model import (
    CATALOG_FORMAT,
    CATALOG_PREFIX,
    DEFAULT_TAG,
    LEGACY_TAG_PREFIX,
    NAME_RE,
    CatalogEntry,
    ProfileRecord,
    Ref,
    Resolution,
    entry_for,
    entry_key,
)
from .rules import (
    AMDGPU_PLUGIN,
    IGNORED_CPU_FLAGS,
    KNOWN_BAD,
    RULES,
    DriverPolicy,
    KnownBad,
    Rejection,
    _version_tuple,
    check,
    compat_key,
    compatible_flags,
    nothing_fits,
    ranked,
    select,
)
from .verify import accept, entry_signatures

__all__ = [
    "AMDGPU_PLUGIN", "CATALOG_FORMAT", "CATALOG_PREFIX", "DEFAULT_TAG", "IGNORED_CPU_FLAGS", "KNOWN_BAD",
    "LEGACY_TAG_PREFIX", "NAME_RE", "RULES", "Accepted", "Catalog", "CatalogEntry", "CatalogError",
    "DriverPolicy", "KnownBad", "ProfileRecord", "Ref", "Rejection", "Resolution", "RollbackRefused",
    "_version_tuple", "accept", "check", "compat_key", "compatible_flags", "entry_for", "entry_key",
    "entry_signatures", "legacy_tags", "migrate", "nothing_fits", "ranked", "select",
]
