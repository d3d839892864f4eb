"""CLI commands: snapshot, up, down, status, ls, model (the main job)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

import warmctl
from warmctl.cli import started
from warmctl.cli.output import JsonOpt, emit_json, table
from warmctl.cli.output import human as _human
from warmctl.cli.output import err as _err
from warmctl.cli.output import out as _out
from warmctl.base.errors import WarmctlError

# The library (config, profile, progress: pydantic models) is imported by the command that runs,
# not when the commands are registered: `--help`, `version` and the other areas' commands stay
# cheap.


def _age(seconds: float) -> str:
    """``42 s``, ``7 min``, ``3.5 h``, ``2.0 d``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _layout_json(m) -> dict | None:
    """The manifest's ``restore.layout`` as JSON (docs/cli-json.md), None when it records none
    (or ``m`` is a problem string: the manifest is unreadable)."""
    lay = None if isinstance(m, str) or m is None else m.restore.layout
    return None if lay is None else lay.model_dump(mode="json")


def register(app: typer.Typer) -> None:
    """Add the main-job commands to ``app``."""

    @app.command()
    def version() -> None:
        """Print warmctl's version."""
        typer.echo(warmctl.__version__)

    @app.command()
    def snapshot(
        profile: str = typer.Argument(..., help="Profile NAME (profiles/NAME.toml) or path to a .toml file."),
        tag: str = typer.Option("latest", help="Tag the snapshot NAME:TAG."),
        push: Optional[bool] = typer.Option(None, "--push/--no-push",
                                            help="Publish to the remote store after the local one (default: when remote_store is set)."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress, only the result."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Cold-start the engine of PROFILE, warm it up, record the canary, and checkpoint it
        into the local store as NAME:TAG; then, with a remote store configured, publish it
        there for the fleet (chunks, manifest, signature, then the catalog entry, last).

        Phases: cold start (with the engine's own start-up breakdown), warm-up grid, canary,
        CRIU dump, store, publish, push. Nothing is left running afterwards.

        Example: `warmctl snapshot tiny`, or `WARMCTL_REMOTE_STORE=s3://fleet/warmctl warmctl snapshot tiny`
        """
        from warmctl.pipelines.snapshot import snapshot as run_snapshot
        from warmctl.records.config import load_settings
        from warmctl.records.profile import load_profile
        from warmctl.records.progress import ConsoleReporter

        settings = load_settings()
        prof = load_profile(profile, settings.profile_dirs)
        rep = ConsoleReporter(quiet=quiet)
        push_to = settings.remote_store if push is not False else None
        if push and not push_to:
            raise WarmctlError("--push: no remote store configured (set remote_store or WARMCTL_REMOTE_STORE)")
        if not quiet:  # the CLI renders: markup here, never in the pipeline's messages
            from rich.markup import escape

            rep.console.print(f"snapshot of [bold]{escape(prof.name)}[/] (profile {prof.digest()[:19]}) into "
                              + escape(f"{settings.store_dir}" + (f", then published to {push_to}" if push_to else "")),
                              highlight=False)
        res = run_snapshot(prof, settings, rep, tag=tag, push_to=push_to)
        from warmctl.engine.startlog import PHASE_NAMES

        startup = {p.name: p.seconds for p in res.manifest.phases
                   if (p.name in PHASE_NAMES and p.seconds > 0) or p.name in ("other", "cold_start")}
        if startup:
            rep.info("engine start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in startup.items()))
        if json_out:
            emit_json({"name": prof.name, "tag": tag, "digest": res.digest, "size": res.size,
                       "profile_digest": prof.digest(), "pushed_to": push_to,
                       "timings_s": {p.name: p.seconds for p in res.manifest.phases}})
            return
        _out().print(f"{prof.name}:{tag} {res.digest} (the snapshot's digest; {_human(res.size)})", highlight=False)

    @app.command()
    def up(
        name: str = typer.Argument(..., help="NAME[:TAG] or NAME@sha256:DIGEST of a snapshot (NAME is also the profile to cold-start from)."),
        port: Optional[int] = typer.Option(None, help="Public port (default: the profile's, 8000)."),
        host: Optional[str] = typer.Option(None, help="Public address to listen on (default: the profile's)."),
        snapshot_after: bool = typer.Option(False, "--snapshot-after", help="On the cold path, snapshot the warmed engine (it keeps serving; a snapshot that fails is reported as an error, the engine still serves and up exits 0)."),
        json_out: bool = JsonOpt,
        insecure: bool = typer.Option(False, "--insecure-skip-signature-check",
                                      help="INSECURE: restore an unsigned or untrusted snapshot (a snapshot is executable state)."),
        allow_rollback: bool = typer.Option(False, "--allow-rollback",
                                            help="Restore NAME:TAG even when it is older than the newest snapshot of it this node "
                                                 "accepted for this kind of host (else refused as a rollback; NAME@DIGEST also pins one)."),
        cold_start: Optional[str] = typer.Option(None, "--cold-start", metavar="fallback|never",
                                                 help="No usable snapshot: cold-start from the profile (fallback) or fail naming why (never). Default: the cold_start setting."),
        api_key_file: Optional[Path] = typer.Option(None, "--api-key-file",
                                                    help="API keys the public port requires, one per line (config: gate_api_key_file)."),
        tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="PEM certificate chain: TLS on the public port (config: gate_tls_cert)."),
        tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert (config: gate_tls_key)."),
        restore_pages: Optional[str] = typer.Option(None, "--restore-pages", metavar="lazy|eager|auto",
                                                    help="How the restore copies the engine's memory: lazy (on demand, the rest in the "
                                                         "background), eager (all before it runs), auto. Default: the restore_pages setting."),
        foreground: bool = typer.Option(False, "--foreground",
                                        help="Stay in the foreground as the engine's supervisor (systemd Type=notify: READY=1 after "
                                             "the canary and the open port, WATCHDOG=1 while healthy); exit 7 when the engine dies, "
                                             "0 after SIGTERM (which takes the engine down). In a Kubernetes pod (pod_name set) "
                                             "it also keeps the pod's warmctl.io/Restored condition and writes why it failed to "
                                             "the termination message file."),
        ready_port: Optional[int] = typer.Option(None, "--ready-port", min=1, max=65535,
                                                 help="With --foreground: serve GET /ready?wait=SECONDS on this port (on --host's "
                                                      "address, else 127.0.0.1) for a readiness probe: held while up works, "
                                                      "answered the moment the public port opens, then what the gate's /health "
                                                      "answers (warmctl/kube/readiness.py)."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress and no phase table, only the result line."),
    ) -> None:
        """Restore NAME from its snapshot, prove it with the canary, then open the public port.

        The snapshot is found in the catalog of the configured store (the remote store on a
        fleet node: chunks stream from it into the local store, which keeps them for the next
        `up`). Pre-flight checks (ports, CRIU) run before anything is restored; every chunk is
        verified; the canary must match bit for bit or nothing is served. With no usable
        snapshot, says why and cold-starts from the profile of the same name, unless
        `--cold-start never` (or the cold_start setting) says to fail instead.
        Running `up` for an engine that is already up changes nothing.

        With `--foreground` the command stays as the engine's supervisor (the main process of
        systemd/warmctl-up@.service, or of an engine pod's container): see warmctl/cli/foreground.py
        and docs/kubernetes.md.

        Example: `warmctl up tiny && curl localhost:8000/v1/models`
        """
        from warmctl.naming.catalog import Ref
        from warmctl.records.config import load_settings
        from warmctl.records.contract import UpRequest, UpResult
        from warmctl.records.progress import ConsoleReporter

        overrides = {}
        if cold_start is not None:
            if cold_start not in ("fallback", "never"):
                raise typer.BadParameter(f"{cold_start!r}: use fallback or never", param_hint="--cold-start")
            overrides["cold_start"] = cold_start
        if restore_pages is not None:
            if restore_pages not in ("lazy", "eager", "auto"):
                raise typer.BadParameter(f"{restore_pages!r}: use lazy, eager or auto", param_hint="--restore-pages")
            overrides["restore_pages"] = restore_pages
        gate_flags = {"gate_api_key_file": api_key_file, "gate_tls_cert": tls_cert, "gate_tls_key": tls_key}
        if ready_port is not None and not foreground:
            raise typer.BadParameter("the readiness endpoint is the supervisor's: add --foreground", param_hint="--ready-port")
        settings = load_settings(None, {**overrides, **gate_flags})
        if settings.agent_url and foreground:
            raise typer.BadParameter("with an agent (agent_url), the agent supervises engines: ask it with "
                                     "POST /v1/engines/NAME/up {\"restart\": \"on-failure\"}", param_hint="--foreground")
        if settings.agent_url and restore_pages is not None:
            raise typer.BadParameter("with an agent, restore_pages is the agent's setting (in its config)",
                                     param_hint="--restore-pages")
        if settings.agent_url and allow_rollback:
            raise typer.BadParameter("with an agent, pin the snapshot by digest instead (NAME@sha256:...)",
                                     param_hint="--allow-rollback")
        if settings.agent_url and any(gate_flags.values()):
            raise typer.BadParameter("with an agent, the gate's key and TLS files are the agent's settings "
                                     "(gate_api_key_file, gate_tls_cert, gate_tls_key in its config)")
        r = Ref.parse(name)
        try:
            req = UpRequest(name=r.name, tag=r.tag, digest=r.digest, port=port, host=host, snapshot_after=snapshot_after,
                            insecure=insecure, allow_rollback=allow_rollback, cold_start=overrides.get("cold_start"))
        except ValueError as e:  # pydantic's ValidationError: a port or host out of range
            raise typer.BadParameter("; ".join(f"{x['loc'][0]}: {x['msg']}" for x in e.errors()))  # type: ignore[attr-defined]
        if foreground:
            from warmctl.cli import foreground as fg
            from warmctl.pipelines.lifecycle import up as run_up

            started()

            def show(res) -> None:
                _show_up(res, json_out, quiet)
                sys.stdout.flush()  # a pipe (the journal) is block-buffered, and this process stays

            code = fg.run(req.name, settings, fg.NotifyingReporter(quiet=json_out or quiet),
                          lambda rep: run_up(req, settings, rep), show,
                          lambda line: _err().print(line, markup=False, highlight=False),
                          ready_at=None if ready_port is None else (host or "127.0.0.1", ready_port))
            raise typer.Exit(code)
        rep = ConsoleReporter(quiet=json_out or quiet)
        if settings.agent_url:  # a configured agent does the work; same output
            from warmctl.client import AgentClient

            started()
            res = AgentClient.from_settings(settings).up(req, rep, check=False)
            _show_up(res, json_out, quiet)
            if res.failure is not None:
                raise res.error()  # type: ignore[misc]
            return
        from warmctl.pipelines.lifecycle import up as run_up

        started()
        _stop_signals_raise()
        try:
            res = run_up(req, settings, rep)
        except WarmctlError as e:
            if json_out:
                _show_up(UpResult.failed(req.name, e), json_out, quiet)
            raise
        _show_up(res, json_out, quiet)

    def _stop_signals_raise() -> None:
        """SIGTERM and SIGHUP (``kill``, a closed terminal, ``systemctl stop``) end ``up`` as Ctrl-C
        does: an exception (``SystemExit``, exit 128 + the signal) that runs its teardown,
        instead of the interpreter dying where it stands with the engine half restored and its
        record left. Measured before: SIGTERM 0.2 s into the restore left the engine running,
        recorded only as "restoring (engine dead)"."""
        import signal

        def stop(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, stop)

    def _show_up(res, json_out: bool, quiet: bool = False) -> None:
        """``up``'s result (:class:`warmctl.records.contract.UpResult`) on stdout: its JSON document
        (:meth:`~warmctl.records.contract.UpResult.to_json`, docs/cli-json.md; also for a failed ``up``),
        or the phase table and the serving line (``quiet``: the serving line only, as
        ``snapshot -q`` prints only its result; a failed ``up``: nothing, its error goes to
        stderr). A snapshot ``--snapshot-after`` could not make while the engine kept serving
        (``snapshot_error``) is one ``error: ...`` line on stderr, with ``--json`` too."""
        if res.snapshot_error:
            typer.echo(f"error: {res.snapshot_error}", err=True)
        if json_out:
            emit_json(res.to_json())
            return
        st = res.state
        if st is None:
            return
        o = _out(highlight=False)
        if res.already_up:
            o.print(f"{st.name} is already up on {st.public_host}:{st.public_port} (pid {st.root_pid}); nothing changed")
            return
        if not quiet:
            table(("phase", "seconds"), [(k, f"{v:.2f}") for k, v in res.timings.items()],
                  title=f"{st.name} up ({res.source})", console_=o)
        o.print(f"serving {st.served_model_name} on http://{st.public_host}:{st.public_port}/v1")

    @app.command()
    def down(name: str = typer.Argument(..., help="Engine NAME."),
             now: bool = typer.Option(False, "--now", help="Do not wait for in-flight requests (no drain).")) -> None:
        """Stop engine NAME: close its public port, let in-flight requests finish (up to
        gate_drain_s, default 30 s; --now: no wait), kill its processes, remove its
        shared-memory files.

        Safe to repeat: an engine that is not up is reported as such.
        """
        from warmctl.pipelines.lifecycle import down as run_down
        from warmctl.records.config import load_settings

        settings = load_settings()
        if settings.agent_url:  # a configured agent does the work; same output
            from warmctl.client import AgentClient
            st = AgentClient.from_settings(settings).down(name, now=now)
        else:
            st = run_down(name, settings, now=now)
        _out(highlight=False).print(f"{name} is down" if st else f"{name} is not up; nothing to do")

    @app.command()
    def status(
        name: Optional[str] = typer.Argument(None, help="Only this engine."),
        json_out: bool = JsonOpt,
        orphans: bool = typer.Option(False, "--orphans", help="List the /dev/shm files no live engine holds instead, "
                                                               "with size, age (since last written) and the processes that use them."),
    ) -> None:
        """Engines on this host: phase, processes, health, public port, /dev/shm held, snapshot;
        an engine made from another version of its profile than the one on disk is named on
        stderr, with the fields that changed.

        With --orphans: every file in /dev/shm that no live engine of this host holds (oldest
        first), its size, the memory it takes, how long ago it was last written and the PIDs
        that use it ("none": what a killed engine left; `warmctl down NAME` of a recorded dead
        engine removes its files)."""
        from warmctl.pipelines.lifecycle import status as run_status
        from warmctl.records.config import load_settings

        settings = load_settings()
        if orphans:
            from warmctl.pipelines.lifecycle import shm_orphans

            files = shm_orphans(settings)
            if json_out:
                emit_json([{"path": str(f.path), "size": f.size, "allocated": f.allocated,
                            "age_s": round(f.age_s, 1), "users": f.users} for f in files])
                return
            if not files:
                _out().print("no /dev/shm files outside the live engines")
                return
            table(("file", "size", "in memory", "last written", "used by"),
                  [(str(f.path), _human(f.size), _human(f.allocated), _age(f.age_s), ", ".join(map(str, f.users)) or "none")
                   for f in files], title="/dev/shm files no live engine holds")
            return
        if settings.agent_url:  # a configured agent answers; same output
            from warmctl.client import AgentClient
            rows = AgentClient.from_settings(settings).status(name)
        else:
            rows = run_status(settings, name)
        from warmctl.naming.drift import DriftCache, of_engine

        cache = DriftCache(settings.profile_dirs)
        drifts = [of_engine(r.state, settings.store_dir, cache, settings=settings) for r in rows]
        if json_out:
            emit_json([{**r.state.model_dump(mode="json"), "engine_alive": r.engine_alive,
                        "gate_alive": r.gate_alive, "healthy": r.healthy, "profile": d.as_json(),
                        "shm_count": r.shm_count, "shm_bytes": r.shm_bytes, "lazy_copy": r.lazy_copy,
                        "failure": r.failure or None}
                       for r, d in zip(rows, drifts)])
            if name and not rows:
                raise typer.Exit(1)
            return
        if not rows:
            _out().print("no engines" + (f" named {name}" if name else ""))
            raise typer.Exit(1 if name else 0)
        lines = []
        for r in rows:
            s = r.state
            phase = s.phase if r.engine_alive else f"{s.phase} (engine dead)"
            if r.failure:
                phase = "failed"
            elif r.lazy_copy == "running":
                phase += " (copying pages)"
            public = (f"{'https' if s.gate_tls else 'http'}://{s.public_host}:{s.public_port}"
                      f" ({'key' if s.gate_api_key else 'no key'})") if r.gate_alive else "closed"
            ranks = (f"{s.layout}: " if s.layout else "") + ", ".join(f"{k} {v}" for k, v in s.ranks.items())
            lines.append((s.name, phase, s.source, str(s.root_pid), ranks, public, "yes" if r.healthy else "no",
                          f"{_human(r.shm_bytes)} in {r.shm_count} files", (s.manifest_digest or "")[:19]))
        table(("name", "phase", "source", "pid", "ranks", "public", "healthy", "/dev/shm", "snapshot"), lines)
        for r, d in zip(rows, drifts):  # warnings: stderr, one whole line each
            s = r.state
            if r.failure:
                typer.echo(f"engine {s.name} failed: {r.failure}", err=True)
            if s.snapshot_error:
                typer.echo(f"engine {s.name}: {s.snapshot_error}", err=True)
            note = d.message(f"engine {s.name} ({'snapshot ' + s.manifest_digest[:19] if s.manifest_digest else s.source})")
            if note:
                typer.echo(note, err=True)

    @app.command("ls")
    def ls(
        json_out: bool = JsonOpt,
        remote: bool = typer.Option(False, "--remote", help="List the remote store's catalog instead of the local one."),
    ) -> None:
        """Snapshots named in the local store's catalog (or the remote's): NAME:TAG, digest, size,
        created, cold-start seconds, and for which host (one row per kind of host). A snapshot
        made from another version of its profile than the one on disk is named on stderr, with
        the fields that changed (`up` would cold-start instead of restoring it)."""
        from warmctl.naming.fleet import snapshots
        from warmctl.records.config import load_settings

        settings = load_settings()
        if remote and not settings.remote_store:
            raise WarmctlError("--remote: no remote store configured (set remote_store or WARMCTL_REMOTE_STORE)")
        from warmctl.naming.drift import DriftCache

        rows = snapshots(settings, settings.remote_store if remote else None)
        cache = DriftCache(settings.profile_dirs)
        drifts = [cache.drift(e.name, e.profile_digest, None if isinstance(m, str) else m.profile) for e, m in rows]
        if json_out:
            emit_json([{"name": e.name, "tag": e.tag, "digest": e.manifest, "size": e.size,
                        "created": e.created.isoformat(), "host": e.host, "profile": d.as_json(),
                        "layout": _layout_json(m),
                        **({"problem": m} if isinstance(m, str) else {})}
                       for (e, m), d in zip(rows, drifts)])
            return
        from warmctl.host import HostFingerprint

        lines = []
        for e, m in rows:
            # launch to healthy: the cold_start phase (manifests before it was the only one also
            # carry the same figure as "total")
            if isinstance(m, str):  # the manifest is missing or unreadable: listed, with why (also warned)
                lines.append((f"{e.name}:{e.tag}", e.manifest[:19], _human(e.size), e.created.strftime("%Y-%m-%d %H:%M"),
                              "", "", f"manifest unreadable: {m}"))
                continue
            total = next((p.seconds for p in m.phases if p.name in ("cold_start", "total")), None)
            try:
                hs = HostFingerprint.model_validate(e.host).summary()
            except ValueError:
                hs = "(unreadable fingerprint)"
            lay = m.restore.layout
            lines.append((f"{e.name}:{e.tag}", e.manifest[:19], _human(e.size), e.created.strftime("%Y-%m-%d %H:%M"),
                          f"{total:.0f} s" if total else "", lay.describe() if lay else "", hs))
        table(("snapshot", "digest", "size", "created", "cold start", "ranks", "host"), lines)
        for (e, _), d in zip(rows, drifts):  # warnings: stderr, one whole line each
            note = d.message(f"{e.name}:{e.tag} ({e.manifest[:19]})")
            if note:
                typer.echo(note, err=True)

    @app.command("rm")
    def rm(
        ref: str = typer.Argument(..., metavar="NAME[:TAG]", help="The name to remove (tag defaults to 'latest')."),
        remote: bool = typer.Option(True, "--remote/--local-only",
                                    help="Also remove it from the remote store's catalog, when one is configured (default)."),
    ) -> None:
        """Remove NAME:TAG from the catalog (every kind of host's entry), locally and on the
        remote store: no node's `up` finds it any more. The data stays until `warmctl gc`
        (run with --store URL for the remote), which then frees what no other snapshot shares.

        Idempotent: a name that is not there is reported as such.
        """
        from warmctl.naming.catalog import Ref
        from warmctl.naming.fleet import remove_snapshot
        from warmctl.records.config import load_settings

        settings = load_settings()
        r = Ref.parse(ref)
        removed = remove_snapshot(settings, r.name, r.tag, remote=remote)
        for where, digests in removed.items():
            _out().print(f"{r}: removed {len(digests)} entr{'y' if len(digests) == 1 else 'ies'} from {where}"
                      + (f" ({', '.join(d[:19] for d in digests)})" if digests else " (nothing there)"), highlight=False)

    model_app = typer.Typer(help="Models warmctl builds itself.", no_args_is_help=True)
    app.add_typer(model_app, name="model")

    @model_app.command("build-tiny")
    def build_tiny() -> None:
        """Build the `tiny` model (2-layer Llama, fixed seed, local tokenizer) if missing; print its path."""
        from warmctl.models import tinymodel
        from warmctl.records.config import load_settings

        _out().print(str(tinymodel.build(tinymodel.model_dir(load_settings().models_dir))))
