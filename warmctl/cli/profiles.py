"""CLI commands: ``warmctl profile ls | show | check | command | diff`` (look at a profile
without running it) and ``warmctl profile scan`` (credentials in the profiles stores hold).

Lines are printed whole (never wrapped), so paths, digests and command lines survive pipes and
the journal; ``--json`` prints one JSON document instead (docs/cli-json.md).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from warmctl.cli.output import JsonOpt, emit_json
from warmctl.base.errors import SnapshotNotFound

if TYPE_CHECKING:  # config and profile (pydantic models) are imported by the command that runs
    from warmctl.records.profile import Profile


def _echo(line: str = "") -> None:
    typer.echo(line)


def _json(doc: object) -> None:
    emit_json(doc)


def _load(name: str) -> tuple[Path, Profile]:
    from warmctl.records.config import load_settings
    from warmctl.records.profile import find_profile, load_profile_file

    settings = load_settings()
    path = find_profile(name, settings.profile_dirs)
    return path, load_profile_file(path)


def engine_launch(profile: Profile, models_dir: Path, passthrough: list[str] | None = None,
                  log_path: Path | None = None) -> dict:
    """What ``snapshot`` (and the cold path of ``up``) would launch for ``profile``, without
    launching or building anything: ``{"model": path, "env": {var: value} warmctl and the
    profile set, "from_environment": {var: "base" | "passthrough"} taken from this
    environment by name (:func:`warmctl.engine.vllm.engine_environment`; values not shown: a
    passed-through one may be a credential), "engine_argv": the vllm serve argv, "argv": the
    same wrapped for checkpointing (PID namespace, for CUDA a mount namespace, session, launcher; its output to
    ``log_path``, default the engine log of a run under ``run_dir``)}``. Nothing else of
    this environment reaches the engine. ``passthrough``: the config's
    ``engine_env_passthrough``. ``env`` includes :func:`warmctl.engine.cold.launch_env` (the
    ranks' default CPU binding, the CPU build's PYTHONPATH); raises
    :class:`warmctl.base.errors.HostError` when the ranks' binding cannot be satisfied here. A
    ``builtin:`` model is shown at the path it is built to on first use."""
    from warmctl.models import builtinmodels
    from warmctl.engine.vllm import engine_env, engine_environment, vllm_command, wrapped_command
    from warmctl.engine.cold import launch_env

    m = profile.engine.model
    model = str(d) if (d := builtinmodels.builtin_dir(m, models_dir)) is not None else m
    inner = vllm_command(profile, model)
    ours = {**engine_env(profile), **launch_env(profile)}
    inherited = {k: v for k, v in engine_environment(profile, passthrough or []).sources.items() if k not in ours}
    return {"model": model, "env": ours, "from_environment": inherited, "engine_argv": inner,
            "argv": wrapped_command(inner, log_path or Path("RUN_DIR") / profile.name / "engine.log",
                                    mount_proc=profile.checkpoint.cuda)}


def stored_profile_problems(url: str) -> list[dict]:
    """Credentials (:func:`warmctl.records.credentials.profile_problems`: by name and by shape) in the
    profiles the store at ``url`` holds: each catalog profile record
    (``catalog/NAME/profile.json``) and the profile each manifest records. One dict per
    problem: ``{"store", "object" (the object's location), "kind" ("profile record" |
    "manifest"), "name", "refs" (the NAME:TAG entries naming that manifest), "field",
    "problem"}``; never a value. An object that cannot be read is reported with ``field``
    null and ``problem`` saying why."""
    from warmctl.naming.catalog import CATALOG_PREFIX, Catalog
    from warmctl.records.credentials import profile_problems
    from warmctl.base.errors import WarmctlError
    from warmctl.store import open_store
    from warmctl.store.layout import manifest_key

    store = open_store(url)
    cat = Catalog(store)
    out: list[dict] = []

    def check(kind: str, where: str, name: str, prof: object, refs: list[str]) -> None:
        eng = prof.get("engine") if isinstance(prof, dict) else None
        eng = eng if isinstance(eng, dict) else {}
        args = [str(a) for a in eng.get("args") or [] if isinstance(a, (str, int, float))]
        env = {str(k): str(v) for k, v in (eng.get("env") or {}).items()} if isinstance(eng.get("env"), dict) else {}
        for f, msg in profile_problems(args, env):
            out.append({"store": url, "object": where, "kind": kind, "name": name, "refs": refs, "field": f,
                        "problem": msg.split(";", 1)[0]})

    try:
        refs: dict[str, list[str]] = {}
        for e in cat.all_entries():
            refs.setdefault(e.manifest, []).append(f"{e.name}:{e.tag}")
        names = cat.names()
    except WarmctlError as e:
        return [{"store": url, "object": store.location, "kind": "catalog", "name": None, "refs": [], "field": None,
                 "problem": f"unreadable: {e}"}]
    for name in names:
        where = store.backend.location(f"{CATALOG_PREFIX}{name}/profile.json")
        try:
            rec = cat.profile(name)
        except WarmctlError as e:
            out.append({"store": url, "object": where, "kind": "profile record", "name": name, "refs": [],
                        "field": None, "problem": f"unreadable: {e}"})
            continue
        if rec is not None:
            check("profile record", where, name, rec["profile"], [])
    for digest in store.list_manifests():
        where = store.backend.location(manifest_key(digest))
        try:
            m = store.get_manifest(digest)
        except WarmctlError as e:
            out.append({"store": url, "object": where, "kind": "manifest", "name": None, "refs": refs.get(digest, []),
                        "field": None, "problem": f"unreadable: {e}"})
            continue
        check("manifest", where, m.name, m.profile, refs.get(digest, []))
    return out


def register(app: typer.Typer) -> None:
    """Add ``warmctl profile ...`` to ``app``."""
    papp = typer.Typer(help="Look at profiles without running them: ls, show, check, command, diff; scan stored ones for credentials.",
                       no_args_is_help=True)
    app.add_typer(papp, name="profile")

    @papp.command("ls")
    def ls(json_out: bool = JsonOpt) -> None:
        """Every profile NAME `snapshot NAME` can find, with its file, in search order: the
        configured profile_dirs ($WARMCTL_PROFILE_DIRS), /etc/warmctl/profiles, then the
        profiles shipped in the package. A file hidden by an earlier one of the same name is
        named too. Files are not validated here (`warmctl profile check`)."""
        from warmctl.records.config import load_settings
        from warmctl.records.profile import list_profiles, search_dirs

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
        from warmctl.records.profile import _flatten

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
        A credential is refused in [engine.env] and engine.args by its name (HF_TOKEN,
        --api-key) and by the shape of a value (a URL's user:password@, an Authorization or
        Bearer value, a PEM private key, cloud, hub and registry tokens: the last line names
        every rule; docs/operations.md, "Credentials and snapshots"), naming the field and the
        rule, never the value.
        Prints `FILE: ok` (and the ranks' layout) or one line per problem; exits 1 if any fails."""
        from warmctl.checkpoint.layout import cpu_binding, profile_sizes
        from warmctl.records.config import load_settings
        from warmctl.base.errors import HostError
        from warmctl.records.profile import ProfileError, find_profile, load_profile_file

        settings = load_settings()
        results: list[dict[str, Any]] = []
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
            from warmctl.records.credentials import shape_rules

            _echo("credential rules: names, " + ", ".join(r.name for r in shape_rules()))
        if not all(r["ok"] for r in results):
            raise typer.Exit(1)

    @papp.command("scan")
    def scan(stores: Optional[list[str]] = typer.Option(None, "--store", metavar="URL",
                                                        help="A store to scan (repeatable; default: the local store, "
                                                             "remote_store and the catalog)."),
             json_out: bool = JsonOpt) -> None:
        """Find credentials in the profiles stores already hold, as `profile check` would
        refuse them now (by name and by the shape of a value; older versions published some):
        every catalog profile record (catalog/NAME/profile.json) and the profile every manifest
        records. One line per problem: the object, the snapshot NAME and the NAME:TAG entries
        naming it, the field and the rule, never the value. Exits 0 when none holds one, 1
        otherwise. To remove what it finds: `warmctl rm NAME:TAG` for each entry named, then
        `warmctl gc` (with --store URL for a remote); publishing a clean profile under NAME
        replaces its profile record."""
        from warmctl.records.config import load_settings

        settings = load_settings()
        urls = list(dict.fromkeys(stores or [u for u in (str(settings.store_dir), settings.remote_store,
                                                         settings.catalog_url) if u]))
        found = [p for u in urls for p in stored_profile_problems(u)]
        if json_out:
            _json({"stores": urls, "problems": found})
        else:
            for p in found:
                refs = f" ({', '.join(p['refs'])})" if p["refs"] else ""
                what = f"{p['kind']} of {p['name']}{refs}" if p["name"] else p["kind"]
                _echo(f"{p['object']}: {what}: " + (f"{p['field']}: " if p["field"] else "") + p["problem"])
            _echo(f"scanned {len(urls)} store(s): {', '.join(urls)}; "
                  + (f"{len(found)} problem(s)" if found else "no stored profile holds a credential"))
        if found:
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
        from warmctl.records.config import load_settings

        _, prof = _load(name)
        settings = load_settings()
        launch = engine_launch(prof, settings.models_dir, settings.engine_env_passthrough,
                               settings.run_dir / prof.name / "engine.log")
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
        from warmctl.naming.catalog import Catalog
        from warmctl.records.config import load_settings
        from warmctl.records.profile import diff_profiles
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
