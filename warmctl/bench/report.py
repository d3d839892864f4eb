"""Render bench results: JSON, Markdown in the layout of seed 003, PNG plots (matplotlib).

Number formats follow seed 003: prefill tokens/s as ``26.5K``; TTFT in whole ms with thousands
separators (``1,165 ms``); decode tokens/s with one decimal (``1,621.8``); time between tokens
``6.1 ms``; ``—`` where a cell has no number.
"""

from __future__ import annotations

import json
from pathlib import Path

from warmctl.bench.matrix import TOO_LONG, VALID, MatrixResult

DASH = "—"


def fmt_tokens(n: int | None) -> str:
    """A context length in tokens: 8192 -> ``8K``, 256 -> ``256``, 1536 -> ``1.5K``."""
    if n is None:
        return DASH
    if n >= 1024:
        k = n / 1024
        return f"{k:.0f}K" if abs(k - round(k)) < 1e-9 else f"{k:.1f}K"
    return str(n)


def fmt_kilo(x: float | None) -> str:
    """Tokens/s in thousands above 1,000 (``26.5K``), else one decimal."""
    if x is None:
        return DASH
    return f"{x / 1000:.1f}K" if x >= 1000 else f"{x:,.1f}"


def fmt_ms(s: float | None, decimals: int = 0) -> str:
    """Seconds as milliseconds: ``1,165 ms`` (``decimals`` after the point)."""
    return DASH if s is None else f"{s * 1000:,.{decimals}f} ms"


def fmt_num(x: float | int | None, decimals: int = 1) -> str:
    if x is None:
        return DASH
    return f"{x:,}" if isinstance(x, int) else f"{x:,.{decimals}f}"


def _lines_kv(title: str, rows: list[tuple[str, object]]) -> list[str]:
    out = [f"### {title}", ""]
    out += [f"- {k}: {v}" for k, v in rows if v not in (None, "")]
    return out + [""]


