"""The catalog's records and where they live: references (:class:`Ref`), entries
(:class:`CatalogEntry`), profile records (:class:`ProfileRecord`), what a resolve found
(:class:`Resolution`), and the object keys of the layout in ``catalog/README.md``."""

# No `from __future__ import annotations` here: pydantic would then evaluate each field's
# annotation from its string when the class is made (compiling it), about 4 ms of every
# `warmctl up` over the model modules it imports (docs/benchmarks.md).

import re
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from warmctl.base import names
from warmctl.records.manifest import Manifest
from warmctl.naming.trust import Verification

from .errors import CatalogError
from .rules import Rejection, compat_key

CATALOG_FORMAT = 1
CATALOG_PREFIX = "catalog/"
#: Store tags of the earlier layout (``tags/<name>/<tag>`` -> ``"<digest>\n"``); read, then migrated.
LEGACY_TAG_PREFIX = "tags/"
DEFAULT_TAG = "latest"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")

#: Names and tags follow the one name rule (:mod:`warmctl.base.names`).
NAME_RE = names.NAME_RE


def _check_name(what: str, value: str) -> str:
    return names.check_name(what, value, CatalogError)


class Ref(BaseModel):
    """A snapshot reference as users write it: ``NAME``, ``NAME:TAG`` or ``NAME@sha256:<hex>``
    (a digest pins one manifest, whether or not a tag still names it)."""

    model_config = ConfigDict(defer_build=True)

    name: str
    tag: str = DEFAULT_TAG
    digest: str | None = None

    @classmethod
    def parse(cls, ref: str, default_tag: str = DEFAULT_TAG) -> "Ref":
        """Parse ``ref``; raises :class:`CatalogError` naming what is malformed."""
        if "@" in ref:
            name, _, digest = ref.partition("@")
            if not _DIGEST_RE.match(digest):
                raise CatalogError(f"snapshot reference {ref!r}: want NAME@sha256:<64 hex digits>")
            return cls(name=_check_name("snapshot name", name), digest=digest)
        name, _, tag = ref.partition(":")
        return cls(name=_check_name("snapshot name", name), tag=_check_name("tag", tag or default_tag))

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag}"


class CatalogEntry(BaseModel):
    """One published snapshot: ``name``:``tag`` -> ``manifest`` digest, for the host ``host``.

    ``created``: when the snapshot was taken (from the manifest); ``published``: when this entry
    was written (UTC). ``size``: total snapshot bytes. ``compat``: :func:`compat_key` of
    ``host``. ``signed_by``: key ids that signed at publish time (informational; trust is decided
    by :func:`warmctl.naming.trust.verify_manifest`, never by this field).
    """

    model_config = ConfigDict(defer_build=True, extra="forbid")

    format: int = CATALOG_FORMAT
    kind: Literal["catalog-entry"] = "catalog-entry"
    name: str
    tag: str
    manifest: str
    created: datetime
    published: datetime
    profile_digest: str
    size: int
    host: dict[str, Any]
    compat: str
    signed_by: list[str] = []



class Resolution(BaseModel):
    """What :meth:`Catalog.resolve` found: the manifest ``digest``, the ``entry`` that named it
    (``None`` when ``up`` pinned the digest itself), the verified manifest, and the candidates
    that were rejected (with their one reason each). ``skipped``: the rejections of candidates
    that fit this host and were newer than the one chosen, but unusable (unsigned, missing,
    a rollback), each a fallback ``up`` reports. ``entry_key``: the trusted key that signed
    ``entry`` (None for a pinned digest, or an insecure resolve of an unsigned entry)."""

    model_config = ConfigDict(defer_build=True, arbitrary_types_allowed=True)

    digest: str
    entry: CatalogEntry | None
    verification: Verification
    rejections: list[Rejection] = []
    skipped: list[Rejection] = []
    entry_key: str | None = None

    @property
    def manifest(self) -> Manifest:
        return self.verification.manifest



def _entry_key(name: str, tag: str, digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    return f"{CATALOG_PREFIX}{name}/{tag}/{algo}-{hexpart}.json"


def entry_key(e: CatalogEntry) -> str:
    """The object key entry ``e`` lives at: ``catalog/<name>/<tag>/<algo>-<hex>.json``."""
    return _entry_key(e.name, e.tag, e.manifest)


def _sig_key(name: str, tag: str, digest: str) -> str:
    """Key of the signatures of the entry ``_entry_key(name, tag, digest)``: ``...<algo>-<hex>.sig``
    (beside it; readers that predate signed entries ignore it)."""
    return _entry_key(name, tag, digest)[: -len(".json")] + ".sig"


class ProfileRecord(BaseModel):
    """``catalog/<name>/profile.json``: the profile last published under ``name``."""

    model_config = ConfigDict(defer_build=True)

    format: int = CATALOG_FORMAT
    name: str
    profile_digest: str
    profile: dict[str, Any]



def entry_for(manifest: Manifest, digest: str, tag: str, signed_by: list[str] | None = None) -> CatalogEntry:
    """The catalog entry that names ``manifest`` (stored as ``digest``) ``manifest.name``:``tag``,
    published now."""
    return CatalogEntry(
        name=manifest.name,
        tag=tag,
        manifest=digest,
        created=manifest.created,
        published=datetime.now(timezone.utc),
        profile_digest=manifest.profile_digest,
        size=manifest.total_size(),
        host=manifest.host,
        compat=compat_key(manifest.host),
        signed_by=signed_by or [],
    )
