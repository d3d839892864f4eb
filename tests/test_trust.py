"""Signatures and trust against the real store: keys, signing, and every tamper case refused
before anything from the snapshot is written out as executable state."""

from __future__ import annotations

import base64
import logging
import random
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from warmctl.base.errors import IntegrityError, WarmctlError
from warmctl.records.manifest import CanaryRecord, FileEntry, Manifest, RestoreInfo
from warmctl.store import Store, chunk_key, manifest_key, open_store
from warmctl.store import chunks as ck
from warmctl.naming.trust import (
    SignatureDoc,
    TrustError,
    generate_keypair,
    key_id,
    load_private_key,
    load_public_key,
    load_trusted_keys,
    sign_manifest,
    signature_prefix,
    signatures,
    verify_manifest,
)


def _file(path: Path, n: int, seed: int) -> Path:
    path.write_bytes(random.Random(seed).randbytes(n))
    return path


def _manifest(store: Store, files: dict[str, Path], **kw) -> Manifest:
    entries = [FileEntry(path=rel, size=p.stat().st_size, chunks=store.add_file(p)) for rel, p in files.items()]
    return Manifest(
        name=kw.pop("name", "tiny"),
        profile_digest="sha256:" + "1" * 64,
        profile={"name": "tiny"},
        host=kw.pop("host", {}),
        canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]),
        files=entries,
        **kw,
    )


@pytest.fixture
def snap(tmp_path):
    """A store with one signed snapshot (two files), the trusted keys dir and the keypair."""
    store = open_store(tmp_path / "store")
    a = _file(tmp_path / "pages-1.img", 300_000, 1)
    b = _file(tmp_path / "other.img", 200_000, 2)
    m = _manifest(store, {"pages-1.img": a, "core.img": b})
    digest = store.put_manifest(m)
    kp = generate_keypair(tmp_path / "publisher")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "publisher.pub").write_bytes(kp.public.read_bytes())
    sign_manifest(store, digest, kp.private)
    yield store, m, digest, keys, kp
    store.close()


# ----------------------------------------------------------------------------- keys


def test_keygen_writes_private_0600_and_loadable_public(tmp_path):
    kp = generate_keypair(tmp_path / "k", "ops")
    assert kp.private == tmp_path / "k" / "ops.key" and kp.public == tmp_path / "k" / "ops.pub"
    assert stat.S_IMODE(kp.private.stat().st_mode) == 0o600
    priv, pub = load_private_key(kp.private), load_public_key(kp.public)
    assert key_id(priv.public_key()) == key_id(pub) == kp.key_id and len(kp.key_id) == 32
    with pytest.raises(TrustError, match="already exists"):
        generate_keypair(tmp_path / "k", "ops")
    assert generate_keypair(tmp_path / "k", "ops", overwrite=True).key_id != kp.key_id
    with pytest.raises(TrustError, match="plain file name"):
        generate_keypair(tmp_path, "../evil")


def test_key_loading_refuses_loose_modes_wrong_types_and_garbage(tmp_path):
    kp = generate_keypair(tmp_path)
    kp.private.chmod(0o644)
    with pytest.raises(TrustError, match=r"mode 0644 .*chmod 600"):
        load_private_key(kp.private)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.pub").write_bytes(
        ec_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(TrustError, match=r"ec\.pub: is a .*ed25519 keys only"):
        load_public_key(tmp_path / "ec.pub")
    (tmp_path / "ec.pub").unlink()
    (tmp_path / "junk.pub").write_text("hello\n")
    with pytest.raises(TrustError, match="junk.pub: not a PEM or OpenSSH public key"):
        load_trusted_keys(tmp_path)
    with pytest.raises(TrustError, match="cannot read"):
        load_private_key(tmp_path / "absent.key")


