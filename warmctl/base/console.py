"""Consoles for people and for logs: the rules every rich console warmctl makes follows.

A stream is a terminal when ``isatty()`` says so; off a terminal (systemd's journal, CI, a pipe)
nothing is hard-wrapped (``soft_wrap``); with ``NO_COLOR`` (https://no-color.org: set and not
empty) no colours and no other text styles, on a terminal too. Consoles are made per call, so
redirections and ``COLUMNS`` set later apply, and rich is imported only when one is made. The
CLI's output rules built on these (tables, ``--json``): :mod:`warmctl.cli.output`; the
terminal reporter of the pipelines' phases: :class:`warmctl.records.progress.ConsoleReporter`.
"""

from __future__ import annotations

import os
import sys
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


def is_terminal(stream: IO[str] | None) -> bool:
    """Whether ``stream`` is an interactive terminal (False for None or a closed stream)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def no_color() -> bool:
    """``NO_COLOR`` is set to a non-empty value (https://no-color.org)."""
    return bool(os.environ.get("NO_COLOR"))


def console(stderr: bool = False, **kwargs: Any) -> Console:
    """A rich console on stdout (or stderr) that follows the rules above: on a non-terminal,
    ``soft_wrap`` (no hard line breaks); with NO_COLOR, no styles at all. ``kwargs`` go to
    :class:`rich.console.Console` (they win)."""
    stream = sys.stderr if stderr else sys.stdout
    opts: dict[str, Any] = {"stderr": stderr}
    if not is_terminal(stream):
        opts["soft_wrap"] = True
    if no_color():
        opts["color_system"] = None
        opts["no_color"] = True
    opts.update(kwargs)
    from rich.console import Console

    return Console(**opts)


def out(**kwargs: Any) -> Console:
    """:func:`console` on stdout."""
    return console(False, **kwargs)


def err(**kwargs: Any) -> Console:
    """:func:`console` on stderr."""
    return console(True, **kwargs)
