"""CLI commands: ``warmctl bench matrix|startup|probe`` (registered by :func:`register`).

A TARGET is either an http(s) URL of an OpenAI-compatible server or the NAME of an engine
``warmctl up`` started on this host (its public address, from ``warmctl status``).
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Optional

import typer

from warmctl.cli import output as _output
from warmctl.base.errors import EngineError

# httpx and the consoles are made by the command that runs, not when `warmctl` registers its
# commands (every `warmctl` paid for httpx here).


def resolve_target(target: str) -> str:
    """``target`` as a base URL: an ``http(s)://`` URL as given (trailing ``/`` and ``/v1``
    removed), else the public URL of the running engine NAME. Raises :class:`EngineError`."""
    if target.startswith(("http://", "https://")):
        url = target.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url
    from warmctl.records.config import load_settings
    from warmctl.pipelines.lifecycle import status

    rows = status(load_settings(), target)
    if not rows:
        raise EngineError(f"no engine named {target} on this host (`warmctl status`); give a URL or `warmctl up {target}`")
    st = rows[0].state
    if not rows[0].gate_alive:
        raise EngineError(f"engine {target} is recorded but its public port is closed (phase {st.phase}); "
                          f"`warmctl up {target}` again")
    host = "127.0.0.1" if st.public_host in ("0.0.0.0", "", "::") else st.public_host
    return f"http://{host}:{st.public_port}"


def _ints(s: str) -> list[int]:
    """``"64,256,1K,4k"`` -> ``[64, 256, 1024, 4096]``."""
    vals = []
    for part in s.split(","):
        part = part.strip().lower()
        if part:
            vals.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    if not vals or any(v <= 0 for v in vals):
        raise typer.BadParameter(f"expected a comma-separated list of positive integers, got {s!r}")
    return vals


def _out_dir(out_dir: Optional[Path], kind: str) -> Path:
    return out_dir or Path(f"bench-{kind}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")


def register(app: typer.Typer) -> None:
    """Add the ``bench`` sub-app to ``app``."""
    bench = typer.Typer(help="Measure an engine: speed-test matrix, start-up breakdown, probes.",
                        no_args_is_help=True)
    app.add_typer(bench, name="bench")

    @bench.command()
    def matrix(
        target: str = typer.Argument(..., help="URL of an OpenAI-compatible server, or NAME of an engine that is up."),
        contexts: str = typer.Option("1K,4K", "--contexts", "-c", help="Context lengths in tokens (e.g. 64,256 or 8K,32K)."),
        concurrency: str = typer.Option("1,2,4", "--concurrency", "-n", help="Simultaneous requests per decode cell."),
        duration: float = typer.Option(10.0, "--duration", "-d", help="Seconds each decode cell is measured for."),
        max_output: int = typer.Option(4096, help="max_tokens per decode request (capped at max_model_len - context)."),
        prefill_repeats: int = typer.Option(1, help="Measured prefill requests per context (after one discarded)."),
        prompt: str = typer.Option("random", help="'random' (seeded token ids) or 'corpus' (warmctl/data/corpus.txt)."),
        seed: Optional[int] = typer.Option(None, help="Prompt seed (default: fresh, recorded in the JSON)."),
        capacity_tokens: Optional[int] = typer.Option(None, help="Override the KV-cache capacity (tokens) the engine reports."),
        model: Optional[str] = typer.Option(None, help="Model name (default: the first one /v1/models lists)."),
        api_key: Optional[str] = typer.Option(None, envvar="OPENAI_API_KEY", help="Bearer token for the endpoint."),
        no_prefill: bool = typer.Option(False, "--no-prefill", help="Skip the prefill table."),
        no_decode: bool = typer.Option(False, "--no-decode", help="Skip the decode matrix."),
        out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (default ./bench-matrix-TIMESTAMP)."),
    ) -> None:
        """Speed-test matrix: prefill tok/s + TTFT per context; sustained decode per context x
        concurrency (total and per-request tok/s, TTFT, time between tokens, active, completed,
        output tokens, failed). Writes matrix.json, matrix.md (seed 003 layout), prefill.png,
        decode.png. Exits 2 if any request failed.

        Example: `warmctl bench matrix tiny -c 64,256 -n 1,2,4 -d 2 -o /tmp/b`
        """
        import httpx
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from warmctl.bench.matrix import MatrixOptions, run_matrix
        from warmctl.bench.report import markdown, write_matrix

        out, err = _output.out(), _output.err()

        url = resolve_target(target)
        opts = MatrixOptions(contexts=_ints(contexts), concurrency=_ints(concurrency), duration_s=duration,
                             max_output=max_output, prefill_repeats=prefill_repeats, prompt=prompt, seed=seed,
                             capacity_tokens=capacity_tokens, model=model, api_key=api_key,
                             run_prefill=not no_prefill, run_decode=not no_decode)
        err.print(f"bench matrix against {url}", highlight=False)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=False) as bar:
            task = bar.add_task("starting", total=1)

            def progress(desc: str, done: int, total: int) -> None:
                bar.update(task, description=desc, completed=done, total=total)
                if ":" in desc:
                    bar.console.print(f"  {desc}", highlight=False)

            try:
                res = run_matrix(url, opts, progress)
            except httpx.HTTPError as e:  # /v1/models (or /tokenize for corpus prompts) unusable
                raise EngineError(f"{url} is not a usable OpenAI-compatible endpoint: {e}") from None
        d = _out_dir(out_dir, "matrix")
        paths = write_matrix(res, d)
        typer.echo(markdown(res))
        out.print("wrote " + ", ".join(str(p) for p in paths.values()), highlight=False)
        failed = res.failed_requests()
        if failed:
            err.print(f"[bold red]{failed} requests failed[/] (see the Errors section of {paths['markdown']})")
            raise typer.Exit(2)

    @bench.command()
    def startup(
        profile: str = typer.Argument(..., help="Profile NAME (it must have a snapshot NAME:TAG in the store)."),
        runs: int = typer.Option(3, "--runs", "-r", min=1, help="Runs of each path."),
        tag: str = typer.Option("latest", help="Snapshot tag to restore from."),
        out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (default ./bench-startup-TIMESTAMP)."),
    ) -> None:
        """Cold start vs `up` from the snapshot, RUNS times each, medians by phase and the ratio.
        The engine must be down; it is left down. Writes startup.json and startup.md.

        Example: `warmctl bench startup tiny --runs 3`
        """
        from warmctl.bench.startup import markdown, run_startup
        from warmctl.records.config import load_settings
        from warmctl.records.profile import load_profile
        from warmctl.records.progress import ConsoleReporter

        out = _output.out()
        settings = load_settings()
        prof = load_profile(profile, settings.profile_dirs)

        def reporter(label: str) -> ConsoleReporter:
            r = ConsoleReporter()
            r.console.print(label, style="bold", markup=False, highlight=False)
            return r

        res = run_startup(prof, settings, runs=runs, tag=tag, reporter_factory=reporter)
        d = _out_dir(out_dir, "startup")
        d.mkdir(parents=True, exist_ok=True)
        (d / "startup.json").write_text(json.dumps(res.to_json(), indent=2) + "\n")
        md = markdown(res)
        (d / "startup.md").write_text(md)
        typer.echo(md)
        out.print(f"wrote {d / 'startup.json'}, {d / 'startup.md'}", highlight=False)
        if any(r.error for r in res.cold + res.restore):
            raise typer.Exit(2)

    @bench.command()
    def probe(
        kind: str = typer.Argument(..., help="needle | agent | spec | all"),
        target: str = typer.Argument(..., help="URL of an OpenAI-compatible server, or NAME of an engine that is up."),
        doc_tokens: str = typer.Option("34K,116K", help="needle: document lengths in tokens."),
        depths: str = typer.Option("0.1,0.5,0.9", help="needle: depths (fractions of the document)."),
        prefix_tokens: int = typer.Option(60 * 1024, help="agent: shared prefix in tokens."),
        new_tokens: int = typer.Option(1024, help="agent: new tokens per turn."),
        turns: int = typer.Option(6, help="agent: turns (and unseen prompts)."),
        spec_max_tokens: int = typer.Option(256, help="spec: max output tokens per text."),
        model: Optional[str] = typer.Option(None, help="Model name (default: the first one /v1/models lists)."),
        api_key: Optional[str] = typer.Option(None, envvar="OPENAI_API_KEY", help="Bearer token for the endpoint."),
        out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (default ./bench-probe-TIMESTAMP)."),
    ) -> None:
        """Probes from seed 000: needle recall at depths x document lengths; agent turns with a
        shared prefix vs unseen prompts (prefix-cache TTFT); speculative-decoding acceptance
        from the engine's counters ("not available" when it has none). Writes probes.json, probes.md.

        Example: `warmctl bench probe all tiny --doc-tokens 256,768 --prefix-tokens 512 --new-tokens 32`
        """
        from warmctl.bench import probes
        from warmctl.bench.metrics import engine_info

        out, err = _output.out(), _output.err()
        kinds = ["needle", "agent", "spec"] if kind == "all" else [kind]
        if any(k not in ("needle", "agent", "spec") for k in kinds):
            raise typer.BadParameter(f"KIND must be needle, agent, spec or all, not {kind!r}")
        url = resolve_target(target)
        dep = [float(x) for x in depths.split(",") if x.strip()]

        async def go(client):
            m = model or (await engine_info(client))["model"]
            results = []
            for k in kinds:
                with err.status(f"probe {k} on {url}"):
                    if k == "needle":
                        results.append(await probes.needle(client, m, _ints(doc_tokens), dep))
                    elif k == "agent":
                        results.append(await probes.agent_turns(client, m, prefix_tokens, new_tokens, turns))
                    else:
                        results.append(await probes.spec_decode(client, m, spec_max_tokens))
                err.print(f"  {k}: {results[-1]['verdict']}", highlight=False)
            return m, results

        m, results = probes.run(go, url, api_key)
        d = _out_dir(out_dir, "probe")
        d.mkdir(parents=True, exist_ok=True)
        (d / "probes.json").write_text(json.dumps({"kind": "warmctl-bench-probes", "url": url, "model": m,
                                                   "results": results}, indent=2) + "\n")
        md = probes.markdown(results, m)
        (d / "probes.md").write_text(md)
        typer.echo(md)
        out.print(f"wrote {d / 'probes.json'}, {d / 'probes.md'}", highlight=False)
        if any(r.get("failed") for r in results):
            raise typer.Exit(2)