def test_trusted_keys_accept_openssh_lines(tmp_path):
    k = Ed25519PrivateKey.generate()
    line = k.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    (tmp_path / "ci.pub").write_bytes(line + b" ci@build\n")
    (tmp_path / "notakey.txt").write_text("ignored: not *.pub")
    keys = load_trusted_keys(tmp_path)
    assert list(keys) == [key_id(k.public_key())] and keys[key_id(k.public_key())][0] == tmp_path / "ci.pub"
    assert load_trusted_keys(tmp_path / "missing") == {}


# ----------------------------------------------------------------------------- verify


def test_signed_snapshot_verifies(snap):
    store, m, digest, keys, kp = snap
    v = verify_manifest(store, digest, keys, verify_chunks=True)
    assert v.trusted and not v.insecure and v.warning is None
    assert v.key_id == kp.key_id and v.key_file == keys / "publisher.pub"
    assert v.manifest == m
    [doc] = signatures(store, digest)
    assert isinstance(doc, SignatureDoc) and doc.manifest == digest
    assert store.backend.exists(signature_prefix(digest) + f"{kp.key_id}.json")


def test_unsigned_and_no_keys_are_refused(snap, tmp_path):
    store, m, digest, keys, kp = snap
    with pytest.raises(TrustError, match="no trusted keys"):
        verify_manifest(store, digest, tmp_path / "empty-keys")
    other = _manifest(store, {"x.img": _file(tmp_path / "x.img", 1000, 9)})
    d2 = store.put_manifest(other)
    with pytest.raises(TrustError, match=f"{d2} is unsigned"):
        verify_manifest(store, d2, keys)


def test_byte_changed_in_manifest_is_refused(snap):
    store, m, digest, keys, _ = snap
    path = Path(store.backend.location(manifest_key(digest)))
    data = bytearray(path.read_bytes())
    data[data.index(b'"pages-1.img"') + 1] = ord("P")  # pages-1.img -> Pages-1.img
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="is corrupt: its bytes hash to"):
        verify_manifest(store, digest, keys)
    # Even the insecure override does not accept content that does not match its digest.
    with pytest.raises(IntegrityError):
        verify_manifest(store, digest, keys, insecure=True)


def test_edited_manifest_under_its_new_digest_is_unsigned(snap):
    store, m, digest, keys, _ = snap
    evil = m.model_copy(update={"restore": RestoreInfo(log_path="/tmp/evil", cwd="/tmp/evil")})
    d2 = store.put_manifest(evil)
    # The attacker copies the valid signature object next to the new digest: it signs the old one.
    [info] = list(store.backend.list(signature_prefix(digest)))
    store.backend.save(signature_prefix(d2) + info.key.rsplit("/", 1)[1], store.backend.load(info.key))
    with pytest.raises(TrustError, match=f"is for {digest}, not {d2}"):
        verify_manifest(store, d2, keys)
    # ... and rewriting the document's digest field breaks the signature itself.
    doc = SignatureDoc.model_validate_json(store.backend.load(info.key)).model_copy(update={"manifest": d2})
    store.backend.save(signature_prefix(d2) + info.key.rsplit("/", 1)[1], doc.model_dump_json().encode())
    with pytest.raises(TrustError, match="does not verify"):
        verify_manifest(store, d2, keys)


def test_resigned_with_untrusted_key_is_refused(snap, tmp_path):
    store, m, digest, keys, _ = snap
    evil = m.model_copy(update={"restore": RestoreInfo(log_path="/tmp/evil", cwd="/tmp/evil")})
    d2 = store.put_manifest(evil)
    attacker = generate_keypair(tmp_path / "attacker")
    sign_manifest(store, d2, attacker.private)
    with pytest.raises(TrustError, match=f"signed by key {attacker.key_id}, which is not trusted"):
        verify_manifest(store, d2, keys)
    # The attacker's signature over the *original* digest adds nothing either way.
    sign_manifest(store, digest, attacker.private)
    assert verify_manifest(store, digest, keys).key_id != attacker.key_id


