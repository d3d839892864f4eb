"""CLI commands: ``host``, ``catalog ls``, ``catalog show``, ``keygen``, ``config show``.

Registered on the root app by :func:`register`. Each takes ``--config FILE`` (else
``$WARMCTL_CONFIG`` or ``/etc/warmctl/config.toml``); the catalog commands take ``--catalog URL``
to read another store (``s3://bucket/prefix``, ``oci://HOST/REPO`` or a directory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from warmctl.cli.output import JsonOpt, emit_json, table
from warmctl.cli.output import out as _out
from warmctl.cli.output import human

ConfigOpt = typer.Option(None, "--config", help="Config file (default: $WARMCTL_CONFIG or /etc/warmctl/config.toml).")
CatalogOpt = typer.Option(None, "--catalog", help="Store URL holding the catalog (default: the `catalog` setting).")


def _settings(config: Optional[Path], **overrides: Any):
    from warmctl.records.config import load_settings

    return load_settings(config, overrides)


def _open_catalog(settings: Any):
    from warmctl.naming.catalog import Catalog
    from warmctl.store import open_store

    return Catalog(open_store(settings.catalog_url, settings=settings))


def _say(line: str) -> None:
    """Print ``line`` on stdout as it is (no markup, highlighting or wrapping). The console is
    made per call, not when the commands are registered (no rich for `--help`)."""
    _out(highlight=False, soft_wrap=True, markup=False).print(line)


def _layout(c: Any, digest: str, as_json: bool = False) -> Any:
    """The parallel layout the manifest ``digest`` records (``restore.layout``): one line, or
    its JSON with ``as_json``; None when it records none or cannot be read."""
    from warmctl.base.errors import WarmctlError

    try:
        lay = c.store.get_manifest(digest).restore.layout
    except (WarmctlError, OSError, ValueError):
        return None
    if lay is None:
        return None
    return lay.model_dump(mode="json") if as_json else lay.describe()


def register(app: typer.Typer) -> None:
    """Add this area's commands to ``app``."""

    @app.command()
    def host(
        as_json: bool = typer.Option(False, "--json", help="Print the fingerprint as JSON (what snapshots record; docs/cli-json.md)."),
        config: Optional[Path] = ConfigOpt,
    ) -> None:
        """Show what restore compatibility depends on: GPUs, driver, CPU, kernel, CRIU, engine."""
        from warmctl.host import fingerprint

        s = _settings(config)
        fp = fingerprint(criu=s.criu, image_digest=s.image_digest)
        if as_json:
            emit_json(fp.model_dump(mode="json"))
            return
        _say(f"host         {fp.hostname} ({fp.arch}, kernel {fp.kernel})")
        if fp.gpus and fp.gpu_vendor == "amd":
            _say(f"gpus         {len(fp.gpus)} x AMD, amdgpu driver {fp.driver_version} (from {fp.gpu_source})")
            for g in fp.gpus:
                _say(
                    f"  [{g.index}] {g.name}  {human(g.memory_bytes)}  {g.uuid}  {g.model_key()}  "
                    f"kfd node {g.kfd_node} gpu_id {g.kfd_gpu_id}  fw {g.fw_version} sdma fw {g.sdma_fw_version}  "
                    f"renderD{g.drm_render_minor}"
                )
            plugins = ", ".join(fp.criu_plugins or []) or "none"
            _say(f"criu plugins {fp.criu_plugin_dir}: {plugins}")
        elif fp.gpus:
            _say(f"gpus         {fp.gpu_summary()}, driver {fp.driver_version}, CUDA {fp.cuda_driver_version}")
            for g in fp.gpus:
                _say(
                    f"  [{g.index}] {g.name}  {human(g.memory_bytes)}  {g.uuid}  "
                    f"cc {g.compute_capability or '?'}  persistence {'on' if g.persistence_mode else 'off'}"
                )
        else:
            _say(f"gpus         none ({fp.gpu_reason})")
        _say(f"cpu          {fp.cpu.model or '?'} x{fp.cpu.count} ({fp.cpu.vendor or '?'}), {len(fp.cpu.flags)} flags")
        _say(f"criu         {fp.criu_version or 'not found (' + s.criu + ')'}")
        _say(f"engine       {fp.engine} {fp.engine_version or 'not installed'} (python {fp.python_version})")
        _say(f"environment  {fp.env_digest}")

    cat = typer.Typer(help="Published snapshots: names x tags x hosts.", no_args_is_help=True)
    app.add_typer(cat, name="catalog")

    @cat.command("ls")
    def catalog_ls(
        catalog: Optional[str] = CatalogOpt,
        as_json: bool = JsonOpt,
        config: Optional[Path] = ConfigOpt,
    ) -> None:
        """List names, their tags and for which hosts snapshots exist."""
        s = _settings(config, catalog=catalog)
        c = _open_catalog(s)
        rows = []
        for name in c.names():
            for tag in c.tags(name):
                for e in c.entries(name, tag):
                    rows.append((name, tag, e))
        if as_json:
            emit_json([e.model_dump(mode="json") for _, _, e in rows])
            return
        if not rows:
            _say(f"no snapshots published in the catalog at {c.location()}")
            return
        from warmctl.host import HostFingerprint

        lines = []
        for name, tag, e in rows:
            try:
                hs = HostFingerprint.model_validate(e.host).summary()
            except ValueError:
                hs = "(unreadable fingerprint)"
            lines.append((name, tag, e.manifest[:19], e.created.strftime("%Y-%m-%d %H:%M"), human(e.size), hs))
        table(("name", "tag", "manifest", "created", "size", "host"), lines, console_=_out(highlight=False, soft_wrap=True, markup=False))

    @cat.command("show")
    def catalog_show(
        name: str,
        tag: str = typer.Option("latest", "--tag"),
        catalog: Optional[str] = CatalogOpt,
        as_json: bool = typer.Option(False, "--json"),
        config: Optional[Path] = ConfigOpt,
    ) -> None:
        """Show NAME:TAG's snapshots, their signatures, and whether each fits this host (and why not)."""
        from warmctl.naming.catalog import select
        from warmctl.host import fingerprint
        from warmctl.naming.trust import signature_summary

        s = _settings(config, catalog=catalog)
        c = _open_catalog(s)
        entries = c.entries(name, tag)
        prof = c.profile(name)
        fp = fingerprint(criu=s.criu, image_digest=s.image_digest)
        chosen, rejections = select(entries, fp, driver=s.match_driver)
        why = {r.digest: r for r in rejections}
        if as_json:
            typer.echo(
                json.dumps(
                    {
                        "name": name,
                        "tag": tag,
                        "profile_digest": prof["profile_digest"] if prof else None,
                        "chosen": chosen.manifest if chosen else None,
                        "entries": [
                            {
                                **e.model_dump(mode="json"),
                                "fits": e.manifest not in why,
                                "rejection": why[e.manifest].reason if e.manifest in why else None,
                                "signature": signature_summary(c.store, e.manifest, s.keys_dir),
                                "layout": _layout(c, e.manifest, as_json=True),
                            }
                            for e in entries
                        ],
                    },
                    indent=2,
                )
            )
            return
        if not entries and not prof:
            _say(f"{name}:{tag}: nothing published in the catalog at {c.location()}")
            raise typer.Exit(4)
        _say(f"{name}:{tag}  profile {prof['profile_digest'] if prof else '(none)'}  [{c.location()}]")
        _say(f"this host: {fp.summary()}")
        from warmctl.host import HostFingerprint

        for e in entries:
            mark = "*" if chosen is not None and e.manifest == chosen.manifest else " "
            try:
                hs = HostFingerprint.model_validate(e.host).summary()
            except ValueError:
                hs = "(unreadable fingerprint)"
            _say(f"{mark} {e.manifest}  created {e.created:%Y-%m-%d %H:%M}  {human(e.size)}")
            _say(f"    host: {hs}")
            if lay := _layout(c, e.manifest):
                _say(f"    ranks: {lay}")
            _say(f"    signature: {signature_summary(c.store, e.manifest, s.keys_dir)}")
            _say("    fits this host" + (" (chosen)" if mark == "*" else "") if e.manifest not in why
                      else f"    rejected ({why[e.manifest].rule}): {why[e.manifest].reason}")
        if not entries:
            _say("  no snapshots under this tag")

    @app.command()
    def keygen(
        directory: Path = typer.Argument(Path("."), help="Where to write NAME.key (0600) and NAME.pub."),
        name: str = typer.Option("warmctl", "--name", help="File name stem."),
        force: bool = typer.Option(False, "--force", help="Replace existing files."),
    ) -> None:
        """Create an ed25519 signing keypair for publishing snapshots."""
        from warmctl.naming.trust import generate_keypair

        kp = generate_keypair(directory, name, overwrite=force)
        _say(f"private key  {kp.private}  (mode 0600; set signing_key to it on the publishing host)")
        _say(f"public key   {kp.public}  (copy into keys_dir on every host that restores)")
        _say(f"key id       {kp.key_id}")

    cfg = typer.Typer(help="The effective configuration.", no_args_is_help=True)
    app.add_typer(cfg, name="config")

    @cfg.command("show")
    def config_show(
        as_json: bool = typer.Option(False, "--json"),
        config: Optional[Path] = ConfigOpt,
    ) -> None:
        """Print every effective setting and where it came from (default, file, env, flag)."""
        s = _settings(config)
        rows = s.effective()
        if as_json:
            typer.echo(json.dumps({f: {"value": v, "source": src} for f, v, src in rows}, indent=2))
            return
        table(("setting", "value", "source"),
              [(f, "-" if v is None else (", ".join(v) if isinstance(v, list) else str(v)), src) for f, v, src in rows],
              console_=_out(highlight=False, soft_wrap=True, markup=False))
