"""The store's object key layout (format: docs/store-format.md); owns names and keys, no I/O.

Object keys::

    config                          JSON {"format": 1, ...}, written with the first object
    chunks/<algo>/<hex[:2]>/<hex>   one zstd frame of the chunk's bytes
    manifests/sha256/<hex>          canonical manifest JSON (Manifest.to_bytes())
    tags/<name>/<tag>               "<manifest digest>\\n"
    signatures/sha256/<hex>/...     attachments of a manifest (see :mod:`warmctl.trust`)
    locks/<id>                      writer/gc locks (see :mod:`warmctl.store.lock`)
"""

from __future__ import annotations

import re

from warmctl.errors import WarmctlError
from warmctl.store import chunks as ck

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: Objects under these prefixes may name manifests (``sha256:<hex>``) that gc must keep.
ROOT_PREFIXES = ("tags/", "catalog/")
_MANIFEST_DIGEST_RE = re.compile(rb"sha256:[0-9a-f]{64}")


def check_name(kind: str, value: str) -> str:
    """Validate a snapshot name or tag (``[A-Za-z0-9][A-Za-z0-9._-]*``, <= 128 chars)."""
    if not _NAME_RE.match(value or ""):
        raise WarmctlError(f"invalid {kind} {value!r}: use letters, digits, '.', '_', '-' (max 128)")
    return value


def chunk_key(digest: str) -> str:
    """Object key of the chunk ``digest``: ``chunks/<algo>/<hex[:2]>/<hex>``."""
    algo, hx = ck.split_digest(digest)
    return f"chunks/{algo}/{hx[:2]}/{hx}"


def manifest_key(digest: str) -> str:
    """Object key of the manifest ``digest``: ``manifests/sha256/<hex>``."""
    algo, hx = digest.partition(":")[0], digest.partition(":")[2]
    if algo != "sha256" or len(hx) != 64:
        raise ValueError(f"malformed manifest digest {digest!r} (want 'sha256:<64 hex>')")
    return f"manifests/sha256/{hx}"


def tag_key(name: str, tag: str) -> str:
    """Object key of a tag: ``tags/<name>/<tag>``."""
    return f"tags/{check_name('name', name)}/{check_name('tag', tag)}"


def attachment_prefixes(digest: str) -> list[str]:
    """Key prefixes of objects that belong to manifest ``digest`` and are copied with it
    (signatures: ``signatures/sha256/<hex>/``)."""
    return [f"signatures/{digest.replace(':', '/', 1)}/"]


def _digest_from_chunk_key(key: str) -> str | None:
    """The chunk digest a ``chunks/...`` key names, or None for any other key."""
    parts = key.split("/")
    if len(parts) == 4 and parts[0] == "chunks" and parts[1] in ck.ALGORITHMS:
        return f"{parts[1]}:{parts[3]}"
    return None
