"""The OCI layout of a store (docs/store-format.md, section 8): media types and annotations, the
snapshot artifact (:func:`snapshot_artifact`), the pack format (a blob of concatenated chunk
objects, :class:`_OpenPack` while it is filled, and its JSON index, :func:`pack_index`), and the
tags of small objects (:func:`object_tag`). Pure data: nothing here speaks to a registry."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_BLOB = b"{}"
#: artifactType of a snapshot (warmctl manifest + packs)
SNAPSHOT_TYPE = "application/vnd.warmctl.snapshot.v1"
#: artifactType of one small store object (catalog entry, signature, lock, config)
OBJECT_TYPE = "application/vnd.warmctl.object.v1"
MANIFEST_LAYER = "application/vnd.warmctl.manifest.v1+json"
#: the first layer of a sealed store's snapshot artifact: the sealed manifest (its blob digest is the
#: sealed bytes', the warmctl manifest digest is in the artifact's MANIFEST_ANNOTATION)
SEALED_MANIFEST_LAYER = "application/vnd.warmctl.manifest.sealed.v1"
PACK_LAYER = "application/vnd.warmctl.pack.v1"
INDEX_LAYER = "application/vnd.warmctl.pack-index.v1+json"
OBJECT_LAYER = "application/vnd.warmctl.object.v1"
KEY_ANNOTATION = "vnd.warmctl.key"
MANIFEST_ANNOTATION = "vnd.warmctl.manifest"
INDEX_ANNOTATION = "vnd.warmctl.pack.index"
CREATED = "org.opencontainers.image.created"

#: Largest pack (bytes): 1 GiB keeps a 647 GiB snapshot at ~650 packs (an OCI manifest of
#: ~0.3 MiB, docs/store-format.md) and a pack's re-upload after a failure short.
PACK_BYTES = 1 << 30
#: Packs filled (and uploaded) in parallel by one writer.
OPEN_PACKS = 4
MAX_INDEX = 16 << 20  # a 1 GiB pack of 4 MiB chunks has a ~30 KiB index
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _h(s: str, n: int) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:n]


def object_tag(key: str) -> str:
    """The tag of the small object ``key``: ``<name>.<tag>.<h16>`` for a catalog entry and
    ``<name>.profile.<h16>`` for a profile when that fits in 128 characters (so a registry's UI
    lists snapshots by name), ``sig-<manifest hex>-<h16>`` for a signature,
    ``lock-<h32>``, ``config``, else ``obj-<h48>``; ``<hN>``: the first N hex digits of the
    key's sha256 (the key itself is in the artifact's annotation and checked on read)."""
    parts = key.split("/")
    if key == "config":
        return "config"
    if parts[0] == "catalog" and len(parts) in (3, 4):
        label = ".".join(parts[1:-1] + ([parts[3].split("-")[-1][:12]] if len(parts) == 4 else ["profile"]))
        tag = f"{label}.{_h(key, 16)}"
        if len(tag) <= 128 and _TAG_RE.match(tag):
            return tag
        return f"cat-{_h(key, 48)}"
    if parts[0] == "signatures" and len(parts) == 4 and _HEX64.match(parts[2]):
        return f"sig-{parts[2]}-{_h(key, 16)}"
    if parts[0] == "locks":
        return f"lock-{_h(key, 32)}"
    return f"obj-{_h(key, 48)}"


def _tag_may_hold(tag: str, prefix: str) -> bool:
    """False when the object under ``tag`` cannot have a key starting with ``prefix`` (a cheap
    filter before reading the artifact; True may still be a non-match)."""
    if tag.startswith("manifest-"):
        return False
    if tag == "config":
        return "config".startswith(prefix)
    parts = prefix.split("/")
    top = parts[0]
    if len(parts) == 1:
        return True
    if top == "catalog":
        if tag.startswith(("sig-", "lock-", "obj-")) or tag == "config":
            return False
        if tag.startswith("cat-") or len(parts) < 3 or not parts[1]:
            return True
        return tag.startswith(parts[1] + ".")  # a readable catalog tag begins with the name
    if top == "signatures":
        if not tag.startswith("sig-"):
            return False
        return len(parts) < 4 or tag.startswith(f"sig-{parts[2]}-")
    if top == "locks":
        return tag.startswith("lock-")
    return tag.startswith("obj-")


def _now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _mtime(s: str | None) -> float:
    if not s:
        return 0.0
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _sha(data: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _desc(media: str, digest: str, size: int, annotations: dict | None = None) -> dict:
    d = {"mediaType": media, "digest": digest, "size": size}
    if annotations:
        d["annotations"] = annotations
    return d


EMPTY_DESC = _desc(EMPTY_TYPE, _sha(EMPTY_BLOB), len(EMPTY_BLOB))


def pack_index(pack: str, created: str, chunks: dict[str, tuple[int, int]]) -> bytes:
    """The index blob of ``pack``: JSON ``{"format": 1, "kind": "warmctl-pack-index", "pack",
    "created", "chunks": [[chunk digest, offset, length], ...]}`` (offsets and lengths in bytes
    of the pack, sorted by digest)."""
    return json.dumps({"format": 1, "kind": "warmctl-pack-index", "pack": pack, "created": created,
                       "chunks": [[d, off, n] for d, (off, n) in sorted(chunks.items())]}, separators=(",", ":")).encode()


def snapshot_artifact(digest: str, size: int, name: str, created: str, packs: list[tuple[str, int, str, int]],
                      sealed: str | None = None) -> dict:
    """The OCI image manifest of a snapshot: warmctl manifest ``digest`` (``size`` bytes) as the
    first layer, then each of ``packs`` (``(pack digest, pack bytes, index digest, index bytes)``)
    as its index layer followed by the pack layer, which names its index in an annotation.
    ``sealed``: the blob digest of the manifest's sealed form (a sealed store; ``size`` is its
    bytes), the first layer then a :data:`SEALED_MANIFEST_LAYER`."""
    first = _desc(MANIFEST_LAYER, digest, size, {"org.opencontainers.image.title": name}) if sealed is None else \
        _desc(SEALED_MANIFEST_LAYER, sealed, size, {"org.opencontainers.image.title": name})
    layers = [first]
    for pd, psize, idx, isize in packs:
        layers.append(_desc(INDEX_LAYER, idx, isize))
        layers.append(_desc(PACK_LAYER, pd, psize, {INDEX_ANNOTATION: idx}))
    return {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": SNAPSHOT_TYPE, "config": EMPTY_DESC,
            "layers": layers, "annotations": {CREATED: created, MANIFEST_ANNOTATION: digest, "org.opencontainers.image.title": name}}



@dataclass
class _Artifact:
    oci_digest: str
    size: int  # bytes of the warmctl manifest (as stored: sealed, in a sealed store)
    created: float
    packs: dict[str, tuple[str, int, int]]  # pack -> (index digest, index size, pack size)
    blob: str = ""  # digest of the blob holding the manifest (its own digest, unless sealed)


@dataclass
class _Pack:
    digest: str
    size: int
    index: str
    index_size: int
    created: float
    chunks: dict[str, tuple[int, int]]
    live: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.live = set(self.chunks)


class _OpenPack:
    """A pack being filled: chunk objects appended to a temporary file, hashed as they come."""

    def __init__(self) -> None:
        self.f = tempfile.TemporaryFile(prefix="warmctl-pack-")
        self.sha = hashlib.sha256()
        self.size = 0
        self.chunks: dict[str, tuple[int, int]] = {}

    def add(self, digest: str, data: bytes | memoryview) -> None:
        n = len(data)
        os.pwrite(self.f.fileno(), data, self.size)
        self.sha.update(data)
        self.chunks[digest] = (self.size, n)
        self.size += n

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()

    def read(self, off: int, n: int) -> bytes:
        return os.pread(self.f.fileno(), n, off)

    def reader(self) -> Iterator[bytes]:
        off = 0
        while off < self.size:
            b = os.pread(self.f.fileno(), min(8 << 20, self.size - off), off)
            if not b:
                raise OSError(f"pack spool file shrank at byte {off}")
            off += len(b)
            yield b

    def close(self) -> None:
        self.f.close()
