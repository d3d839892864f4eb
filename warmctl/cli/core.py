"""CLI commands: snapshot, up, down, status, ls, model (the main job)."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

import warmctl
from warmctl.config import load_settings
from warmctl.profile import ProfileError, load_profile
from warmctl.progress import ConsoleReporter

out = Console()


def _split_ref(ref: str) -> tuple[str, str]:
    name, _, tag = ref.partition(":")
    return name, tag or "latest"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


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
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress, only the result."),
    ) -> None:
        """Cold-start the engine of PROFILE, warm it up, record the canary, and checkpoint it
        into the local store as NAME:TAG.

        Phases: cold start (with the engine's own start-up breakdown), warm-up grid, canary,
        CRIU dump, store. Nothing is left running afterwards.

        Example: `warmctl snapshot tiny`
        """
        from warmctl.snapshot import snapshot as run_snapshot

        settings = load_settings()
        prof = load_profile(profile, settings.profile_dirs)
        rep = ConsoleReporter(quiet=quiet)
        rep.info(f"snapshot of [bold]{prof.name}[/] ({prof.digest()[:19]}) into {settings.store_dir}")
        res = run_snapshot(prof, settings, rep, tag=tag)
        from warmctl.engine.vllm import PHASE_NAMES

        startup = {p.name: p.seconds for p in res.manifest.phases
                   if (p.name in PHASE_NAMES and p.seconds > 0) or p.name in ("other", "cold_start")}
        if startup:
            rep.info("engine start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in startup.items()))
        out.print(f"{prof.name}:{tag} {res.digest} ({_human(res.size)})")

    @app.command()
    def up(
        name: str = typer.Argument(..., help="NAME[:TAG] of a snapshot (and of the profile to cold-start from)."),
        port: Optional[int] = typer.Option(None, help="Public port (default: the profile's, 8000)."),
        host: Optional[str] = typer.Option(None, help="Public address to listen on (default: the profile's)."),
        snapshot_after: bool = typer.Option(False, "--snapshot-after", help="On the cold path, snapshot the warmed engine (it keeps serving)."),
        json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        insecure: bool = typer.Option(False, "--insecure-skip-signature-check",
                                      help="INSECURE: restore an unsigned or untrusted snapshot (a snapshot is executable state)."),
    ) -> None:
        """Restore NAME from its snapshot, prove it with the canary, then open the public port.

        Pre-flight checks (ports, CRIU) run before anything is restored; every chunk is
        verified; the canary must match bit for bit or nothing is served. With no usable
        snapshot, says why and cold-starts from the profile of the same name.
        Running `up` for an engine that is already up changes nothing.

        Example: `warmctl up tiny && curl localhost:8000/v1/models`
        """
        from warmctl.lifecycle import up as run_up

        settings = load_settings()
        ref, tag = _split_ref(name)
        try:
            prof = load_profile(ref, settings.profile_dirs)
        except ProfileError:
            prof = None
        rep = ConsoleReporter(quiet=json_out)
        if settings.agent_url:  # a configured agent does the work (issue 5); same output
            from warmctl.client import AgentClient
            res = AgentClient.from_settings(settings).up(ref, rep, tag=tag, public_port=port, public_host=host,
                                                         snapshot_after=snapshot_after, insecure=insecure)
        else:
            res = run_up(ref, settings, rep, tag=tag, profile=prof, public_port=port, public_host=host,
                         snapshot_after=snapshot_after, insecure=insecure)
        st = res.state
        if json_out:
            out.print_json(json.dumps({"name": st.name, "source": res.source, "already_up": res.already_up,
                                       "path": res.outcome, "reason": res.reason,
                                       "snapshot": res.snapshot_digest, "public": f"{st.public_host}:{st.public_port}",
                                       "timings_s": res.timings}))
            return
        if res.already_up:
            out.print(f"{st.name} is already up on {st.public_host}:{st.public_port} (pid {st.root_pid}); nothing changed")
            return
        t = Table(title=f"{st.name} up ({res.source})", show_header=True)
        t.add_column("phase")
        t.add_column("seconds", justify="right")
        for k, v in res.timings.items():
            t.add_row(k, f"{v:.2f}")
        out.print(t)
        out.print(f"serving {st.served_model_name} on http://{st.public_host}:{st.public_port}/v1")

    @app.command()
    def down(name: str = typer.Argument(..., help="Engine NAME.")) -> None:
        """Stop engine NAME: close its port, kill its processes, remove its shared-memory files.

        Safe to repeat: an engine that is not up is reported as such.
        """
        from warmctl.lifecycle import down as run_down

        settings = load_settings()
        if settings.agent_url:  # a configured agent does the work (issue 5); same output
            from warmctl.client import AgentClient
            st = AgentClient.from_settings(settings).down(name)
        else:
            st = run_down(name, settings)
        out.print(f"{name} is down" if st else f"{name} is not up; nothing to do")

    @app.command()
    def status(
        name: Optional[str] = typer.Argument(None, help="Only this engine."),
        json_out: bool = typer.Option(False, "--json", help="Print as JSON."),
    ) -> None:
        """Engines on this host: phase, processes, health, public port, restore timings."""
        from warmctl.lifecycle import status as run_status

        settings = load_settings()
        if settings.agent_url:  # a configured agent answers (issue 5); same output
            from warmctl.client import AgentClient
            rows = AgentClient.from_settings(settings).status(name)
        else:
            rows = run_status(settings, name)
        if json_out:
            out.print_json(json.dumps([{**r.state.model_dump(mode="json"), "engine_alive": r.engine_alive,
                                        "gate_alive": r.gate_alive, "healthy": r.healthy} for r in rows]))
            return
        if not rows:
            out.print("no engines" + (f" named {name}" if name else ""))
            raise typer.Exit(1 if name else 0)
        t = Table()
        for c in ("name", "phase", "source", "pid", "public", "healthy", "snapshot"):
            t.add_column(c)
        for r in rows:
            s = r.state
            phase = s.phase if r.engine_alive else f"{s.phase} (engine dead)"
            t.add_row(s.name, phase, s.source, str(s.root_pid), f"{s.public_host}:{s.public_port}" if r.gate_alive else "closed",
                      "yes" if r.healthy else "no", (s.manifest_digest or "")[:19])
        out.print(t)

    @app.command("ls")
    def ls(json_out: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
        """Snapshots in the local store: NAME:TAG, digest, size, created, cold-start seconds."""
        from warmctl.lifecycle import snapshots

        rows = snapshots(load_settings())
        if json_out:
            out.print_json(json.dumps([{"name": n, "tag": t, "digest": d, "size": m.total_size(),
                                        "created": m.created.isoformat()} for n, t, d, m in rows]))
            return
        t = Table()
        for c in ("snapshot", "digest", "size", "created", "cold start"):
            t.add_column(c)
        for n, tg, d, m in rows:
            # launch to healthy: the cold_start phase (manifests before it was the only one also
            # carry the same figure as "total")
            total = next((p.seconds for p in m.phases if p.name in ("cold_start", "total")), None)
            t.add_row(f"{n}:{tg}", d[:19], _human(m.total_size()), m.created.strftime("%Y-%m-%d %H:%M"),
                      f"{total:.0f} s" if total else "")
        out.print(t)

    model_app = typer.Typer(help="Models warmctl builds itself.", no_args_is_help=True)
    app.add_typer(model_app, name="model")

    @model_app.command("build-tiny")
    def build_tiny() -> None:
        """Build the `tiny` model (2-layer Llama, fixed seed, local tokenizer) if missing; print its path."""
        from warmctl import tinymodel

        out.print(str(tinymodel.build(tinymodel.model_dir(load_settings().models_dir))))
