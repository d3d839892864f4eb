"""Sealed stores: every object encrypted and authenticated before it leaves the host, so a
bucket, a registry or a stolen disk shows nothing of the engine (docs/store-format.md,
"Sealed stores").

A store is sealed when it holds ``sealed.json`` (written by :func:`seal_store`, ``warmctl seal
URL``). :func:`warmctl.store.open_backend` then wraps its backend in
:class:`SealedBackend`, a wrapper like the retry and cache ones: ``save`` encrypts, ``load``
decrypts, with the host's fleet key (``seal_key`` in the config).

Envelope: the store has one random 256-bit **data key**; ``sealed.json`` holds it wrapped
(AES-256-GCM) by one or more **fleet keys**, each named by its key id (:func:`key_id`).
Rotating the fleet key re-wraps the data key (:func:`seal_store` with ``old_key``): no object
is rewritten or uploaded again. Each object is ``MAGIC | nonce (12 bytes) | AES-256-GCM(data
key, nonce, plaintext, associated data = the object's key)``: a flipped byte, a truncated
object or one object put in another's place fails authentication, naming the object.

What stays in the clear: the object names (``chunks/blake3/ab/<digest of the plaintext>``:
deduplication and resumable copies work as before, and whoever can list the bucket sees how
many chunks and snapshots there are and can test whether a chunk of a known plaintext is
there), object sizes (+32 bytes each), ``config``, ``sealed.json`` (the wrapped data key, the
key ids) and the writer locks under ``locks/`` (so ``gc`` and writers of hosts without the key
still see each other). Reading anything else needs the key: ``verify``, ``gc``, ``ls`` and
``up`` on a host without it fail with :class:`SealKeyError` naming the store's key ids.

A fleet key file holds 32 random bytes as one line of base64 (``head -c 32 /dev/urandom |
base64 > fleet.key``, mode 0600); :func:`load_key` reads it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from warmctl.base.errors import IntegrityError, WarmctlError
from warmctl.store.backend import Backend, ForwardingBackend, ObjectNotFound

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

# cryptography is imported where an object is sealed or opened: opening a store that is not
# sealed (what `warmctl up` from a local store does) never loads it

#: The object that marks a store as sealed (plaintext JSON: format, cipher, wrapped data key).
SEALED = "sealed.json"
#: Objects of a sealed store that stay in the clear (see the module doc).
CLEAR = ("config", SEALED)
CLEAR_PREFIXES = ("locks/",)
MAGIC = b"WSL1"
NONCE = 12
#: Bytes a sealed object has beyond its plaintext: magic, nonce, GCM tag.
OVERHEAD = len(MAGIC) + NONCE + 16
CIPHER = "AES-256-GCM"


class SealKeyError(WarmctlError):
    """A sealed store cannot be read or written with this host's fleet key: none is
    configured, it is another key (the message names the store's key ids and this host's), or
    the key file is unusable."""


def key_id(key: bytes) -> str:
    """The id of a fleet key (``seal-`` + 16 hex digits of a SHA-256 of the key): named in
    errors and in ``sealed.json``, never the key."""
    return "seal-" + hashlib.sha256(b"warmctl-seal-key\0" + key).hexdigest()[:16]


def load_key(path: Path) -> bytes:
    """The 32-byte fleet key in ``path`` (one line of base64). Raises :class:`SealKeyError`
    naming the file when it cannot be read, is readable by group or others, or does not hold
    32 bytes of base64."""
    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text().strip()
    except OSError as e:
        raise SealKeyError(f"fleet key file {path}: cannot read: {e.strerror}") from None
    if st.st_mode & 0o077:
        raise SealKeyError(f"fleet key file {path}: mode {st.st_mode & 0o777:o} lets others read it; run: chmod 600 {path}")
    try:
        key = base64.b64decode(text, validate=True)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise SealKeyError(f"fleet key file {path}: want one line of base64 holding 32 bytes "
                           "(head -c 32 /dev/urandom | base64)")
    return key


def _wrap(fleet: bytes, data_key: bytes, dk_id: str) -> str:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = os.urandom(NONCE)
    return base64.b64encode(nonce + AESGCM(fleet).encrypt(nonce, data_key, b"warmctl-seal-dek\0" + dk_id.encode())).decode()


def _unwrap(fleet: bytes, wrapped: str, dk_id: str) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    raw = base64.b64decode(wrapped)
    return AESGCM(fleet).decrypt(raw[:NONCE], raw[NONCE:], b"warmctl-seal-dek\0" + dk_id.encode())


def read_seal(backend: Backend) -> dict | None:
    """The store's ``sealed.json`` document, or None when the store is not sealed."""
    try:
        return json.loads(backend.load(SEALED))
    except ObjectNotFound:
        return None
    except ValueError:
        raise IntegrityError(f"{backend.location(SEALED)} is not valid JSON") from None


