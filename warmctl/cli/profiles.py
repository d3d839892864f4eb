"""CLI commands: ``warmctl profile ls | show | check | command | diff`` (look at a profile
without running it).

Lines are printed whole (never wrapped), so paths, digests and command lines survive pipes and
the journal; ``--json`` prints one JSON document instead (docs/cli-json.md).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from warmctl.cli.output import JsonOpt, emit_json
from warmctl.errors import SnapshotNotFound

if TYPE_CHECKING:  # config and profile (pydantic models) are imported by the command that runs (issue 12)
    from warmctl.profile import Profile


def _echo(line: str = "") -> None:
    typer.echo(line)


def _json(doc: object) -> None:
    emit_json(doc)


def _load(name: str) -> tuple[Path, Profile]:
    from warmctl.config import load_settings
    from warmctl.profile import find_profile, load_profile_file

    settings = load_settings()
    path = find_profile(name, settings.profile_dirs)
    return path, load_profile_file(path)


def engine_launch(profile: Profile, models_dir: Path, passthrough: list[str] | None = None) -> dict:
    """What ``snapshot`` (and the cold path of ``up``) would launch for ``profile``, without
    launching or building anything: ``{"model": path, "env": {var: value} warmctl and the
    profile set, "from_environment": {var: "base" | "passthrough"} taken from this
    environment by name (:func:`warmctl.engine.vllm.engine_environment`; values not shown: a
    passed-through one may be a credential), "engine_argv": the vllm serve argv, "argv": the
    same wrapped for checkpointing (launcher, PID namespace, session)}``. Nothing else of
    this environment reaches the engine. ``passthrough``: the config's
    ``engine_env_passthrough``. ``env`` includes :func:`warmctl.engine.cold.launch_env` (the
    ranks' default CPU binding, the CPU build's PYTHONPATH); raises
    :class:`warmctl.errors.HostError` when the ranks' binding cannot be satisfied here. A
    ``builtin:`` model is shown at the path it is built to on first use."""
    from warmctl import tinymodel
    from warmctl.engine.vllm import engine_env, engine_environment, vllm_command, wrapped_command
    from warmctl.engine.cold import launch_env

    m = profile.engine.model
    model = str(d) if (d := tinymodel.builtin_dir(m, models_dir)) is not None else m
    inner = vllm_command(profile, model)
    ours = {**engine_env(profile), **launch_env(profile)}
    inherited = {k: v for k, v in engine_environment(profile, passthrough or []).sources.items() if k not in ours}
    return {"model": model, "env": ours, "from_environment": inherited, "engine_argv": inner,
            "argv": wrapped_command(inner)}


def register(app: typer.Typer) -> None:
    """Add ``warmctl profile ...`` to ``app``."""
    papp = typer.Typer(help="Look at profiles without running them: ls, show, check, command, diff.",
                       no_args_is_help=True)
    app.add_typer(papp, name="profile")

    @papp.command("ls")
    def ls(json_out: bool = JsonOpt) -> None:
        """Every profile NAME `snapshot NAME` can find, with its file, in search order: the
        configured profile_dirs ($WARMCTL_PROFILE_DIRS), /etc/warmctl/profiles, then the
        profiles shipped in the package. A file hidden by an earlier one of the same name is
        named too. Files are not validated here (`warmctl profile check`)."""
        from warmctl.config import load_settings
        from warmctl.profile import list_profiles, search_dirs

        settings = load_settings()
        rows = list_profiles(settings.profile_dirs)
        if json_out:
            _json({"search": [str(d) for d in search_dirs(settings.profile_dirs)],
                   "profiles": [{"name": n, "file": str(p), "hides": [str(h) for h in hidden]} for n, p, hidden in rows]})
            return
        if not rows:
            _echo("no profiles; looked in: " + ", ".join(str(d) for d in search_dirs(settings.profile_dirs)))
            raise typer.Exit(1)
        width = max(len(n) for n, _, _ in rows)
        for n, p, hidden in rows:
            _echo(f"{n:<{width}}  {p}" + (f"  (hides {', '.join(map(str, hidden))})" if hidden else ""))

    @papp.command("show")
    def show(name: str = typer.Argument(..., help="Profile NAME or path to a .toml file."),
             json_out: bool = JsonOpt) -> None:
        """The profile as warmctl reads it: its file, its digest, and every field with the
        defaults the file leaves out filled in (one `field = value` line each, values as JSON)."""
        from warmctl.profile import _flatten

        path, prof = _load(name)
        data = prof.model_dump(mode="json")
        if json_out:
            _json({"file": str(path), "digest": prof.digest(), "profile": data})
            return
        _echo(f"# {path}")
        _echo(f"# digest {prof.digest()}")
        for k, v in _flatten(data).items():
            _echo(f"{k} = {json.dumps(v)}")

    @papp.command("check")
    def check(files: list[str] = typer.Argument(..., help="Profile files (or NAMEs) to validate."),
              json_out: bool = JsonOpt) -> None:
        """Validate profiles without starting anything: TOML syntax, every field's type and
        range, unknown keys (with the closest real one: `warmup.concurency`: did you mean
        'concurrency'?), and for an engine of several ranks (--tensor-parallel-size x
        --pipeline-parallel-size x --data-parallel-size) on the CPU build the CPU binding of each
        rank on this host (VLLM_CPU_OMP_THREADS_BIND: the profile's, or warmctl's default); on
        the CPU build --enable-expert-parallel is refused (its ranks crash at the first request).
        Prints `FILE: ok` (and the ranks' layout) or one line per problem; exits 1 if any fails."""
        from warmctl.checkpoint.layout import cpu_binding, profile_sizes
        from warmctl.config import load_settings
        from warmctl.errors import HostError
        from warmctl.profile import ProfileError, find_profile, load_profile_file

        settings = load_settings()
        results = []
        for f in files:
            try:
                path = find_profile(f, settings.profile_dirs)
                prof = load_profile_file(path)
            except ProfileError as e:
                results.append({"file": f, "ok": False, "errors": str(e).splitlines()})
                continue
            sizes = profile_sizes(prof)
            ranks = {"layout": sizes.describe(), "world_size": sizes.world_size, "roles": sizes.roles()}
            try:
                b = cpu_binding(prof)
                ranks["cpu_bind"], ranks["cpu_bind_source"] = b.value, b.source
                results.append({"file": str(path), "ok": True, "name": prof.name, "digest": prof.digest(),
                                "ranks": ranks, "errors": []})
            except HostError as e:  # the ranks' CPU binding cannot be satisfied on this host
                results.append({"file": str(path), "ok": False, "name": prof.name, "ranks": ranks,
                                "errors": [f"{path}: {e}"]})
        if json_out:
            _json(results)
        else:
            for r in results:
                if r["ok"]:
                    _echo(f"{r['file']}: ok ({r['name']}, {r['digest']})")
                    rk = r["ranks"]
                    if rk["world_size"] > 1:
                        how = {"default": "warmctl's default from this host's CPUs", "profile": "from engine.env",
                               "none": "vLLM's auto (a NUMA node per rank)"}[rk["cpu_bind_source"]]
                        _echo(f"  {rk['layout']}: {rk['world_size']} ranks ({', '.join(rk['roles'])}); CPU binding "
                              f"VLLM_CPU_OMP_THREADS_BIND={rk['cpu_bind'] or 'auto'} ({how})")
                else:
                    for line in r["errors"]:
                        typer.echo(line, err=True)
        if not all(r["ok"] for r in results):
            raise typer.Exit(1)

    @papp.command("command")
    def command(name: str = typer.Argument(..., help="Profile NAME or path to a .toml file."),
                json_out: bool = JsonOpt,
                engine_only: bool = typer.Option(False, "--engine-only",
                                                  help="Only the `vllm serve` command, without the checkpointing wrappers.")) -> None:
        """The exact engine command line and environment `warmctl snapshot NAME` would launch,
        without launching it: the variables warmctl and the profile set (`NAME=value`), a
        comment naming those taken from this environment (the base list and the config's
        engine_env_passthrough; by name only), then the command, shell-quoted on one line.
        Nothing else of warmctl's environment reaches the engine. The engine binds engine.port
        on 127.0.0.1; the public host, port, API key and TLS are the gate's."""
        from warmctl.config import load_settings

        _, prof = _load(name)
        settings = load_settings()
        launch = engine_launch(prof, settings.models_dir, settings.engine_env_passthrough)
        if json_out:
            _json(launch)
            return
        for k, v in launch["env"].items():
            _echo(f"{k}={shlex.quote(v)}")
        for src, what in (("base", "base list"), ("passthrough", "engine_env_passthrough")):
            names = [k for k, s in launch["from_environment"].items() if s == src]
            if names:
                _echo(f"# from this environment ({what}): {' '.join(names)}")
        _echo(shlex.join(launch["engine_argv"] if engine_only else launch["argv"]))

    @papp.command("diff")
    def diff(name: str = typer.Argument(..., help="Profile NAME."),
             tag: Optional[str] = typer.Option(None, help="Compare with NAME:TAG (default: the newest snapshot of NAME, any tag)."),
             json_out: bool = JsonOpt) -> None:
        """Which fields differ between the profile on disk and the one embedded in the newest
        snapshot of that name (the local store's catalog, else the configured catalog): one
        `field: snapshot -> disk` line each. Exits 0 when they are the same, 1 when they differ
        (as diff(1)); no snapshot of NAME: exit 4 (not found)."""
        from warmctl.catalog import Catalog
        from warmctl.config import load_settings
        from warmctl.profile import diff_profiles
        from warmctl.store import open_store

        settings = load_settings()
        path, prof = _load(name)
        urls = [str(settings.store_dir)] + ([settings.catalog_url] if settings.catalog_url != str(settings.store_dir) else [])
        found = None
        for url in urls:
            store = open_store(url, settings=settings)
            cat = Catalog(store)
            entries = [e for t in ([tag] if tag else cat.tags(prof.name)) for e in cat.entries(prof.name, t)]
            if entries:
                e = max(entries, key=lambda x: x.created)
                found = (url, e, store.get_manifest(e.manifest))
                break
        if found is None:
            raise SnapshotNotFound(f"no snapshot of {prof.name}{':' + tag if tag else ''} in "
                               + ", ".join(urls) + f"; nothing to compare {path} with")
        url, e, m = found
        same = m.profile_digest == prof.digest()
        changes = [] if same else diff_profiles(m.profile, prof)
        if json_out:
            _json({"profile_file": str(path), "profile_digest": prof.digest(), "snapshot": f"{e.name}:{e.tag}",
                   "snapshot_digest": e.manifest, "snapshot_profile_digest": m.profile_digest, "store": url,
                   "same": same, "changes": [{"field": k, "snapshot": a, "profile": b} for k, a, b in changes]})
        else:
            _echo(f"--- {e.name}:{e.tag} {e.manifest} (made {e.created:%Y-%m-%d %H:%M}, profile {m.profile_digest})")
            _echo(f"+++ {path} (profile {prof.digest()})")
            if same:
                _echo("same profile")
            elif not changes:
                _echo("no field differs once defaults are filled in (the snapshot was made by a warmctl whose profiles had other fields)")
            for k, a, b in changes:
                _echo(f"{k}: {json.dumps(a)} -> {json.dumps(b)}")
        if not same:
            raise typer.Exit(1)
