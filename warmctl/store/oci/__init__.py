"""OCI registry backend: a store kept in one repository of a registry, ``oci://HOST[:PORT]/REPO``.

The layout (specified in docs/store-format.md, section 8, "OCI registries") maps the store's
flat key namespace onto what the OCI distribution spec v1.1 offers (blobs by sha256 digest,
manifests, tags), so that registries, their garbage collectors and pull-through mirrors handle
a snapshot like any artifact:

- ``manifests/sha256/<hex>``: a **snapshot artifact**, an OCI image manifest with
  ``artifactType`` :data:`SNAPSHOT_TYPE`, tagged ``manifest-<hex>``. Its first layer is
  warmctl's manifest itself (so the blob digest *is* the warmctl manifest digest); the other
  layers are the **packs** holding the snapshot's chunks, each followed by its **pack index**.
- ``chunks/<algo>/<xx>/<hex>``: a byte range of a pack. A pack is a blob of concatenated chunk
  objects (zstd frames) of at most ``pack_bytes`` (the ``oci_pack_bytes`` setting, default
  :data:`PACK_BYTES`); its
  index (JSON) maps each chunk digest to ``[offset, length]``. Chunks are read back with
  ranged GETs. A new snapshot lists the packs that hold the chunks it needs, existing ones
  included, so chunk-level dedup works across snapshots and only packs of new chunks are
  uploaded.
- every other key (``config``, ``catalog/...``, ``signatures/...``, ``locks/...``): a small
  **object artifact** (``artifactType`` :data:`OBJECT_TYPE`, one layer holding the bytes, the
  key in the annotation :data:`KEY_ANNOTATION`) under a tag derived from the key
  (:func:`object_tag`): catalog entries get readable tags (``<name>.<tag>.<hash>``).

Chunk saves are buffered: a chunk goes into an open pack (a temporary file; up to
:data:`OPEN_PACKS` fill in parallel) and the pack is uploaded when full, or when a manifest is
saved (every pack it needs is uploaded before the artifact that names it), so the write order
holds: a crash leaves at worst unreferenced blobs, which the registry's own garbage collection
removes. Pack uploads are retried as a whole (a fresh upload session each time).

Protocol: a small client over httpx (docs/store-format.md says why not oras-py). HTTPS always,
plain HTTP only for registries listed in ``insecure`` (the ``oci_insecure`` setting,
``$WARMCTL_OCI_INSECURE``: ``host:port``, comma separated). CA bundle: ``ca_bundle`` (the
``oci_ca_bundle`` setting, ``$WARMCTL_OCI_CA_BUNDLE``), else ``CERTS_D/HOST[:PORT]/ca.crt``
(``certs_d``: the ``oci_certs_d`` setting, default ``/etc/docker/certs.d``), else the system's. Credentials: the Docker/OCI
conventions (``$REGISTRY_AUTH_FILE``, else ``$DOCKER_CONFIG/config.json``, else
``~/.docker/config.json``: ``auths[HOST[:PORT]]`` ``auth`` / ``username`` + ``password`` /
``identitytoken``); both the bearer-token flow and basic auth; an expired token is fetched
again once.

Every failure becomes :class:`TransientBackendError` (connection refused/reset, timeouts, 5xx,
408, 429, a body cut short), :class:`ObjectNotFound` (404), or :class:`HostError`, one line
naming the registry, the object and what to check (credentials refused, TLS certificate
rejected, deletes disabled, other 4xx). :class:`~warmctl.store.RetryingBackend` (``open_store``
wraps this backend in it) decides how long an outage is survived.

Reads of metadata (OCI manifests, pack indexes, small objects, warmctl manifests) are bounded
(:data:`MAX_OCI_MANIFEST`, :data:`MAX_INDEX`, :data:`MAX_OBJECT`, :data:`MAX_MANIFEST`); a
registry that sends more is refused with an error naming the object. Every read and upload
has a total deadline (``bound``, a :class:`~warmctl.store.backend.TransferBound`: the
``remote_deadline_floor_s`` + its size at ``remote_min_rate_bytes_s``; a metadata read at most
``read_deadline`` too, the ``oci_read_deadline_s`` setting, default :data:`READ_DEADLINE`),
checked as each piece of a body arrives or is handed to the connection: a registry that
trickles ends in :class:`~warmctl.store.backend.RemoteTooSlow` naming the object, the bytes
moved and the seconds waited: each request's read and write timeouts (20 s) are clamped to
what is left of its deadline, and the deadline covers the whole request, its answer's head
included (a watchdog shuts the connection down: :mod:`.registry`), so a registry that answers
nothing, or trickles its headers, ends there too. A pack blob whose size in the registry is not
the one its artifact records is damaged: its chunks are refused (IntegrityError, reported as
corrupt), not retried as an outage. In a sealed store a snapshot artifact's first layer is the
sealed manifest (:data:`SEALED_MANIFEST_LAYER`; :meth:`OCIBackend.save_sealed` lists the packs
from the plaintext).

The package, by concern: this module is the backend (:class:`OCIBackend`); :mod:`.registry`
the HTTP client of one repository (:class:`~.registry.RegistryClient`: requests, errors,
bounded reads, blobs, manifests, tags); :mod:`.auth` credentials, TLS and the 401 challenge as
an ``httpx.Auth`` flow; :mod:`.pack` the layout (media types, artifacts, packs, object tags).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from warmctl.base.errors import HostError, IntegrityError
from warmctl.store.backend import (Backend, BackendProperties, ObjectInfo, ObjectNotFound, TransferBound,
                                   TransientBackendError)
from warmctl.store.layout import _digest_from_chunk_key, chunk_key

from .auth import CERTS_D, Credentials, auth_file, credentials
from .pack import (
    _HEX64,
    CREATED,
    EMPTY_BLOB,
    EMPTY_DESC,
    INDEX_ANNOTATION,
    INDEX_LAYER,
    KEY_ANNOTATION,
    MANIFEST_ANNOTATION,
    MANIFEST_LAYER,
    SEALED_MANIFEST_LAYER,
    MAX_INDEX,
    OBJECT_LAYER,
    OBJECT_TYPE,
    OCI_INDEX,
    OCI_MANIFEST,
    OPEN_PACKS,
    PACK_BYTES,
    PACK_LAYER,
    SNAPSHOT_TYPE,
    _Artifact,
    _desc,
    _mtime,
    _now_iso,
    _OpenPack,
    _Pack,
    _sha,
    _tag_may_hold,
    object_tag,
    pack_index,
    snapshot_artifact,
)
from .registry import MAX_OCI_MANIFEST, READ_DEADLINE, RegistryClient, _watched, parse_url

__all__ = [
    "CERTS_D", "INDEX_ANNOTATION", "INDEX_LAYER", "KEY_ANNOTATION", "MANIFEST_ANNOTATION", "MANIFEST_LAYER",
    "MAX_INDEX", "MAX_MANIFEST", "MAX_OBJECT", "MAX_OCI_MANIFEST", "OBJECT_LAYER", "OBJECT_TYPE", "OCI_INDEX",
    "OCI_MANIFEST", "OPEN_PACKS", "PACK_BYTES", "PACK_LAYER", "READ_DEADLINE", "SEALED_MANIFEST_LAYER", "SNAPSHOT_TYPE", "Credentials",
    "OCIBackend", "RegistryClient", "auth_file", "credentials", "object_tag", "pack_index", "parse_url",
    "snapshot_artifact",
]

log = logging.getLogger(__name__)

MAX_OBJECT = 4 << 20  # catalog entries, signatures, locks: a few KiB
MAX_MANIFEST = 256 << 20  # warmctl manifests: ~15 MiB for 647 GiB


class OCIBackend(Backend):
    """A store in repository ``repo`` of registry ``registry`` (``HOST[:PORT]``); see the module
    docstring for the layout, protocol and errors. ``pack_bytes``: largest pack (bytes, default
    :data:`PACK_BYTES`); ``read_deadline``: seconds one metadata read may take in all;
    ``bound``: the total deadline of every read and upload (module docstring);
    ``ca_bundle``/``certs_d``: where the registry's CA is found; ``insecure``: registries
    (``host:port``) spoken to in plain HTTP. :func:`warmctl.store.open_backend` passes the
    ``oci_*`` settings."""

    properties = BackendProperties(local=False, prefetch=False, workers=16)

    def __init__(self, registry: str, repo: str, pack_bytes: int | None = None, connect_timeout: float = 5.0,
                 read_timeout: float = 20.0, *, read_deadline: float = READ_DEADLINE, ca_bundle: Path | None = None,
                 certs_d: Path = CERTS_D, insecure: Iterable[str] = (), bound: TransferBound | None = None):
        self.registry, self.repo = registry, repo
        self.pack_bytes = pack_bytes or PACK_BYTES
        self.api = RegistryClient(registry, repo, connect_timeout, read_timeout, read_deadline=read_deadline,
                                  ca_bundle=ca_bundle, certs_d=certs_d, insecure=insecure, bound=bound)
        self.base = self.api.base
        self._mu = threading.Lock()
        self._chunks: dict[str, tuple[str, int, int]] = {}  # chunk digest -> (pack, offset, length)
        self._packs: dict[str, _Pack] = {}  # pack digest -> its index (uploaded packs)
        self._artifacts: dict[str, _Artifact] = {}  # warmctl manifest digest -> its artifact
        self._scanned = False
        self._scan_mu = threading.Lock()
        self._open: list[_OpenPack] = []  # packs being filled (free ones)
        self._filling: dict[str, _OpenPack] = {}  # chunk digest -> the open/full pack holding it
        self._full: list[_OpenPack] = []  # full, not yet uploaded
        self._open_sem = threading.BoundedSemaphore(OPEN_PACKS)
        self._ranged: set[str] = set()  # packs read at least once (see _ranged_get)
        self._probing: dict[str, threading.Lock] = {}

    def __repr__(self) -> str:
        return f"OCIBackend({self.location()!r})"

    # -- naming

    def location(self, key: str = "") -> str:
        base = f"oci://{self.registry}/{self.repo}"
        if not key:
            return base
        d = _digest_from_chunk_key(key)
        if d is not None and d in self._chunks:
            pack, off, n = self._chunks[d]
            return f"{base}/{key} (pack blob {pack}, bytes {off}-{off + n - 1})"
        if key.startswith("manifests/sha256/"):
            return f"{base}:manifest-{key.rsplit('/', 1)[1]}"
        if d is None and not key.endswith("/"):
            return f"{base}:{object_tag(key)} ({key})"
        return f"{base}/{key}"

    def endpoint(self) -> str:
        return self.base

    # -- HTTP (the registry client)

    @property
    def read_deadline(self) -> float:
        """Seconds one metadata read may take in all (the client's)."""
        return self.api.read_deadline

    def tags(self) -> list[str]:
        """Every tag of the repository (:meth:`RegistryClient.tags`)."""
        return self.api.tags()

    # -- snapshots, packs and chunks

    def _artifact(self, hexd: str, doc: dict | None = None) -> "_Artifact":
        """The artifact of manifest ``sha256:<hexd>`` (read and remembered). Raises ObjectNotFound."""
        digest = f"sha256:{hexd}"
        with self._mu:
            a = self._artifacts.get(digest)
        if a is not None:
            return a
        what = f"snapshot artifact {self.registry}/{self.repo}:manifest-{hexd}"
        try:
            oci, doc = self.api.get_manifest(f"manifest-{hexd}", what)
        except ObjectNotFound:
            raise ObjectNotFound(f"manifests/sha256/{hexd}", self.location(f"manifests/sha256/{hexd}")) from None
        layers = doc["layers"]
        first = layers[0] if layers and isinstance(layers[0], dict) else {}
        if first.get("mediaType") == SEALED_MANIFEST_LAYER and isinstance(first.get("digest"), str) \
                and (doc.get("annotations") or {}).get(MANIFEST_ANNOTATION) == digest:
            blob = first["digest"]  # a sealed store's manifest (SealedBackend authenticates it under its key)
        elif first.get("digest") == digest:
            blob = digest
        else:
            raise IntegrityError(f"{what}: its first layer is not manifest {digest}; refused")
        packs = {}
        sizes = {x.get("digest"): x.get("size") for x in layers if isinstance(x, dict) and x.get("mediaType") == INDEX_LAYER}
        for i, lay in enumerate(layers):
            if isinstance(lay, dict) and lay.get("mediaType") == PACK_LAYER:
                idx = (lay.get("annotations") or {}).get(INDEX_ANNOTATION)
                isize = sizes.get(idx)
                if not isinstance(idx, str) or not isinstance(isize, int):
                    raise IntegrityError(f"{what}: pack {lay.get('digest')} (layer {i}) names no index layer; refused")
                packs[lay["digest"]] = (idx, isize, int(lay.get("size", 0)))
        a = _Artifact(oci, int(first.get("size", 0)), _mtime((doc.get("annotations") or {}).get(CREATED)), packs, blob)
        with self._mu:
            self._artifacts[digest] = a
        return a

    def _load_index(self, pack: str, idx: str, isize: int, psize: int) -> None:
        with self._mu:
            if pack in self._packs:
                return
        what = f"index {idx} of pack {pack}"
        try:
            doc = json.loads(self.api.get_blob(idx, MAX_INDEX, what, isize))
            chunks = {c[0]: (int(c[1]), int(c[2])) for c in doc["chunks"]}
            created = _mtime(doc.get("created"))
            if doc.get("pack") != pack:
                raise ValueError(f"it indexes {doc.get('pack')}")
        except ObjectNotFound:
            raise IntegrityError(f"{what} is missing from {self.location()} (the snapshot artifact names it); "
                                 "the snapshot is incomplete") from None
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise IntegrityError(f"{what} in {self.location()} is unreadable: {e}") from None
        for d, (off, n) in chunks.items():
            if off < 0 or n <= 0 or off + n > psize:
                raise IntegrityError(f"{what}: chunk {d} at bytes {off}+{n} lies outside the {psize}-byte pack; refused")
        with self._mu:
            self._packs[pack] = _Pack(pack, psize, idx, isize, created, chunks)
            for d, (off, n) in chunks.items():
                self._chunks.setdefault(d, (pack, off, n))

    def _load_artifact_indexes(self, a: "_Artifact") -> None:
        todo = [(p, i, s, ps) for p, (i, s, ps) in a.packs.items() if p not in self._packs]
        if not todo:
            return
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda t: self._load_index(*t), todo))

    def _scan(self) -> None:
        """Read every snapshot artifact of the repository and its pack indexes (once)."""
        with self._scan_mu:
            if self._scanned:
                return
            hexes = [t[len("manifest-"):] for t in self.api.tags() if t.startswith("manifest-") and _HEX64.match(t[9:])]

            def one(h: str) -> None:
                try:
                    self._load_artifact_indexes(self._artifact(h))
                except ObjectNotFound:
                    pass  # removed meanwhile

            with ThreadPoolExecutor(8) as ex:
                list(ex.map(one, hexes))
            self._scanned = True

    def _locate(self, digest: str) -> tuple[str, int, int] | None:
        loc = self._chunks.get(digest)
        if loc is None and not self._scanned:
            self._scan()
            loc = self._chunks.get(digest)
        return loc

    def _save_chunk(self, digest: str, data: bytes | memoryview) -> None:
        with self._mu:
            known = digest in self._filling or digest in self._chunks
        if not known:
            self._open_sem.acquire()
            try:
                with self._mu:
                    p = self._open.pop() if self._open else None
                if p is None:
                    p = _OpenPack()
                with self._mu:
                    if digest in self._filling:  # another thread saved it meanwhile
                        self._open.append(p)
                        p = None
                if p is not None:
                    p.add(digest, data)
                    with self._mu:
                        self._filling[digest] = p
                        (self._full if p.size >= self.pack_bytes else self._open).append(p)
            finally:
                self._open_sem.release()
        self._upload_full()

    def _upload_full(self, everything: bool = False) -> None:
        """Upload the full packs (with ``everything``, the open ones too) and their indexes."""
        while True:
            with self._mu:
                if everything and self._open:
                    self._full.extend(self._open)
                    self._open.clear()
                if not self._full:
                    return
                p = self._full.pop()
            try:
                self._upload_pack(p)
            except BaseException:
                with self._mu:
                    self._full.append(p)  # a retry uploads it again
                raise

    def _upload_pack(self, p: "_OpenPack") -> None:
        digest, size = p.digest(), p.size
        what = f"upload pack {digest} ({size:,} bytes, {len(p.chunks)} chunks)"
        self.api.put_blob(digest, p.reader, size, what)
        created = _now_iso()
        index = pack_index(digest, created, p.chunks)
        idx = _sha(index)
        self.api.put_blob(idx, index, len(index), f"upload index of pack {digest}")
        with self._mu:
            self._packs[digest] = _Pack(digest, size, idx, len(index), _mtime(created), dict(p.chunks))
            for d, (off, n) in p.chunks.items():
                self._chunks[d] = (digest, off, n)
                self._filling.pop(d, None)
        p.close()

    def _save_manifest(self, hexd: str, data: bytes | memoryview, stored: bytes | None = None) -> None:
        """Upload manifest ``sha256:<hexd>`` (``data``, its plaintext) and its snapshot artifact,
        every pack its chunks lie in uploaded first. ``stored``: the bytes to store instead
        (its sealed form, :meth:`save_sealed`). Raises IntegrityError when ``data`` is not that
        manifest or a chunk it names is in no pack."""
        from warmctl.records.manifest import Manifest
        from warmctl.store import chunks as ck

        digest = f"sha256:{hexd}"
        data = bytes(data)
        what = f"push snapshot artifact manifest-{hexd}"
        if _sha(data) != digest:
            raise IntegrityError(f"{what}: the bytes given hash to {_sha(data)}, not {digest}")
        try:
            m = Manifest.from_bytes(data)
        except ValueError as e:
            raise IntegrityError(f"{what}: not a manifest: {e}") from None
        self._upload_full(everything=True)  # every pack this writer filled, before naming them
        packs: dict[str, None] = {}
        missing = []
        for f in m.files:
            for c in f.chunks:
                if ck.is_zero_chunk(c.digest, c.size):
                    continue
                loc = self._locate(c.digest)
                if loc is None:
                    missing.append(c.digest)
                else:
                    packs[loc[0]] = None
        if missing:
            raise IntegrityError(f"{what}: {len(missing)} chunk(s) are in no pack of {self.location()}: {', '.join(missing[:5])}")
        body = data if stored is None else bytes(stored)
        blob = digest if stored is None else _sha(body)
        self.api.put_blob(blob, body, len(body), what)
        self.api.put_blob(EMPTY_DESC["digest"], EMPTY_BLOB, len(EMPTY_BLOB), what)
        created = _now_iso()
        doc = snapshot_artifact(digest, len(body), m.name, created,
                                [(pd, self._packs[pd].size, self._packs[pd].index, self._packs[pd].index_size) for pd in packs],
                                sealed=None if stored is None else blob)
        oci = self.api.put_manifest(f"manifest-{hexd}", doc, what)
        with self._mu:
            self._artifacts[digest] = _Artifact(oci, len(body), _mtime(created),
                                                {pd: (self._packs[pd].index, self._packs[pd].index_size, self._packs[pd].size) for pd in packs},
                                                blob)

    # -- small objects

    def _object(self, key: str) -> tuple[str, dict]:
        tag = object_tag(key)
        oci, doc = self.api.get_manifest(tag, f"object {key} (tag {tag})")
        ann = doc.get("annotations") or {}
        if ann.get(KEY_ANNOTATION) != key or len(doc["layers"]) != 1:
            raise IntegrityError(f"{self.location(key)}: the artifact under tag {tag} holds {ann.get(KEY_ANNOTATION)!r}, not {key!r}; refused")
        return oci, doc

    def _save_object(self, key: str, data: bytes | memoryview) -> None:
        data = bytes(data)
        digest = _sha(data)
        tag = object_tag(key)
        what = f"save {key} (tag {tag})"
        self.api.put_blob(digest, data, len(data), what)
        self.api.put_blob(EMPTY_DESC["digest"], EMPTY_BLOB, len(EMPTY_BLOB), what)
        try:
            old, _ = self._object(key)
        except ObjectNotFound:
            old = None
        doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": OBJECT_TYPE, "config": EMPTY_DESC,
               "layers": [_desc(OBJECT_LAYER, digest, len(data))],
               "annotations": {KEY_ANNOTATION: key, CREATED: _now_iso()}}
        new = self.api.put_manifest(tag, doc, what)
        if old and old != new:  # the replaced version, now untagged
            try:
                self.api.send("DELETE", self.api.url(f"manifests/{old}"), what, ok=(202, 200)).close()
            except (ObjectNotFound, HostError):
                pass

    # -- the Backend interface

    def save(self, key: str, data: bytes | memoryview) -> None:
        d = _digest_from_chunk_key(key)
        if d is not None:
            return self._save_chunk(d, data)
        if key.startswith("manifests/sha256/") and _HEX64.match(key[17:]):
            return self._save_manifest(key[17:], data)
        return self._save_object(key, data)

    def save_sealed(self, key: str, sealed: bytes, plain: bytes | memoryview) -> None:
        """As :meth:`save` of ``sealed``; a manifest's artifact lists the packs its plaintext
        (``plain``) names, its first layer the sealed bytes (:data:`SEALED_MANIFEST_LAYER`)."""
        if key.startswith("manifests/sha256/") and _HEX64.match(key[17:]):
            return self._save_manifest(key[17:], plain, stored=sealed)
        return self.save(key, sealed)

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        d = _digest_from_chunk_key(key)
        if d is not None:
            return self._load_chunk(key, d, offset, length)
        if key.startswith("manifests/sha256/") and _HEX64.match(key[17:]):
            a = self._artifact(key[17:])
            data = self.api.get_blob(a.blob or f"sha256:{key[17:]}", MAX_MANIFEST, f"manifest {key[17:][:12]}", a.size)
            self._load_artifact_indexes(a)
        else:
            _, doc = self._object(key)
            layer = doc["layers"][0]
            data = self.api.get_blob(layer["digest"], MAX_OBJECT, self.location(key), layer.get("size"))
        if length is not None or offset:
            return data[offset: None if length is None else offset + length]
        return data

    def _load_chunk(self, key: str, d: str, offset: int, length: int | None) -> bytes:
        with self._mu:
            p = self._filling.get(d)
        if p is not None:
            off, n = p.chunks[d]
            return p.read(off + offset, (n - offset) if length is None else min(length, n - offset))
        loc = self._locate(d)
        if loc is None:
            raise ObjectNotFound(key, self.location(key))
        pack, off, n = loc
        start = off + offset
        want = (n - offset) if length is None else min(length, n - offset)
        if want <= 0:
            return b""
        with self._mu:
            first = None if pack in self._ranged else self._probing.setdefault(pack, threading.Lock())
        if first is None:
            return self._ranged_get(key, d, pack, start, want, False)
        with first:  # the first read of a pack: alone (see _ranged_get)
            if pack in self._ranged:
                first = None
            else:
                data = self._ranged_get(key, d, pack, start, want, True)
                with self._mu:
                    self._ranged.add(pack)
                return data
        return self._ranged_get(key, d, pack, start, want, False)

    def _ranged_get(self, key: str, d: str, pack: str, start: int, want: int, first: bool) -> bytes:
        """Bytes ``[start, start+want)`` of blob ``pack`` (chunk ``d``), by a ranged GET.

        A registry answers 206 with the range. A pull-through mirror that does not hold the pack
        yet (Distribution's proxy, for one) ignores the Range and streams the whole blob from its
        origin while keeping it: with ``first`` (the first read of this pack by this process,
        which other readers of the pack wait for) such a body is read to its end, so the mirror
        finishes its copy and the origin serves the pack once; the later reads get ranges from the
        mirror. Without ``first``, a whole-blob answer is read only up to the range wanted.

        A pack blob whose size in the registry is not the one its snapshot artifact records (the
        ``Content-Range`` total, a whole-blob ``Content-Length``, or 416 for a range inside the
        recorded size) is damaged (truncated, or another blob's bytes): IntegrityError naming the
        pack and both sizes, which the reader reports as the chunk corrupt (not retried as an
        outage: the registry answers the same each time)."""
        what = f"load chunk {d} from pack {pack}"
        where = f"{what} at {self.base}"
        clock = self.api.clock(where, want)
        with self._mu:
            known = self._packs.get(pack)
        psize = known.size if known is not None else None
        try:
            r = self.api.send("GET", self.api.url(f"blobs/{pack}"), what, stream=True, ok=(200, 206, 416),
                              headers={"Range": f"bytes={start}-{start + want - 1}"}, clock=clock)
        except ObjectNotFound:
            raise ObjectNotFound(key, self.location(key)) from None
        pos = 0
        n = r.headers.get("content-length", "")
        cr = r.headers.get("content-range", "")
        total = cr.rpartition("/")[2] if r.status_code == 206 else n if r.status_code == 200 else ""
        if r.status_code == 416 or (psize is not None and total.isdigit() and int(total) != psize):
            r.close()
            held = f"{int(total):,} bytes" if total.isdigit() else f"fewer than {start + want:,} bytes (HTTP 416 for bytes {start}-{start + want - 1})"
            if psize is not None:
                raise IntegrityError(f"{where}: pack blob {pack} in {self.location()} is corrupt: the registry holds "
                                     f"{held}, its snapshot artifact records {psize:,}; refused")
            raise IntegrityError(f"{where}: pack blob {pack} in {self.location()} is corrupt: the registry holds {held}; refused")
        if r.status_code == 200 and n.isdigit():  # the whole blob comes: its size is the transfer's
            clock = self.api.clock(where, int(n))
        try:
            with _watched(clock) as w:
                if r.status_code == 206:
                    if not cr.startswith(f"bytes {start}-"):
                        raise TransientBackendError(f"{where}: asked for bytes {start}- but got range {cr!r}")
                    got = bytearray()
                    for b in r.iter_bytes():
                        got += b
                        pos = len(got)
                        clock.check(pos)
                    data = bytes(got)
                else:  # the Range was ignored (a pull-through mirror filling its cache): skip to ours
                    out = bytearray()
                    for b in r.iter_bytes():
                        if pos + len(b) > start and len(out) < want:
                            out += b[max(0, start - pos): start + want - pos]
                        pos += len(b)
                        if len(out) >= want and not first:
                            break
                        clock.check(pos)
                    data = bytes(out[:want])
            if w.fired:  # the watchdog shut the connection down at the deadline: the body ended early
                raise clock.error(pos)
        except httpx.HTTPError as e:
            if clock.expired():
                raise clock.error(pos) from e
            raise self.api._transport_error(where, e) from e
        finally:
            r.close()
        if len(data) != want:
            raise TransientBackendError(f"{where}: body cut short: {len(data)} of {want} bytes")
        if first and r.status_code == 200:
            self._wait_cached(pack)
        return data

    def _wait_cached(self, pack: str, limit: float = 30.0) -> None:
        """After a whole-blob answer to the first read of ``pack`` (a pull-through mirror that did
        not hold it), wait until the mirror answers a 1-byte range (206: its copy is committed),
        for up to ``limit`` seconds, so that the reads waiting for this pack do not each make the
        mirror fetch it from its origin again. Each probe that comes too early costs the origin
        one cut-short fetch; the probes start after 0.25 s and back off to 2 s."""
        delay, deadline = 0.25, time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(2.0, delay * 2)
            try:
                r = self.api.send("GET", self.api.url(f"blobs/{pack}"), f"probe pack {pack}", stream=True, ok=(200, 206),
                               headers={"Range": "bytes=0-0"})
                st = r.status_code
                r.close()
            except (TransientBackendError, ObjectNotFound):
                return  # the reads themselves will say what is wrong
            if st == 206:
                return
        log.debug("pack %s: the registry still answers whole blobs after %g s", pack, limit)

    def stat(self, key: str) -> ObjectInfo:
        d = _digest_from_chunk_key(key)
        if d is not None:
            with self._mu:
                p = self._filling.get(d)
            if p is not None:
                return ObjectInfo(key, p.chunks[d][1], time.time())
            loc = self._locate(d)
            if loc is None:
                raise ObjectNotFound(key, self.location(key))
            pk = self._packs[loc[0]]
            return ObjectInfo(key, loc[2], pk.created)
        if key.startswith("manifests/sha256/") and _HEX64.match(key[17:]):
            a = self._artifact(key[17:])
            return ObjectInfo(key, a.size, a.created)
        _, doc = self._object(key)
        return ObjectInfo(key, int(doc["layers"][0].get("size", 0)), _mtime((doc.get("annotations") or {}).get(CREATED)))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        out: list[ObjectInfo] = []
        if "chunks/".startswith(prefix) or prefix.startswith("chunks/"):
            self._scan()
            with self._mu:
                items = [(d, loc) for d, loc in self._chunks.items()]
            for d, (pack, _, n) in items:
                k = chunk_key(d)
                if k.startswith(prefix):
                    out.append(ObjectInfo(k, n, self._packs[pack].created))
        tags = self.api.tags()
        if "manifests/".startswith(prefix) or prefix.startswith("manifests/"):
            for t in tags:
                if t.startswith("manifest-") and _HEX64.match(t[9:]) and f"manifests/sha256/{t[9:]}".startswith(prefix):
                    try:
                        a = self._artifact(t[9:])
                    except ObjectNotFound:
                        continue
                    out.append(ObjectInfo(f"manifests/sha256/{t[9:]}", a.size, a.created))
        cands = [t for t in tags if _tag_may_hold(t, prefix)]

        def one(t: str) -> ObjectInfo | None:
            try:
                _, doc = self.api.get_manifest(t, f"object under tag {t}")
            except ObjectNotFound:
                return None
            ann = doc.get("annotations") or {}
            key = ann.get(KEY_ANNOTATION)
            if doc.get("artifactType") != OBJECT_TYPE or not isinstance(key, str) or not key.startswith(prefix):
                return None
            if object_tag(key) != t:
                log.warning("ignoring %s:%s: it claims key %r, whose tag is %s", self.location(), t, key, object_tag(key))
                return None
            return ObjectInfo(key, int(doc["layers"][0].get("size", 0)), _mtime(ann.get(CREATED)))

        with ThreadPoolExecutor(8) as ex:
            out += [o for o in ex.map(one, cands) if o is not None]
        return iter(out)

    def remove(self, key: str) -> None:
        d = _digest_from_chunk_key(key)
        if d is not None:
            return self._remove_chunk(d)
        if key.startswith("manifests/sha256/") and _HEX64.match(key[17:]):
            try:  # its packs stay known, so that gc can free the chunks no other snapshot uses
                self._load_artifact_indexes(self._artifact(key[17:]))
            except (ObjectNotFound, IntegrityError):
                pass
            self.api.delete_manifest(f"manifest-{key[17:]}", f"remove snapshot artifact manifest-{key[17:]}")
            with self._mu:
                self._artifacts.pop(f"sha256:{key[17:]}", None)
            return
        self.api.delete_manifest(object_tag(key), f"remove {key} (tag {object_tag(key)})")

    def _remove_chunk(self, d: str) -> None:
        """Forget chunk ``d``; once no chunk of its pack is left, delete the pack and its index
        blob (a pack shared with a live snapshot keeps its dead chunks: see docs)."""
        self._scan()
        with self._mu:
            loc = self._chunks.pop(d, None)
            if loc is None:
                return
            pack = self._packs.get(loc[0])
            if pack is None:
                return
            pack.live.discard(d)
            if pack.live or any(loc[0] in a.packs for a in self._artifacts.values()):
                return
        for blob in (pack.digest, pack.index):
            try:
                self.api.send("DELETE", self.api.url(f"blobs/{blob}"), f"remove pack blob {blob}", ok=(202, 200)).close()
            except ObjectNotFound:
                pass
            self.api.have_blobs.discard(blob)

    def close(self) -> None:
        with self._mu:
            pend = self._open + self._full
            self._open, self._full = [], []
            self._filling.clear()
        for p in pend:  # chunks no manifest named: never uploaded, like a killed writer's
            p.close()
        self.api.client.close()