def seal_store(backend: Backend, key: bytes, old_key: bytes | None = None, drop_old: bool = True) -> dict:
    """Seal the store of ``backend`` for the fleet key ``key``, or re-wrap its data key:

    - not sealed yet: a new data key, wrapped by ``key``; the store must hold no chunk,
      manifest or catalog entry yet (objects written before would stay in the clear);
    - sealed: ``old_key`` (a fleet key it is sealed for) unwraps the data key, which is then
      wrapped by ``key`` too; with ``drop_old`` the old key's wrap is removed (rotation). No
      object is rewritten.

    Returns the new ``sealed.json`` document. Raises :class:`SealKeyError`."""
    doc = read_seal(backend)
    if doc is None:
        for prefix in ("chunks/", "manifests/", "catalog/"):
            if next(iter(backend.list(prefix)), None) is not None:
                raise SealKeyError(f"store {backend.location()} already holds objects ({prefix}...) in the clear; "
                                   "seal a new, empty store and push to it")
        data_key = secrets.token_bytes(32)
        dk_id = "data-" + secrets.token_hex(8)
        doc = {"format": 1, "cipher": CIPHER, "data_key": {"id": dk_id, "wrapped": {key_id(key): _wrap(key, data_key, dk_id)}}}
    else:
        dk = doc["data_key"]
        if old_key is None:
            raise SealKeyError(f"store {backend.location()} is sealed already (fleet keys {', '.join(dk['wrapped'])}); "
                               "give the current fleet key to re-wrap its data key")
        data_key = SealedBackend(backend, old_key, doc).data_key
        if drop_old:
            dk["wrapped"].pop(key_id(old_key), None)
        dk["wrapped"][key_id(key)] = _wrap(key, data_key, dk["id"])
    backend.save(SEALED, json.dumps(doc, sort_keys=True, indent=1).encode() + b"\n")
    return doc


class SealedBackend(ForwardingBackend):
    """Wraps the backend of a sealed store (see the module doc). ``key``: this host's fleet
    key (None: no ``seal_key`` configured; every sealed object then raises
    :class:`SealKeyError`); ``doc``: the store's ``sealed.json``; ``key_file``: where the key
    came from, for messages."""

    def __init__(self, inner: Backend, key: bytes | None, doc: dict, key_file: Path | str | None = None):
        super().__init__(inner)
        self.doc = doc
        dk = doc.get("data_key") or {}
        self.data_key_id: str = dk.get("id", "?")
        self.fleet_key_ids: list[str] = sorted(dk.get("wrapped", {}))
        self._key, self._key_file = key, key_file
        self._aead: AESGCM | None = None

    @property
    def data_key(self) -> bytes:
        """The store's data key, unwrapped with this host's fleet key. Raises
        :class:`SealKeyError` naming the store's fleet key ids and this host's."""
        where = f"store {self.inner.location()} is sealed for fleet key {', '.join(self.fleet_key_ids)}"
        if self._key is None:
            raise SealKeyError(f"{where}; this host has no fleet key (set seal_key in the config to the key file; "
                               "docs/store-format.md, \"Sealed stores\")")
        kid = key_id(self._key)
        wrapped = self.doc.get("data_key", {}).get("wrapped", {}).get(kid)
        mine = f"this host's seal_key{f' {self._key_file}' if self._key_file else ''} is {kid}"
        if wrapped is None:
            raise SealKeyError(f"{where}; {mine}")
        from cryptography.exceptions import InvalidTag

        try:
            return _unwrap(self._key, wrapped, self.data_key_id)
        except (InvalidTag, ValueError):
            raise SealKeyError(f"{where}: the data key wrapped for {kid} does not open with {mine.split(' is ')[0]} "
                               f"({self.inner.location(SEALED)} damaged?)") from None

    def _cipher(self) -> AESGCM:
        if self._aead is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._aead = AESGCM(self.data_key)
        return self._aead

    @staticmethod
    def clear(key: str) -> bool:
        """Whether ``key`` stays in the clear (see the module doc)."""
        return key in CLEAR or key.startswith(CLEAR_PREFIXES)

    def seal(self, key: str, data: bytes | memoryview) -> bytes:
        """The sealed form of ``data`` stored as ``key``."""
        nonce = os.urandom(NONCE)
        return MAGIC + nonce + self._cipher().encrypt(nonce, bytes(data), key.encode())

    def open(self, key: str, blob: bytes | memoryview) -> bytes:
        """The plaintext of the sealed object ``key``. Raises :class:`IntegrityError` naming
        the object when it fails authentication (a flipped byte, a truncation, another
        object's bytes, or one written with another data key)."""
        raw = bytes(blob)
        if not raw.startswith(MAGIC) or len(raw) < OVERHEAD:
            raise IntegrityError(f"sealed object {self.inner.location(key)}: not sealed (no {MAGIC.decode()} header); "
                                 "written in the clear into a sealed store, or damaged")
        from cryptography.exceptions import InvalidTag

        try:
            return self._cipher().decrypt(raw[len(MAGIC):len(MAGIC) + NONCE], raw[len(MAGIC) + NONCE:], key.encode())
        except InvalidTag:
            raise IntegrityError(f"sealed object {self.inner.location(key)} fails authentication: damaged, truncated "
                                 f"or not written with data key {self.data_key_id} for this name") from None

    # -- Backend (what sealing changes; the rest is forwarded)

    def save(self, key: str, data: bytes | memoryview) -> None:
        if self.clear(key):
            self.inner.save(key, data)
        else:  # the plaintext too: a registry's layout reads a manifest to list its packs
            self.inner.save_sealed(key, self.seal(key, data), data)

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if self.clear(key):
            return self.inner.load(key, offset, length)
        data = self.open(key, self.inner.load(key))
        return data[offset:None if length is None else offset + length]

    def load_into(self, key: str, buf: bytearray, limit: int | None = None) -> memoryview:
        if self.clear(key):
            return self.inner.load_into(key, buf, limit)
        # the stored object is OVERHEAD bytes longer than the plaintext ``limit`` bounds
        data = self.open(key, self.inner.load_into(key, buf, None if limit is None else limit + OVERHEAD))
        if len(data) <= len(buf):
            buf[:len(data)] = data
            return memoryview(buf)[:len(data)]
        return memoryview(bytearray(data))