def markdown(res: MatrixResult, *, title: str = "Speed test matrix") -> str:
    """The seed-003 report: header, hardware/engine/run facts, prefill table, decode grid
    (rows: context, columns: concurrency; ``total tok/s · TTFT``), all measurements."""
    m, o = res.meta, res.meta.get("options", {})
    ctxs = sorted({c.context for c in res.decode} | {r.context for r in res.prefill})
    concs = sorted({c.concurrency for c in res.decode})
    host = m.get("host") or {}
    lines = [f"# {title}", "", f"**{m.get('model')}** on {host.get('summary') or m.get('url')}", ""]
    summary = []
    if res.decode:
        summary.append(f"{len({c.context for c in res.decode})} contexts ({fmt_tokens(min(ctxs))}–{fmt_tokens(max(ctxs))})"
                       f" × {len(concs)} concurrency levels ({min(concs)}–{max(concs)})")
    if res.prefill:
        summary.append("prefill at " + ", ".join(fmt_tokens(r.context) for r in res.prefill))
    lines += [f"{m.get('engine', 'engine')} · {m.get('engine_version') or 'version unknown'} · " + " · ".join(summary), "",
              f"Measured {m.get('started_at', '?')} by warmctl bench", ""]
    if host:
        lines += _lines_kv("Hardware", [("CPU", host.get("cpu")), ("CPU count", host.get("cpu_count")),
                                        ("GPU", host.get("gpu") or "none"), ("GPU count", host.get("gpu_count")),
                                        ("Kernel", host.get("kernel")), ("OS", host.get("os"))])
    else:
        lines += ["### Hardware", "", "- unknown (the endpoint is not on this host)", ""]
    lines += _lines_kv("Engine", [("Engine", m.get("engine", "unknown")), ("Version", m.get("engine_version")),
                                  ("Endpoint", m.get("url")), ("Max model length", fmt_num(m.get("max_model_len"))),
                                  ("KV cache capacity", f"{m['capacity_tokens']:,} tokens ({m.get('capacity_source')})"
                                   if m.get("capacity_tokens") else f"unknown ({m.get('capacity_source')})")])
    lines += _lines_kv("Run", [("Served model", m.get("model")), ("Benchmark tool", f"warmctl bench {m.get('tool_version', '')}".strip()),
                               ("Decode test", "Fixed duration"),
                               ("Prefill mode", f"Separate request per context, unseen prompt, 1 output token; "
                                                f"median of {o.get('prefill_repeats', 1)} after 1 discarded"),
                               ("Prompts", f"{o.get('prompt')} (seed {m.get('seed')})"),
                               ("Time per measurement", f"{o.get('duration_s', 0):.1f} s"),
                               ("Max output", f"{o.get('max_output', 0):,} tokens (capped at max model length − context)"),
                               ("Failed requests", res.failed_requests())])
    if m.get("launch_command"):
        lines += ["### Launch command", "", "```", m["launch_command"], "```", ""]

    if res.prefill:
        lines += ["## Prefill", "", "prompt tok/s by context length", "",
                  "| Context | Prompt tok/s | TTFT |", "|---|---:|---:|"]
        for r in res.prefill:
            lines.append(f"| {fmt_tokens(r.context)} | {fmt_kilo(r.tok_s) if r.status != TOO_LONG else TOO_LONG} | {fmt_ms(r.ttft_s)} |")
        lines.append("")
    if res.decode:
        grid = {(c.context, c.concurrency): c for c in res.decode}
        lines += ["## Sustained decode", "", "total tok/s · rows are context length, columns are simultaneous requests", "",
                  "| Context | " + " | ".join(str(c) for c in concs) + " |",
                  "|---|" + "---:|" * len(concs)]
        for ctx in sorted({c.context for c in res.decode}):
            cells = []
            for conc in concs:
                c = grid.get((ctx, conc))
                if c is None:
                    cells.append(DASH)
                elif c.total_tok_s is None:
                    cells.append(c.status)
                else:
                    flag = "" if c.status == VALID else f" ({c.status}: {c.failed} failed)"
                    cells.append(f"{fmt_num(c.total_tok_s)} · {fmt_ms(c.ttft_s)} TTFT{flag}")
            lines.append(f"| {fmt_tokens(ctx)} | " + " | ".join(cells) + " |")
        lines += ["", "Over capacity: not run because this many requests at this context would exceed the server's "
                  "KV cache (context × requests > capacity tokens).", "",
                  "TTFT is measured after the benchmark warms the server's prompt cache, so it mostly excludes prefill.", ""]
    lines += ["## All measurements", "", "Latencies are medians. Total tok/s is output across all simultaneous requests.", "",
              "| Phase | Context | Requests at once | Status | Total tok/s | Per request tok/s | TTFT | Time between tokens "
              "| Average active requests | Completed requests | Output tokens | Failed requests | Measured for |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res.prefill:
        lines.append(f"| Prefill | {fmt_tokens(r.context)} | 1 | {r.status} | {fmt_kilo(r.tok_s)} | {DASH} | {fmt_ms(r.ttft_s)} "
                     f"| {DASH} | {DASH} | {r.requests - r.failed if r.requests else DASH} | {DASH} | {r.failed} | {DASH} |")
    dur = o.get("duration_s")
    for c in res.decode:
        ran = c.total_tok_s is not None
        lines.append(
            f"| Sustained decode | {fmt_tokens(c.context)} | {c.concurrency} | {c.status} | {fmt_num(c.total_tok_s)} "
            f"| {fmt_num(c.per_request_tok_s)} | {fmt_ms(c.ttft_s)} | {fmt_ms(c.tbt_s, 1)} | {fmt_num(c.avg_active)} "
            f"| {fmt_num(c.completed)} | {fmt_num(c.output_tokens)} | {c.failed if ran else DASH} "
            f"| {f'{dur:.1f} s' if ran and dur else DASH} |")
    lines.append("")
    errs = [(f"prefill {fmt_tokens(r.context)}", e) for r in res.prefill for e in r.errors] + \
           [(f"decode {fmt_tokens(c.context)} × {c.concurrency}", e) for c in res.decode for e in c.errors]
    if errs:
        lines += ["## Errors", ""] + [f"- {where}: {e}" for where, e in errs] + [""]
    return "\n".join(lines)


def _log2_ticks(ax, values: list[int], label) -> None:
    """Log-2 x axis with a labelled tick at each measured value."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [label(v) for v in values])
    ax.xaxis.set_minor_formatter(NullFormatter())


def plots(res: MatrixResult, out_dir: Path) -> list[Path]:
    """Write ``prefill.png`` (prompt tok/s and TTFT by context) and ``decode.png`` (total and
    per-request tok/s by concurrency, one line per context). Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    pre = [r for r in res.prefill if r.tok_s is not None]
    if pre:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        xs = [r.context for r in pre]
        a1.plot(xs, [r.tok_s for r in pre], marker="o")
        a1.set(xlabel="context (tokens)", ylabel="prompt tokens/s", title="Prefill throughput")
        a2.plot(xs, [r.ttft_s * 1000 for r in pre], marker="o", color="tab:orange")
        a2.set(xlabel="context (tokens)", ylabel="TTFT (ms)", title="Time to first token")
        for a in (a1, a2):
            _log2_ticks(a, xs, fmt_tokens)
            a.grid(True, alpha=0.3)
        fig.suptitle(f"{res.meta.get('model')} · prefill")
        fig.tight_layout()
        p = out_dir / "prefill.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
    dec = [c for c in res.decode if c.total_tok_s is not None]
    if dec:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for ctx in sorted({c.context for c in dec}):
            cs = sorted((c for c in dec if c.context == ctx), key=lambda c: c.concurrency)
            a1.plot([c.concurrency for c in cs], [c.total_tok_s for c in cs], marker="o", label=fmt_tokens(ctx))
            a2.plot([c.concurrency for c in cs], [c.per_request_tok_s or 0 for c in cs], marker="o", label=fmt_tokens(ctx))
        a1.set(xlabel="simultaneous requests", ylabel="total output tokens/s", title="Sustained decode")
        a2.set(xlabel="simultaneous requests", ylabel="tokens/s per request", title="Per request")
        for a in (a1, a2):
            _log2_ticks(a, sorted({c.concurrency for c in dec}), str)
            a.grid(True, alpha=0.3)
            a.legend(title="context")
        fig.suptitle(f"{res.meta.get('model')} · decode")
        fig.tight_layout()
        p = out_dir / "decode.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
    return written


def write_matrix(res: MatrixResult, out_dir: Path) -> dict[str, Path]:
    """Write ``matrix.json``, ``matrix.md`` and the plots into ``out_dir``; returns them by kind."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "matrix.json", "markdown": out_dir / "matrix.md"}
    paths["json"].write_text(json.dumps(res.to_json(), indent=2) + "\n")
    paths["markdown"].write_text(markdown(res))
    for p in plots(res, out_dir):
        paths[p.stem] = p
    return paths
