"""A new key never silently revokes an old one: two homes on one host share one trusted
keys directory (as /etc/warmctl/keys), each generates its signing key on first use, and both
homes' snapshots stay trusted; ``warmctl keys ls`` names keys, files and what each signs;
``keys rm`` and ``keys trust`` change trust explicitly. Real stores, real ed25519 keys, the real
entry point."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from warmctl.naming.catalog import Catalog
from warmctl.records.config import Settings
from warmctl.records.manifest import CanaryRecord, FileEntry, Manifest
from warmctl.records.progress import Reporter
from warmctl.pipelines.snapshot import signing_key
from warmctl.store import open_store
from warmctl.naming.trust import (
    TrustError,
    check_signatures,
    generate_keypair,
    install_public_key,
    key_id,
    load_private_key,
    remove_trusted_key,
)


class _Lines(Reporter):
    def __init__(self):
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)


def _snapshot(settings: Settings, seed: int) -> str:
    """A snapshot of ``tiny`` published into the home's local store and signed with the home's
    key, as ``warmctl snapshot`` does after its dump; returns the manifest digest."""
    store = open_store(settings.store_dir)
    p = settings.home / f"pages-{seed}.img"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(random.Random(seed).randbytes(30_000))
    m = Manifest(name="tiny", profile_digest="sha256:" + f"{seed:064x}", profile={"name": "tiny"}, host={},
                 canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]),
                 files=[FileEntry(path="pages-1.img", size=p.stat().st_size, chunks=store.add_file(p))])
    d = store.put_manifest(m)
    Catalog(store).publish(d, m, signer=signing_key(settings, _Lines()))
    store.close()
    return d


def _wc(*args: str, home: Path, keys: Path, root: Path) -> subprocess.CompletedProcess:
    (root / "none.toml").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")}
    env.update(WARMCTL_CONFIG=str(root / "none.toml"), WARMCTL_HOME=str(home), WARMCTL_KEYS_DIR=str(keys),
               PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    return subprocess.run([sys.executable, "-m", "warmctl", *args], capture_output=True, text=True, env=env, timeout=120)


def test_a_second_home_on_one_host_keeps_the_first_homes_snapshots_trusted(tmp_path):
    keys = tmp_path / "etc-warmctl-keys"
    a = Settings(home=tmp_path / "var-lib-warmctl", keys_dir=keys)
    b = Settings(home=tmp_path / "srv-staging", keys_dir=keys)
    da = _snapshot(a, 1)
    ka = key_id(load_private_key(a.home / "keys" / "local.key").public_key())
    assert check_signatures(open_store(a.store_dir), da, keys)[0] == ka
    rep = _Lines()
    db = _snapshot(b, 2)  # WARMCTL_HOME=/srv/staging warmctl snapshot tiny
    kb = key_id(load_private_key(b.home / "keys" / "local.key").public_key())
    host = socket.gethostname()
    assert kb != ka
    assert sorted(p.name for p in keys.glob("*.pub")) == sorted([f"local-{host}-{ka}.pub", f"local-{host}-{kb}.pub"])
    # Both homes' snapshots restore on this host (before: A's failed "signed by key ..., which is not trusted").
    assert check_signatures(open_store(a.store_dir), da, keys)[0] == ka
    assert check_signatures(open_store(b.store_dir), db, keys)[0] == kb
    # A third call generates nothing and says nothing: the key is there and trusted.
    signing_key(a, rep)
    assert rep.lines == [] and len(list(keys.glob("*.pub"))) == 2

    # keys ls: trusted keys, their ids and files, which snapshots each signs, this home's key.
    ls = _wc("keys", "ls", "--json", home=a.home, keys=keys, root=tmp_path)
    assert ls.returncode == 0, ls.stderr
    rows = {r["key_id"]: r for r in json.loads(ls.stdout)["keys"]}
    assert rows[ka]["file"] == str(keys / f"local-{host}-{ka}.pub") and rows[ka]["this_home"]
    assert rows[ka]["signs"] == [f"tiny:latest ({da[:19]})"]
    assert rows[kb]["trusted"] and rows[kb]["signs"] == [] and not rows[kb]["this_home"]  # B's store is not A's
    human = _wc("keys", "ls", home=a.home, keys=keys, root=tmp_path).stdout.splitlines()
    assert f"{ka}  {keys / f'local-{host}-{ka}.pub'}  (this home signs with it)" in human
    assert f"  signs: tiny:latest ({da[:19]})" in human

    # Removing trust is explicit, and names what it costs.
    rm = _wc("keys", "rm", kb[:10], home=b.home, keys=keys, root=tmp_path)
    assert rm.returncode == 0, rm.stderr
    assert f"removed {keys / f'local-{host}-{kb}.pub'}" in rm.stdout
    assert f"no trusted signature left on: tiny:latest ({db[:19]})" in rm.stdout
    with pytest.raises(TrustError, match=f"signed by key {kb}, which is not trusted"):
        check_signatures(open_store(b.store_dir), db, keys)
    assert check_signatures(open_store(a.store_dir), da, keys)[0] == ka  # A untouched
    rep = _Lines()
    signing_key(b, rep)  # B's next snapshot says its key is not trusted here (and how to fix it)
    assert len(rep.lines) == 1 and f"(key id {kb}) is not trusted" in rep.lines[0] and "keys trust" in rep.lines[0]
    again = _wc("keys", "rm", kb, home=b.home, keys=keys, root=tmp_path)
    assert again.returncode == TrustError.exit_code and f"no trusted key {kb}" in again.stderr

    # ... and so is restoring it.
    tr = _wc("keys", "trust", str(b.home / "keys" / "local.pub"), "--name", f"local-{host}", home=b.home, keys=keys, root=tmp_path)
    assert tr.returncode == 0 and tr.stdout.strip() == f"trusted: {keys / f'local-{host}-{kb}.pub'}"
    assert check_signatures(open_store(b.store_dir), db, keys)[0] == kb
    tr = _wc("keys", "trust", str(b.home / "keys" / "local.pub"), home=b.home, keys=keys, root=tmp_path)
    assert tr.stdout.strip() == f"already trusted: {keys / f'local-{host}-{kb}.pub'}"


def test_installing_never_replaces_another_key_and_rm_needs_an_unambiguous_id(tmp_path):
    keys = tmp_path / "keys"
    c = generate_keypair(tmp_path / "c", "c")
    d = generate_keypair(tmp_path / "d", "d")
    # A file of C's name that holds D (someone copied the wrong file): installing C refuses.
    keys.mkdir()
    squatter = keys / f"ops-{c.key_id}.pub"
    squatter.write_bytes(d.public.read_bytes())
    with pytest.raises(TrustError, match="exists and holds another key"):
        install_public_key(c.public, keys, "ops")
    assert squatter.read_bytes() == d.public.read_bytes()
    # D is trusted already (by that file): nothing is written.
    assert install_public_key(d.public, keys, "ops") == (squatter, False)
    squatter.unlink()
    dest, new = install_public_key(c.public, keys, "ops")
    assert new and dest == keys / f"ops-{c.key_id}.pub" and oct(dest.stat().st_mode & 0o777) == "0o644"
    with pytest.raises(TrustError, match="plain file name"):
        install_public_key(c.public, keys, "../x")
    with pytest.raises(TrustError, match="at least 8 hex digits"):
        remove_trusted_key(keys, c.key_id[:4])
    install_public_key(d.public, keys, "ops")
    kid, removed = remove_trusted_key(keys, c.key_id.upper()[:12])
    assert kid == c.key_id and removed == [dest] and not dest.exists()
    assert [p.name for p in keys.glob("*.pub")] == [f"ops-{d.key_id}.pub"]
