"""Progress and phase timing for long operations (snapshot, up, push, pull).

Pipelines take a :class:`Reporter`; the CLI passes one that draws on the terminal, the agent
one that feeds a job's log and progress. The base class only records phase timings.

Messages are plain text: a pipeline never writes console markup. How a line looks (a warning
in yellow) is the renderer's business (:class:`ConsoleReporter`), chosen by the method that
reported it (:meth:`Reporter.info` or :meth:`Reporter.warn`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import cached_property
from typing import Any, Callable, Iterator

from warmctl.base import faults
from warmctl.records.manifest import Phase


class Reporter:
    """Records phases (name, seconds) in order; subclasses show them.

    ``phase(name)`` is a context manager that times its block; ``info(msg)`` reports a line,
    ``warn(msg)`` one the operator should notice (both plain text, never markup);
    ``bytes_progress(desc, total)`` returns a callable that takes the number of bytes just done.
    """

    def __init__(self) -> None:
        self.phases: list[Phase] = []

    @contextmanager
    def phase(self, name: str, desc: str = "") -> Iterator[None]:
        faults.point(name)  # a test's kill -9 at this phase (WARMCTL_TEST_KILL_AT_PHASE)
        t0 = time.monotonic()
        self.started(name, desc)
        ok = False
        try:
            yield
            ok = True
        finally:
            secs = time.monotonic() - t0
            self.phases.append(Phase(name=name, seconds=secs))
            self.finished(name, secs, ok)

    def seconds(self, name: str) -> float:
        """Seconds recorded for phase ``name`` (summed if it ran more than once)."""
        return sum(p.seconds for p in self.phases if p.name == name)

    # hooks for subclasses
    def started(self, name: str, desc: str) -> None:  # pragma: no cover - display only
        pass

    def finished(self, name: str, seconds: float, ok: bool) -> None:  # pragma: no cover
        pass

    def info(self, msg: str) -> None:  # pragma: no cover - display only
        pass

    def warn(self, msg: str, severe: bool = False) -> None:
        """A line the operator should notice (``severe``: a security warning, e.g. an
        unverified signature); plain text. By default reported as :meth:`info`."""
        self.info(msg)

    def bytes_progress(self, desc: str, total: int) -> Callable[[int], None]:
        return lambda n: None

    def chosen(self, ref: str, digest: str) -> None:
        """The snapshot ``digest`` (``sha256:...``) was chosen for ``ref`` (``NAME:TAG`` or
        ``NAME@DIGEST``); the line saying so comes through :meth:`info`. Nothing by default."""


class ConsoleReporter(Reporter):
    """Shows phases and messages on stderr.

    On a terminal: a spinner while a phase runs (with a byte count where the phase reports one),
    then ``  ok NAME  SECONDS s``. Not on a terminal (the journal, CI, a pipe): no spinner and no
    byte progress, one line per phase when it ends, ``ok|failed NAME SECONDS s``, and
    messages as they come; nothing is wrapped (:mod:`warmctl.cli.output`).
    """

    def __init__(self, quiet: bool = False) -> None:
        super().__init__()
        self.quiet = quiet
        self._status: Any = None  # rich's Status while a phase runs on a terminal

    @cached_property
    def console(self):
        """The stderr console (:func:`warmctl.base.console.err`), made on first use: a quiet
        reporter (``up --json``) never imports rich."""
        from warmctl.base.console import err

        return err()

    @cached_property
    def live(self) -> bool:
        """stderr is a terminal: spinners and byte progress."""
        return self.console.is_terminal

    def started(self, name: str, desc: str) -> None:
        if not self.quiet and self.live:
            self._status = self.console.status(f"[bold]{_escape(name)}[/] {_escape(desc)}")
            self._status.start()

    def finished(self, name: str, seconds: float, ok: bool) -> None:
        if self._status:
            self._status.stop()
            self._status = None
        if self.quiet:
            return
        if self.live:
            mark = "[green]ok[/]" if ok else "[red]failed[/]"
            self.console.print(f"  {mark} {name:<18} {seconds:8.2f} s")
        else:
            self.console.print(f"{'ok' if ok else 'failed'} {name} {seconds:.2f} s", markup=False, highlight=False)

    def info(self, msg: str) -> None:
        if not self.quiet:
            self.console.print(msg, markup=False, highlight=False)

    def warn(self, msg: str, severe: bool = False) -> None:
        if not self.quiet:
            self.console.print(msg, style="bold red" if severe else "yellow", markup=False, highlight=False)

    def bytes_progress(self, desc: str, total: int) -> Callable[[int], None]:
        if self.quiet or self._status is None:
            return lambda n: None
        done = [0]
        status = self._status

        def advance(n: int) -> None:
            done[0] += n
            pct = 100.0 * done[0] / total if total else 100.0
            status.update(f"[bold]{_escape(desc)}[/] {done[0] / 2**20:,.0f} / {total / 2**20:,.0f} MiB ({pct:.0f}%)")

        return advance


def _escape(text: str) -> str:
    """``text`` shown as it is inside console markup (rich's escaping: ``[`` of a tag-like run)."""
    from rich.markup import escape

    return escape(text)
