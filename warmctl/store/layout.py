"""The store's object key layout (format: docs/store-format.md); owns names and keys, no I/O.

Object keys::

    config                          JSON {"format": 1, ...}, written with the first object
    chunks/<algo>/<hex[:2]>/<hex>   one zstd frame of the chunk's bytes
    manifests/sha256/<hex>          canonical manifest JSON (Manifest.to_bytes())
    catalog/...                     names: catalog entries (see :mod:`warmctl.naming.catalog`)
    signatures/sha256/<hex>/...     attachments of a manifest (see :mod:`warmctl.naming.trust`)
    locks/<id>                      writer/gc locks (see :mod:`warmctl.store.lock`)
"""

from __future__ import annotations

from warmctl.store import chunks as ck

#: The most bytes each kind of small object may have; a larger one is refused unread
#: (:func:`warmctl.store.backend.load_limited`), so a hostile store cannot make a node allocate
#: it. Typical sizes (docs/store-format.md, section 10): a catalog entry ~1.9 KiB (its host
#: fingerprint), a signature ~0.3 KiB, a manifest 100 bytes per 4 MiB chunk reference.
MAX_MANIFEST_BYTES = 64 << 20
MAX_ENTRY_BYTES = 64 << 10
MAX_SIGNATURE_BYTES = 16 << 10
MAX_PROFILE_BYTES = 1 << 20
MAX_LOCK_BYTES = 16 << 10
MAX_CONFIG_BYTES = 16 << 10
MAX_TAG_BYTES = 1 << 10

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
