"""Output for people and for logs: one place that decides how the CLI writes.

Rules, applied by every command:

- **Terminal or not.** A stream is a terminal when ``isatty()`` says so. Not a terminal
  (systemd's journal, CI, a pipe): nothing is hard-wrapped (a long path or digest stays on its
  line), no tables (:func:`table` writes one plain tab-separated line per row under a header
  line), no progress bars or spinners (:class:`warmctl.records.progress.ConsoleReporter` writes one line
  per phase with its seconds).
- **NO_COLOR** (https://no-color.org: set and not empty): no colours and no other text styles,
  on a terminal too.
- **--json**: :data:`JsonOpt` is the one option every reporting command takes; :func:`emit_json`
  writes the result as one JSON document on stdout (2-space indent, keys as documented in
  docs/cli-json.md), and nothing else goes to stdout. Progress and warnings stay on stderr;
  errors stay ``error: ...`` lines on stderr with a non-zero exit code.

Use :func:`out` / :func:`err` for consoles (made per call, so redirections and ``COLUMNS``
set later apply), :func:`table` for tabular results, :func:`emit_json` for ``--json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import typer

from warmctl.base.console import console, err, is_terminal, no_color, out  # noqa: F401 - the consoles, re-exported

if TYPE_CHECKING:  # rich is imported when a console is made: not by `--help` or `up --json`
    from rich.console import Console

#: The ``--json`` option: ``flag: bool = JsonOpt`` in a command's signature.
JsonOpt: Any = typer.Option(False, "--json", help="Print the result as JSON on stdout (schema: docs/cli-json.md).")


def human(n: float) -> str:
    """``n`` bytes as :func:`warmctl.diskspace.human` writes them (``1.5 GiB``), that module
    imported at the first call: registering the commands imports none of the library."""
    from warmctl.diskspace import human as fmt

    return fmt(n)


def emit_json(obj: Any) -> None:
    """Write ``obj`` as one JSON document on stdout (2-space indent, a trailing newline; values
    JSON cannot hold, e.g. datetimes and paths, as their ``str``)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None,
          console_: Console | None = None, **table_kwargs: Any) -> None:
    """Print ``rows`` under ``columns``: a rich table on a terminal; otherwise a header line
    (``# `` + column names) and one line per row, fields separated by tabs (no padding, no
    wrapping; ``None`` as ``-``), preceded by ``# title`` when given. ``table_kwargs`` go to
    :class:`rich.table.Table` (terminal only)."""
    c = console_ or out()
    rows = [["-" if v is None else str(v) for v in r] for r in rows]
    if c.is_terminal:
        from rich.table import Table

        t = Table(title=title, **table_kwargs)
        for col in columns:
            t.add_column(col)
        for r in rows:
            t.add_row(*r)
        c.print(t)
        return
    f = c.file
    if title:
        f.write(f"# {title}\n")
    f.write("# " + "\t".join(columns) + "\n")
    for r in rows:
        f.write("\t".join(v.replace("\t", " ").replace("\n", " ") for v in r) + "\n")
    f.flush()


def plain_usage_errors() -> None:
    """When stderr is not a terminal, let click print usage errors as plain lines
    (``Usage: ...`` / ``Error: ...``) instead of typer's boxed rich panel, which is drawn 80
    columns wide and breaks long values inside the box. Call before running the app."""
    if not is_terminal(sys.stderr) or no_color():
        import typer.core

        typer.core.HAS_RICH = False
