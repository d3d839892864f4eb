"""Starting the gate process, and the options ``up`` gives it.

``warmctl up`` starts the gate beside the restore (:func:`prestart`: its interpreter start-up
overlaps the restore) and tells it to listen only once the canary passed
(:meth:`PendingGate.open`); :func:`start` starts one that listens at once. The gate runs as
``python -m warmctl.gate`` (:mod:`warmctl.gate.__main__`), detached, logging to ``gate.log``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from warmctl.errors import HostError
from warmctl.gate.files import GateConfigError, read_keys, tls_context
from warmctl.gate.lazy import LazyWatch
from warmctl.proc import kill_child


def policy_args(api_key_file: Path | None = None, tls_cert: Path | None = None, tls_key: Path | None = None,
                public_paths: list[str] | None = None, deny_paths: list[str] | None = None,
                drain_s: float | None = None, allow_paths: list[str] | None = None,
                limits: dict[str, float] | None = None) -> list[str]:
    """The gate's command-line options for these settings (file paths only: a key never
    appears on a command line). ``allow_paths``: served beside the default allow list
    (:data:`warmctl.gate.routes.DEFAULT_ALLOW_PATHS`); ``limits``: fields of
    :class:`warmctl.gate.server.Limits` (seconds, bytes/s). Raises :class:`GateConfigError`
    naming the file if the key file or the certificate pair cannot be loaded, or naming the
    path if an allowed, public or denied path is malformed, so ``up`` fails before it restores."""
    from warmctl.gate.routes import check_route_path

    for what, paths in (("gate_allow_paths", allow_paths), ("gate_public_paths", public_paths),
                        ("gate_deny_paths", deny_paths)):
        for p in paths or ():
            try:
                check_route_path(p, what)
            except ValueError as e:
                raise GateConfigError(str(e)) from None
    args: list[str] = []
    if api_key_file is not None:
        read_keys(api_key_file)
        args += ["--api-key-file", str(Path(api_key_file).absolute())]
    if (tls_cert is None) != (tls_key is None):
        raise GateConfigError("TLS needs both a certificate file and a private-key file (gate_tls_cert, gate_tls_key)")
    if tls_cert is not None:
        tls_context(tls_cert, tls_key)
        args += ["--tls-cert", str(Path(tls_cert).absolute()), "--tls-key", str(Path(tls_key).absolute())]
    for p in public_paths if public_paths is not None else ():
        args += ["--public-path", p]
    if public_paths is not None and not public_paths:
        args += ["--no-public-paths"]
    for p in deny_paths or ():
        args += ["--deny-path", p]
    for p in allow_paths or ():
        args += ["--allow-path", p]
    if drain_s is not None:
        args += ["--drain-s", f"{drain_s:g}"]
    for k, v in (limits or {}).items():
        args += [f"--{k.replace('_', '-')}", f"{v:g}"]
    return args


def settings_args(settings) -> list[str]:
    """:func:`policy_args` of a :class:`warmctl.config.Settings` (``gate_*`` fields)."""
    return policy_args(settings.gate_api_key_file, settings.gate_tls_cert, settings.gate_tls_key,
                       list(settings.gate_public_paths), list(settings.gate_deny_paths), settings.gate_drain_s,
                       list(settings.gate_allow_paths))


def gate_enforces(args: list[str]) -> dict[str, bool]:
    """What a gate started with ``args`` (:func:`policy_args`) enforces, as
    :class:`warmctl.state.EngineState` fields: ``gate_api_key``, ``gate_tls``."""
    return {"gate_api_key": "--api-key-file" in args, "gate_tls": "--tls-cert" in args}


def start(listen_host: str, listen_port: int, upstream_port: int, engine_pid: int, log_path: Path,
          timeout_s: float = 15.0, args: list[str] | tuple[str, ...] = ()) -> int:
    """Start the gate as a detached process; return its PID once it accepts connections.
    ``args``: further gate options (:func:`policy_args`).

    Raises :class:`HostError` (with the gate's own message) if it cannot listen.
    """
    log_path = Path(log_path)
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmctl.gate", "--listen", f"{listen_host}:{listen_port}",
             "--upstream", f"127.0.0.1:{upstream_port}", "--engine-pid", str(engine_pid), *args],
            stdin=devnull, stdout=log, stderr=log, start_new_session=True)

    def output() -> str:
        with open(log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "ready" in output().split():  # printed by the gate once its socket is listening
            return proc.pid
        if proc.poll() is not None:
            msg = output().strip().splitlines()[-1:] or ["(no output)"]
            raise HostError(f"the gate could not open {listen_host}:{listen_port}: {msg[0]}")
        time.sleep(0.05)
    kill_child(proc)
    raise HostError(f"the gate did not open {listen_host}:{listen_port} within {timeout_s:.0f} s")


class PendingGate:
    """A gate process started ahead of time (:func:`prestart`) that does not listen until
    :meth:`open`: its interpreter start-up and imports (~0.2-0.9 s on a loaded 2-core host)
    overlap the restore instead of delaying the public port after the canary.
    It holds no socket before :meth:`open`, and exits without ever listening if the process
    that started it closes its stdin (exits, or calls :meth:`cancel`)."""

    def __init__(self, proc: subprocess.Popen, ready_r: int, listen: str, log_path: Path, offset: int):
        self.proc, self.listen, self.log_path, self._offset = proc, listen, log_path, offset
        self._ready_r: int | None = ready_r

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _output(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def open(self, engine_pid: int, timeout_s: float = 15.0, lazy: LazyWatch | None = None) -> int:
        """Tell the gate to listen in front of ``engine_pid``; return its PID once it accepts
        connections. ``lazy``: the engine was restored with lazy pages; the gate watches the
        daemon from now on (see :class:`LazyWatch`). Raises :class:`HostError` (with the
        gate's own message) if it cannot listen, :class:`warmctl.checkpoint.criu.LazyPagesError`
        if it refused because the daemon had already exited before its copy ended."""
        import select

        try:
            extra = f" {lazy.to_json()}" if lazy is not None else ""
            self.proc.stdin.write(f"open {engine_pid}{extra}\n".encode())
            self.proc.stdin.close()
        except OSError:
            pass  # it died already: reported below
        try:
            ready, _, _ = select.select([self._ready_r], [], [], timeout_s)
            data = os.read(self._ready_r, 4096) if ready else b""
        finally:
            self._close_pipe()
        if b"ready" in data:
            return self.proc.pid
        kill_child(self.proc)
        if data.startswith(b"refused lazy-pages "):
            from warmctl.checkpoint.criu import LazyPagesError

            raise LazyPagesError(f"the lazy-pages daemon exited before it had copied every page into the engine: "
                                 f"{data[len(b'refused lazy-pages '):].decode(errors='replace').strip()}; "
                                 "the public port was not opened")
        msg = self._output().strip().splitlines()[-1:] or [f"no answer within {timeout_s:.0f} s"]
        raise HostError(f"the gate could not open {self.listen}: {msg[0]}")

    def cancel(self) -> None:
        """Stop the gate before it ever listened (``up`` failed)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()  # EOF: it exits on its own
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            kill_child(self.proc)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self._ready_r is not None:  # once: the number may be reused by another file later
            os.close(self._ready_r)
            self._ready_r = None


def prestart(listen_host: str, listen_port: int, upstream_port: int, log_path: Path,
             args: list[str] | tuple[str, ...] = ()) -> PendingGate:
    """Start a gate for ``listen_host:listen_port`` -> ``127.0.0.1:upstream_port`` that waits,
    not listening, for :meth:`PendingGate.open` (see :class:`PendingGate`). ``args``: further
    gate options (:func:`policy_args`)."""
    log_path = Path(log_path)
    offset = log_path.stat().st_size if log_path.exists() else 0
    ready_r, ready_w = os.pipe()
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "warmctl.gate", "--listen", f"{listen_host}:{listen_port}",
                 "--upstream", f"127.0.0.1:{upstream_port}", "--wait-open", "--ready-fd", str(ready_w), *args],
                stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True, pass_fds=(ready_w,))
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    return PendingGate(proc, ready_r, f"{listen_host}:{listen_port}", log_path, offset)
