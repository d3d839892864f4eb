"""Signed manifests: ed25519 keys, signatures stored next to the chunks, and the trust check.

What is signed is the manifest's digest (``sha256:<hex>`` of its canonical bytes), prefixed by a
domain string: ``b"warmctl/manifest-signature/v1\\n" + digest``. Because every chunk's digest is
inside the manifest, a valid signature plus digest-checked reads of the manifest and of every
chunk (the store checks each chunk against its digest on read) covers the whole snapshot: a
changed manifest byte changes its digest (no signature for it), a changed chunk fails its digest,
and a chunk swapped for other content's valid digest changes the manifest.

Storage: one JSON object per (manifest, key) in the store's backend, under
``signatures/<algo>/<hex>/<key_id>.json`` (format in ``catalog/README.md``). Trusted public keys
are the ``*.pub`` files in ``Settings.keys_dir`` (PEM ``SubjectPublicKeyInfo`` as written by
:func:`generate_keypair`, or an OpenSSH ``ssh-ed25519 ...`` line). A key's id is the first 32 hex
digits of the sha256 of its raw 32-byte public key.
"""

# No `from __future__ import annotations` here: pydantic would then evaluate each field's
# annotation from its string when the class is made (compiling it), about 4 ms of every
# `warmctl up` over the model modules it imports (docs/benchmarks.md).

import base64
import hashlib
import json
import logging
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from warmctl.base.errors import IntegrityError, WarmctlError
from warmctl.records.manifest import Manifest
from warmctl.store.backend import load_limited
from warmctl.store.layout import MAX_SIGNATURE_BYTES

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# cryptography is imported by the functions that use a key: an `up` of an unsigned snapshot with
# no trusted keys never loads it (tests/test_startup_imports.py)

log = logging.getLogger(__name__)

#: Prefix of the signed message (domain separation: these keys sign nothing else by accident).
SIGNATURE_DOMAIN = b"warmctl/manifest-signature/v1\n"
SIGNATURE_FORMAT = 1
SIGNATURES_PREFIX = "signatures/"
#: Prefix of a signed catalog entry's message (names are signed, like manifests).
ENTRY_SIGNATURE_DOMAIN = b"warmctl/catalog-entry-signature/v1\n"
#: The entry fields an entry signature covers: everything a node acts on (the path it lives at
#: repeats name, tag and manifest; ``created`` orders entries and is what rollback protection
#: compares; ``compat`` and ``profile_digest`` choose among them). ``published``, ``size``,
#: ``host`` and ``signed_by`` are not covered: ``host`` is checked against the signed manifest's.
ENTRY_SIGNED_FIELDS = ("name", "tag", "manifest", "created", "compat", "profile_digest")


class TrustError(WarmctlError):
    """A snapshot is unsigned, signed only by untrusted keys, or its signature does not verify;
    or a key file is unusable. Raised before anything from the snapshot is materialized."""


class KeyPair(NamedTuple):
    """Paths written by :func:`generate_keypair` and the key's id."""

    private: Path
    public: Path
    key_id: str


class SignatureDoc(BaseModel):
    """A stored signature. ``signature`` is base64 of the 64-byte ed25519 signature over
    :func:`signed_message` of ``manifest``; ``signed`` (UTC) is informational, not signed."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    format: int = SIGNATURE_FORMAT
    algorithm: str = "ed25519"
    key_id: str
    manifest: str
    signed: datetime
    signature: str


class Verification(BaseModel):
    """Result of :func:`verify_manifest`.

    ``trusted``: a trusted key's signature verified. ``key_id``/``key_file``: that key.
    ``insecure``: verification was skipped by request and ``warning`` says what failed.
    """

    model_config = ConfigDict(defer_build=True, arbitrary_types_allowed=True)

    digest: str
    manifest: Manifest
    trusted: bool
    key_id: str | None = None
    key_file: Path | None = None
    insecure: bool = False
    warning: str | None = None


# --------------------------------------------------------------------------- keys


def key_id(public_key: "Ed25519PublicKey") -> str:
    """First 32 hex digits of sha256 over the raw 32-byte public key."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


