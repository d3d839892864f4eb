"""The ``warmctl`` command line: a thin typer layer over the library.

Each area registers its commands from its own module (``core``: snapshot/up/down/status/ls;
``store``: push/pull/verify/gc/du; ``catalog``: host/catalog/keygen/config; ``profiles``:
profile ls/show/check/command/diff; ``keys``: keys ls/trust/rm; ``bench``;
``agent``; ``kube``: prewarm). Expected failures (:class:`warmctl.base.errors.WarmctlError`) print one clear message
to stderr and exit non-zero; nothing else is caught. How output looks on terminals and in logs
(no hard wrapping off a terminal, NO_COLOR, ``--json``): :mod:`warmctl.cli.output`.
"""

from __future__ import annotations

import gc
import os
import sys

from warmctl.base.errors import WarmctlError

# typer (and its click) imported without the cyclic garbage collector, as main() runs the rest of
# the start-up (see started()); the collector's state is as it was once the import is done
_collecting = gc.isenabled()
gc.disable()
try:
    import typer
finally:
    if _collecting:
        gc.enable()

app = typer.Typer(
    name="warmctl",
    help=(
        "Snapshot a warmed LLM inference engine once; restore it in seconds.\n\n"
        "Typical use: `warmctl snapshot tiny` (cold start, warm-up, canary, CRIU dump into the "
        "store), then `warmctl up tiny` (restore, canary bit for bit, open port 8000)."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _register(command: str | None = None) -> None:
    """Register every area's commands on :data:`app`, ``core``'s first. With ``command``, the
    name a command line starts with: when ``core`` registered a top-level command of that name
    (``up``, ``down``, ``status``, ...), the other areas are neither imported nor registered
    (:func:`_click_command` builds that command alone either way; their seven modules and
    registrations were ~2.5 ms of every ``warmctl up`` on the 2-vCPU development hosts)."""
    from warmctl.cli import core

    core.register(app)
    if command is not None and command in _command_names():
        return
    from warmctl.cli import agent, bench, catalog, keys, kube, profiles, store

    for mod in (store, catalog, keys, profiles, bench, agent, kube):
        mod.register(app)


def _command_names() -> list[str]:
    """The names of the top-level commands registered on :data:`app` so far (groups aside), in
    the order registered."""
    import typer.main

    return [c.name or typer.main.get_command_name(c.callback.__name__)  # type: ignore[union-attr]
            for c in app.registered_commands]


def main() -> None:
    """Console-script entry point.

    Sets ``PYDANTIC_DISABLE_PLUGINS=__all__`` unless the environment sets it (warmctl uses no
    pydantic plugin; typer sets the same while it builds its parameters): pydantic otherwise
    searches every installed distribution's entry points for plugins when it builds the first
    model, 6-7 ms of CPU of every command on the development hosts, more beside a large engine
    environment. The gate's process inherits it; the engine does not (its environment is
    declared, :func:`warmctl.engine.vllm.engine_environment`)."""
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    global _gc_paused
    if gc.isenabled():  # until started(): see there
        gc.disable()
        _gc_paused = True
    from warmctl.cli.output import err, plain_usage_errors

    complete = "_WARMCTL_COMPLETE" in os.environ  # shell completion: the whole tree
    _register(None if complete or not sys.argv[1:] else sys.argv[1])
    plain_usage_errors()
    try:
        command = _click_command(sys.argv[1:])
        if not sys.argv[1:] or sys.argv[1] not in STARTS_ITSELF:
            started()
        command()
    except WarmctlError as e:
        from rich.markup import escape

        # soft_wrap: one line however long (no wrapping at the terminal's or 80 columns)
        err().print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        _exit(e.exit_code)
    except SystemExit as e:  # how click ends every command, successful or not
        _exit(e.code)
    _exit(0)


#: Commands that call :func:`started` themselves, once they have imported what they run (the
#: others start when :func:`main` calls them).
STARTS_ITSELF = ("up",)
#: :func:`main` turned the collector off and :func:`started` has not turned it on yet
_gc_paused = False


def started() -> None:
    """The end of the process's start-up: the cyclic garbage collector, which :func:`main`
    turned off for the start-up, runs again, and what the start-up made (modules, classes,
    functions, models: hardly ever garbage) is moved out of its reach for good
    (:func:`gc.freeze`). Without this, the collector walked the growing heap ~90 times while
    ``warmctl up`` imported its path, about 15 ms of CPU on the 2-vCPU development hosts
    (``benchmarks/up_imports.py``), and every later full collection walked it again. A command
    of :data:`STARTS_ITSELF` calls it once its imports are done (``up``: the pipeline, before
    it runs); :func:`main` calls it before any other command runs. Calling it again, or where
    :func:`main` did not turn the collector off (tests, the library), changes nothing."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


def _click_command(argv: list[str]):
    """The click command that runs ``warmctl ARGV``: the whole command tree, or, when ``ARGV``
    starts with the name of a top-level command (``up``, ``down``, ``status``, ...; not a
    group such as ``store``), a root group holding that command alone. Building every
    command's click object took ~15 ms of each ``warmctl up`` on the 2-vCPU development hosts
    (``benchmarks/up_imports.py``); the command's options, help and errors are the same either
    way. Shell completion (``_WARMCTL_COMPLETE`` set) always gets the whole tree."""
    import typer.main

    name = argv[0] if argv else ""
    matches = [c for c, n in zip(app.registered_commands, _command_names()) if n == name]
    if len(matches) != 1 or "_WARMCTL_COMPLETE" in os.environ:
        return typer.main.get_command(app)
    commands, groups = app.registered_commands, app.registered_groups
    app.registered_commands, app.registered_groups = matches, []
    try:
        return typer.main.get_group(app)  # a group even with one command: `warmctl up NAME` as ever
    finally:
        app.registered_commands, app.registered_groups = commands, groups


def _exit(code: int | str | None) -> None:
    """End the process as the interpreter would, minus its teardown of every module and object:
    that teardown took 0.3-0.4 s after each ``warmctl up`` on the 2-core development host,
    and this process keeps nothing that needs it. What an orderly exit owes is
    done first: non-daemon threads are joined, ``atexit`` handlers run, stdout and stderr are
    flushed. ``code`` as for :class:`SystemExit` (None = 0; a string is printed, exit 1)."""
    import atexit
    import os
    import threading

    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)