def test_forged_signature_bytes_under_trusted_key_id(snap):
    store, m, digest, keys, kp = snap
    key = signature_prefix(digest) + f"{kp.key_id}.json"
    doc = SignatureDoc.model_validate_json(store.backend.load(key))
    sig = bytearray(base64.b64decode(doc.signature))
    sig[0] ^= 1
    store.backend.save(key, doc.model_copy(update={"signature": base64.b64encode(sig).decode()}).model_dump_json().encode())
    with pytest.raises(TrustError, match=f"trusted key {kp.key_id} .* does not verify"):
        verify_manifest(store, digest, keys)


def _chunk_path(store: Store, digest: str) -> Path:
    return Path(store.backend.location(chunk_key(digest)))


def test_byte_changed_in_chunk_is_caught_before_any_file_is_written(snap, tmp_path):
    store, m, digest, keys, _ = snap
    ref = m.files[0].chunks[0]
    p = _chunk_path(store, ref.digest)
    data = bytearray(ck.decompress(p.read_bytes(), ref.size))
    data[1234] ^= 0xFF
    p.write_bytes(ck.compress(bytes(data)))  # a well-formed object whose content changed
    # The signature is still fine (the manifest did not change) ...
    assert verify_manifest(store, digest, keys).trusted
    # ... but the audit and every read check the chunk against the digest in the signed manifest.
    with pytest.raises(IntegrityError, match=ref.digest):
        verify_manifest(store, digest, keys, verify_chunks=True)
    dest = tmp_path / "restore" / "pages-1.img"
    with pytest.raises(IntegrityError, match=ref.digest):
        store.read_file(m.files[0].chunks, dest)
    assert not dest.exists()
    assert not any(x.is_file() for x in dest.parent.iterdir()), "no partial file may be left behind"


def test_swapped_chunk_with_valid_digest_of_other_content(snap, tmp_path):
    store, m, digest, keys, _ = snap
    victim = m.files[0].chunks[0]
    other = m.files[1].chunks[0]  # a stored chunk with a perfectly valid digest, of other content
    # (a) The object of the victim's digest is replaced by the other chunk's object.
    _chunk_path(store, victim.digest).write_bytes(_chunk_path(store, other.digest).read_bytes())
    with pytest.raises(IntegrityError, match=victim.digest):
        verify_manifest(store, digest, keys, verify_chunks=True)
    dest = tmp_path / "out.img"
    with pytest.raises(IntegrityError, match="content does not match its digest|corrupt"):
        store.read_file(m.files[0].chunks, dest)
    assert not dest.exists()
    # (b) The manifest is made to reference the other chunk's (valid) digest instead: that is a
    # different manifest, which no trusted key signed.
    files = [f.model_copy(deep=True) for f in m.files]
    files[0].chunks = [other] + files[0].chunks[1:]
    files[0].size = sum(c.size for c in files[0].chunks)
    d2 = store.put_manifest(m.model_copy(update={"files": files}))
    assert d2 != digest
    with pytest.raises(TrustError, match="unsigned"):
        verify_manifest(store, d2, keys)


def test_insecure_override_warns_loudly_and_still_checks_integrity(snap, tmp_path, caplog):
    store, m, digest, keys, _ = snap
    d2 = store.put_manifest(_manifest(store, {"y.img": _file(tmp_path / "y.img", 5000, 7)}))
    with caplog.at_level(logging.WARNING, logger="warmctl.naming.trust"):
        v = verify_manifest(store, d2, keys, insecure=True)
    assert not v.trusted and v.insecure and v.key_id is None
    assert v.warning and v.warning.startswith("INSECURE") and "unsigned" in v.warning
    assert any("INSECURE" in r.getMessage() for r in caplog.records)
    assert v.manifest.digest() == d2
    missing = "sha256:" + "ab" * 32
    with pytest.raises(IntegrityError, match="missing"):
        verify_manifest(store, missing, keys, insecure=True)


def test_trust_error_is_a_warmctl_error_with_its_own_exit_code():
    assert issubclass(TrustError, WarmctlError) and TrustError.exit_code not in (0, 1)