def generate_keypair(directory: str | Path, name: str = "warmctl", *, overwrite: bool = False) -> KeyPair:
    """Write ``DIR/NAME.key`` (PEM PKCS#8, unencrypted, mode 0600, created that way, never
    world-readable even briefly) and ``DIR/NAME.pub`` (PEM SubjectPublicKeyInfo, mode 0644).

    Copy the ``.pub`` file into ``keys_dir`` on every restoring host; point ``signing_key`` at
    the ``.key`` on the publishing host. Raises :class:`TrustError` if either file exists and
    ``overwrite`` is false, or ``name`` contains a path separator.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if not name or "/" in name or name.startswith("."):
        raise TrustError(f"key name {name!r}: want a plain file name (no '/', not starting with '.')")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    priv_path, pub_path = d / f"{name}.key", d / f"{name}.pub"
    if not overwrite:
        for p in (priv_path, pub_path):
            if p.exists():
                raise TrustError(f"{p} already exists (pass overwrite/--force to replace it)")
    key = Ed25519PrivateKey.generate()
    priv_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub_pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    if overwrite:
        priv_path.unlink(missing_ok=True)
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(priv_pem)
    os.chmod(priv_path, 0o600)  # umask cannot loosen it, but make the mode explicit
    pub_path.write_bytes(pub_pem)
    os.chmod(pub_path, 0o644)
    return KeyPair(priv_path, pub_path, key_id(key.public_key()))


def load_private_key(path: str | Path) -> "Ed25519PrivateKey":
    """Load an unencrypted ed25519 private key (PEM PKCS#8 or OpenSSH).

    Raises :class:`TrustError` naming the file when it is missing, readable by group or others
    (like ssh, warmctl refuses such a key), not a key, or not ed25519.
    """
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    p = Path(path)
    try:
        mode = p.stat().st_mode & 0o777
        data = p.read_bytes()
    except OSError as e:
        raise TrustError(f"signing key {p}: cannot read: {e.strerror}") from None
    if mode & 0o077:
        raise TrustError(f"signing key {p}: mode {mode:04o} lets group/others read it; run: chmod 600 {p}")
    try:
        if data.startswith(b"-----BEGIN OPENSSH PRIVATE KEY"):
            key: Any = serialization.load_ssh_private_key(data, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise TrustError(f"signing key {p}: not an unencrypted PEM/OpenSSH private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise TrustError(f"signing key {p}: is a {type(key).__name__}, warmctl signs with ed25519 only")
    return key


def load_public_key(path: str | Path) -> "Ed25519PublicKey":
    """Load an ed25519 public key (PEM SubjectPublicKeyInfo or one OpenSSH ``ssh-ed25519`` line).
    Raises :class:`TrustError` naming the file otherwise."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TrustError(f"trusted key {p}: cannot read: {e.strerror}") from None
    try:
        if data.lstrip().startswith(b"ssh-"):
            key: Any = serialization.load_ssh_public_key(data.strip())
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise TrustError(f"trusted key {p}: not a PEM or OpenSSH public key: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise TrustError(f"trusted key {p}: is a {type(key).__name__}, warmctl trusts ed25519 keys only")
    return key


def load_trusted_keys(keys_dir: str | Path) -> "dict[str, tuple[Path, Ed25519PublicKey]]":
    """``{key_id: (file, key)}`` for every ``*.pub`` in ``keys_dir`` (sorted by file name).

    A missing directory gives ``{}``. An unusable ``.pub`` file raises :class:`TrustError`
    naming it: a broken trust directory is a configuration error, not something to skip.
    """
    d = Path(keys_dir)
    if not d.is_dir():
        return {}
    keys: dict[str, tuple[Path, Ed25519PublicKey]] = {}
    for p in sorted(d.glob("*.pub")):
        k = load_public_key(p)
        keys.setdefault(key_id(k), (p, k))
    return keys


# --------------------------------------------------------------------------- signatures


def signed_message(digest: str) -> bytes:
    """The bytes an ed25519 signature covers for manifest ``digest``."""
    return SIGNATURE_DOMAIN + digest.encode("ascii")


def signature_prefix(digest: str) -> str:
    """Backend key prefix of ``digest``'s signatures: ``signatures/<algo>/<hex>/``."""
    algo, sep, hexpart = digest.partition(":")
    if not sep or not algo.isalnum() or not hexpart or not all(c in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"malformed manifest digest {digest!r} (want '<algo>:<lowercase hex>')")
    return f"{SIGNATURES_PREFIX}{algo}/{hexpart}/"


def sign_manifest(store: Any, digest: str, key: "str | Path | Ed25519PrivateKey") -> SignatureDoc:
    """Sign manifest ``digest`` with ``key`` (a private key or its file) and save the signature in
    ``store.backend`` at ``signatures/<algo>/<hex>/<key_id>.json`` (replacing that key's earlier
    signature of the same manifest). Returns the stored document. Raises :class:`TrustError` for
    an unusable key file; backend errors pass through.
    """
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = key if isinstance(key, Ed25519PrivateKey) else load_private_key(key)
    kid = key_id(k.public_key())
    doc = SignatureDoc(
        key_id=kid,
        manifest=digest,
        signed=datetime.now(timezone.utc),
        signature=base64.b64encode(k.sign(signed_message(digest))).decode(),
    )
    key, body = signature_prefix(digest) + f"{kid}.json", doc.model_dump_json().encode()
    if hasattr(store, "commit"):  # under the writer lock, checked (warmctl.store.Store.commit)
        store.commit(key, body, f"signing {digest}")
    else:
        store.backend.save(key, body)
    return doc


def signatures(store: Any, digest: str) -> list[SignatureDoc | str]:
    """Every signature object stored for ``digest``: parsed documents, or for an unparseable
    object a string naming its location and the problem."""
    out: list[SignatureDoc | str] = []
    backend = store.backend
    for info in sorted(backend.list(signature_prefix(digest)), key=lambda i: i.key):
        try:
            doc = SignatureDoc.model_validate_json(load_limited(backend, info.key, MAX_SIGNATURE_BYTES, "signature"))
        except (ValidationError, ValueError, IntegrityError) as e:
            out.append(f"{backend.location(info.key)}: unreadable signature: {str(e).splitlines()[0]}")
            continue
        out.append(doc)
    return out


def _verify_by(trusted: "dict[str, tuple[Path, Ed25519PublicKey]]", kid: str, algorithm: str, signature: str,
               message: bytes, among: str) -> str | None:
    """None when the ed25519 ``signature`` (base64) of ``message`` by key ``kid`` is one a key in
    ``trusted`` makes; else the problem, in words (``among``: where trusted keys are)."""
    from cryptography.exceptions import InvalidSignature

    if algorithm != "ed25519":
        return f"signature by key {kid}: algorithm {algorithm!r} is not ed25519"
    if kid not in trusted:
        return f"signed by key {kid}, which is not trusted (not among {among})"
    path, pub = trusted[kid]
    try:
        pub.verify(base64.b64decode(signature, validate=True), message)
    except (InvalidSignature, ValueError):
        return f"signature by trusted key {kid} ({path}) does not verify"
    return None


def check_signatures(store: Any, digest: str, keys_dir: str | Path) -> tuple[str, Path]:
    """The trust decision alone: ``(key_id, key_file)`` of a trusted key whose signature of
    ``digest`` verifies. Raises :class:`TrustError` listing what was found otherwise (no trusted
    keys configured, unsigned, signed by untrusted keys, bad signatures)."""
    trusted = load_trusted_keys(keys_dir)
    if not trusted:
        raise TrustError(
            f"no trusted keys: {keys_dir} has no *.pub file; copy the publisher's public key there "
            f"(warmctl keygen writes one)"
        )
    problems: list[str] = []
    for doc in signatures(store, digest):
        if isinstance(doc, str):
            problems.append(doc)
            continue
        if doc.manifest != digest:
            problems.append(f"signature by key {doc.key_id} is for {doc.manifest}, not {digest}")
            continue
        problem = _verify_by(trusted, doc.key_id, doc.algorithm, doc.signature, signed_message(digest), f"{keys_dir}/*.pub")
        if problem:
            problems.append(problem)
            continue
        return doc.key_id, trusted[doc.key_id][0]
    if not problems:
        raise TrustError(
            f"snapshot {digest} is unsigned: no signature at {store.backend.location(signature_prefix(digest))}"
        )
    raise TrustError(f"snapshot {digest} is not trusted: " + "; ".join(problems))


def verify_manifest(
    store: Any,
    digest: str,
    keys_dir: str | Path,
    insecure: bool = False,
    *,
    verify_chunks: bool = False,
) -> Verification:
    """Decide whether manifest ``digest`` in ``store`` may be restored; call it before anything
    from the snapshot is materialized.

    1. Trust: a signature of ``digest`` by a key in ``keys_dir`` verifies (:func:`check_signatures`).
    2. Integrity: the stored manifest's bytes hash to ``digest`` (``store.get_manifest`` checks;
       the parsed manifest's canonical digest is compared again here).
    3. With ``verify_chunks``: every chunk the manifest names is read back and re-hashed
       (:func:`warmctl.store.maintenance.verify` of ``[digest]``), so a changed, truncated,
       missing or swapped chunk raises here. Reads from the store (``pull``, ``read_file``) check each chunk anyway, so ``up``
       need not pay for this; it is for audits and for a store that is materialized directly.

    ``insecure=True`` (the CLI's ``--insecure-skip-verify``) turns a failed *trust* step into a
    loud warning (logged at WARNING and returned in ``warning``); integrity failures still raise.
    Raises :class:`TrustError`, :class:`warmctl.base.errors.IntegrityError` (manifest or chunk does
    not match its digest, or is missing).
    """
    key: str | None = None
    key_file: Path | None = None
    warning: str | None = None
    try:
        key, key_file = check_signatures(store, digest, keys_dir)
    except TrustError as e:
        if not insecure:
            raise
        warning = f"INSECURE: restoring a snapshot whose signature was not verified: {e}"
        log.warning(warning)
    manifest = store.get_manifest(digest)  # IntegrityError: missing, or bytes do not hash to digest
    if manifest.digest() != digest:
        raise IntegrityError(f"manifest {digest}: stored content hashes to {manifest.digest()}")
    if verify_chunks:
        _verify_chunks(store, digest)
    return Verification(
        digest=digest,
        manifest=manifest,
        trusted=key is not None,
        key_id=key,
        key_file=key_file,
        insecure=warning is not None,
        warning=warning,
    )


def _verify_chunks(store: Any, digest: str) -> None:
    from warmctl.store import maintenance

    rep = maintenance.verify(store, [digest])
    problems = [*rep.bad_manifests, *(str(p) for p in rep.missing), *(str(p) for p in rep.corrupt)]
    if problems:
        raise IntegrityError(f"snapshot {digest} in {store.location}: " + "; ".join(problems[:5])
                             + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))


def signature_summary(store: Any, digest: str, keys_dir: str | Path | None) -> str:
    """One line for listings: ``trusted (key K)``, ``untrusted: ...`` or ``unsigned``; never raises
    for trust problems (they are the answer)."""
    try:
        if keys_dir is None:
            raise TrustError("no keys_dir")
        kid, _ = check_signatures(store, digest, keys_dir)
        return f"trusted (key {kid})"
    except TrustError as e:
        docs = [d for d in signatures(store, digest) if isinstance(d, SignatureDoc)]
        if not docs:
            return "unsigned"
        return f"signed by {', '.join(d.key_id for d in docs)}; not trusted here ({str(e)[:120]})"


# --------------------------------------------------------------------------- signed catalog entries


class EntrySignature(BaseModel):
    """One signature of a catalog entry: ``key_id``, ``algorithm`` and base64 ``signature``
    over :func:`entry_message`; ``signed`` (UTC) is informational."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    algorithm: str = "ed25519"
    key_id: str
    signed: datetime
    signature: str


class EntrySignatures(BaseModel):
    """The object ``catalog/<name>/<tag>/<algo>-<hex>.sig`` beside an entry: its signatures."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    format: int = SIGNATURE_FORMAT
    kind: str = "catalog-entry-signatures"
    signatures: list[EntrySignature]


def entry_fields(entry: Any) -> dict[str, str]:
    """The signed fields of ``entry`` (a :class:`warmctl.naming.catalog.CatalogEntry`) as strings;
    ``created`` in UTC ISO 8601 (so a signer and a verifier that parsed it agree)."""
    out = {}
    for f in ENTRY_SIGNED_FIELDS:
        v = getattr(entry, f)
        out[f] = v.astimezone(timezone.utc).isoformat() if isinstance(v, datetime) else str(v)
    return out


def entry_message(entry: Any) -> bytes:
    """The bytes an entry signature covers: :data:`ENTRY_SIGNATURE_DOMAIN` plus canonical JSON
    (sorted keys, no spaces) of :func:`entry_fields`."""
    return ENTRY_SIGNATURE_DOMAIN + json.dumps(entry_fields(entry), sort_keys=True, separators=(",", ":")).encode()


def sign_entry(entry: Any, key: "str | Path | Ed25519PrivateKey") -> EntrySignature:
    """Sign catalog entry ``entry`` with ``key`` (a private key or its file). Raises
    :class:`TrustError` for an unusable key file."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = key if isinstance(key, Ed25519PrivateKey) else load_private_key(key)
    return EntrySignature(key_id=key_id(k.public_key()), signed=datetime.now(timezone.utc),
                          signature=base64.b64encode(k.sign(entry_message(entry))).decode())


def check_entry(entry: Any, sigs: EntrySignatures | None, trusted: "dict[str, tuple[Path, Ed25519PublicKey]]",
                where: str) -> str:
    """The id of a trusted key whose signature of ``entry`` verifies. ``trusted``:
    :func:`load_trusted_keys`'s answer; ``where``: the entry's location, for messages.
    Raises :class:`TrustError` saying what was found instead (unsigned, untrusted keys, a
    signature that does not verify: the entry was changed, or written by someone else)."""
    if sigs is None or not sigs.signatures:
        raise TrustError(f"catalog entry {where} is unsigned (published before entries were signed, or "
                         "not by a publisher: re-publish it, or `warmctl push` it from a host with signing_key)")
    msg = entry_message(entry)
    problems = []
    for s in sigs.signatures:
        problem = _verify_by(trusted, s.key_id, s.algorithm, s.signature, msg, "the trusted keys")
        if problem:
            problems.append(problem + (" (the entry was changed)" if problem.endswith("does not verify") else ""))
            continue
        return s.key_id
    raise TrustError(f"catalog entry {where} is not trusted: " + "; ".join(problems))


# --------------------------------------------------------------------------- the trusted-keys directory


def install_public_key(public: str | Path, keys_dir: str | Path, stem: str) -> tuple[Path, bool]:
    """Trust the public key in file ``public`` by writing it into ``keys_dir`` as
    ``<stem>-<key id>.pub`` (mode 0644): a file named by its key's id, so a second key never
    replaces a first one (a second home on one host overwrote the first's
    ``local-<hostname>.pub`` and every snapshot of the first then failed ``up``).

    Returns ``(path, installed)``: ``installed`` is False when the key is trusted already (by
    that file or any other ``*.pub`` in ``keys_dir``; nothing is written). Never replaces a file:
    if ``<stem>-<key id>.pub`` exists with another key in it, raises :class:`TrustError` naming
    it. ``stem`` must be a plain file name part.
    """
    from cryptography.hazmat.primitives import serialization

    if not stem or "/" in stem or stem.startswith("."):
        raise TrustError(f"key file stem {stem!r}: want a plain file name (no '/', not starting with '.')")
    key = load_public_key(public)
    kid = key_id(key)
    d = Path(keys_dir)
    existing = load_trusted_keys(d)
    if kid in existing:
        return existing[kid][0], False
    d.mkdir(parents=True, exist_ok=True)
    dest = d / f"{stem}-{kid}.pub"
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise TrustError(f"{dest} exists and holds another key than {kid}; not replacing it "
                         f"(remove trust explicitly with `warmctl keys rm`)") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(dest, 0o644)
    return dest, True


def remove_trusted_key(keys_dir: str | Path, key: str) -> tuple[str, list[Path]]:
    """Stop trusting the key whose id is ``key`` (or starts with it; at least 8 hex digits):
    remove every ``*.pub`` in ``keys_dir`` holding it. Returns ``(full key id, removed files)``.

    Raises :class:`TrustError` when no trusted key has that id, when a prefix names more than
    one key (all named), or when the prefix is shorter than 8 digits.
    """
    d = Path(keys_dir)
    key = key.strip().lower()
    if len(key) < 8 or any(c not in "0123456789abcdef" for c in key):
        raise TrustError(f"key id {key!r}: give at least 8 hex digits of it (`warmctl keys ls` shows them)")
    matches = {kid for p in sorted(d.glob("*.pub")) if d.is_dir()
               for kid in [key_id(load_public_key(p))] if kid.startswith(key)}
    if not matches:
        raise TrustError(f"no trusted key {key} in {d} (`warmctl keys ls` shows them)")
    if len(matches) > 1:
        raise TrustError(f"key id {key} is ambiguous in {d}: " + ", ".join(sorted(matches)))
    (kid,) = matches
    removed = []
    for p in sorted(d.glob("*.pub")):
        if key_id(load_public_key(p)) == kid:
            p.unlink()
            removed.append(p)
    return kid, removed
