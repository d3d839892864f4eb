"""CLI commands: ``warmctl keys ls | trust FILE | rm ID``: which public keys this host trusts
(``keys_dir``), which snapshots each signs, and explicit changes to that trust.

Lines are printed whole (never wrapped); ``--json`` prints one JSON document instead
(docs/cli-json.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from warmctl.cli.output import JsonOpt, emit_json


def _settings():
    from warmctl.records.config import load_settings

    return load_settings()


def key_files(keys_dir: Path) -> list[tuple[str, Path]]:
    """``(key id, file)`` of every ``*.pub`` in ``keys_dir``, by file name (one key may be in
    several files). An unusable file raises :class:`warmctl.naming.trust.TrustError` naming it."""
    from warmctl.naming.trust import key_id, load_public_key

    if not keys_dir.is_dir():
        return []
    return [(key_id(load_public_key(p)), p) for p in sorted(keys_dir.glob("*.pub"))]


def signed_snapshots(settings: Any) -> dict[str, list[str]]:
    """Key id -> the ``NAME:TAG (digest)`` catalog entries it has a signature on, in the local
    store's catalog and the configured catalog (when another store). What a signature object
    claims, not verified here (``up`` verifies)."""
    from warmctl.naming.catalog import Catalog
    from warmctl.store import open_store
    from warmctl.naming.trust import SignatureDoc, signatures

    urls = [str(settings.store_dir)]
    if settings.catalog_url not in urls:
        urls.append(settings.catalog_url)
    out: dict[str, list[str]] = {}
    for url in urls:
        store = open_store(url, settings=settings)
        for e in Catalog(store).all_entries():
            label = f"{e.name}:{e.tag} ({e.manifest[:19]})" + ("" if url == urls[0] else f" in {url}")
            for doc in signatures(store, e.manifest):
                if isinstance(doc, SignatureDoc) and label not in out.setdefault(doc.key_id, []):
                    out[doc.key_id].append(label)
    return out


def _home_key(settings: Any) -> str | None:
    """The id of the key this home signs with (``signing_key``, else ``<home>/keys/local.key``),
    or None when there is none (yet) or it is unusable."""
    from warmctl.naming.trust import TrustError, key_id, load_private_key

    path = settings.signing_key or settings.home / "keys" / "local.key"
    if not Path(path).exists():
        return None
    try:
        return key_id(load_private_key(path).public_key())
    except TrustError:
        return None


def register(app: typer.Typer) -> None:
    """Add ``warmctl keys ...`` to ``app``."""
    kapp = typer.Typer(help="Trusted public keys (keys_dir): ls, trust, rm.", no_args_is_help=True)
    app.add_typer(kapp, name="keys")

    @kapp.command("ls")
    def ls(json_out: bool = JsonOpt) -> None:
        """The public keys this host trusts (every *.pub in keys_dir): key id, file, which
        snapshots in the local store's catalog (and the configured catalog) carry a signature by
        it, and which key this home signs with. Keys that sign snapshots here but are not
        trusted are listed too, as `not trusted`."""
        s = _settings()
        files = key_files(s.keys_dir)
        signs = signed_snapshots(s)
        mine = _home_key(s)
        rows: list[dict[str, Any]] = [{"key_id": kid, "file": str(p), "trusted": True, "signs": signs.get(kid, []), "this_home": kid == mine}
                for kid, p in files]
        trusted = {kid for kid, _ in files}
        rows += [{"key_id": kid, "file": None, "trusted": False, "signs": snaps, "this_home": kid == mine}
                 for kid, snaps in sorted(signs.items()) if kid not in trusted]
        if mine and mine not in trusted | set(signs):
            rows.append({"key_id": mine, "file": None, "trusted": False, "signs": [], "this_home": True})
        if json_out:
            emit_json({"keys_dir": str(s.keys_dir), "keys": rows})
            return
        if not rows:
            typer.echo(f"no trusted keys in {s.keys_dir}")
            return
        for r in rows:
            head = f"{r['key_id']}  {r['file'] or 'not trusted (no file in ' + str(s.keys_dir) + ')'}"
            if r["this_home"]:
                head += "  (this home signs with it)"
            typer.echo(head)
            typer.echo("  signs: " + (", ".join(r["signs"]) if r["signs"] else "no snapshot here"))

    @kapp.command("trust")
    def trust_(public: Path = typer.Argument(..., help="A public key file (PEM or one ssh-ed25519 line)."),
               name: Optional[str] = typer.Option(None, "--name", help="File name stem in keys_dir (default: the file's stem).")) -> None:
        """Trust a public key: copy it into keys_dir as STEM-<key id>.pub. Never replaces a
        file: a key already trusted is reported, not written again."""
        from warmctl.naming.trust import install_public_key

        s = _settings()
        dest, installed = install_public_key(public, s.keys_dir, name or public.stem)
        typer.echo(f"{'trusted' if installed else 'already trusted'}: {dest}")

    @kapp.command("rm")
    def rm(key: str = typer.Argument(..., metavar="ID", help="The key id (or its first 8+ hex digits).")) -> None:
        """Stop trusting a key: remove every file in keys_dir holding it. Snapshots signed only by
        it then fail `up` here with 'not trusted' (named below). Restoring trust is `warmctl keys
        trust FILE`."""
        from warmctl.naming.trust import remove_trusted_key

        s = _settings()
        signs = signed_snapshots(s)
        kid, removed = remove_trusted_key(s.keys_dir, key)
        for p in removed:
            typer.echo(f"removed {p}")
        left = {k for k, _ in key_files(s.keys_dir)}
        lost = [snap for snap in signs.get(kid, []) if not any(snap in signs.get(k, []) for k in left)]
        typer.echo(f"key {kid} is no longer trusted here"
                   + (f"; no trusted signature left on: {', '.join(lost)}" if lost else ""))
