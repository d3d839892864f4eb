"""Starting the gate process with a :class:`~warmctl.gate.config.GateConfig`.

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

from warmctl.base.errors import HostError
from warmctl.gate.config import GateConfig
from warmctl.gate.lazy import LazyWatch
from warmctl.base.proc import kill_child


def start(listen_host: str, listen_port: int, upstream_port: int, engine_pid: int, log_path: Path,
          timeout_s: float = 15.0, config: GateConfig | None = None) -> int:
    """Start the gate as a detached process; return its PID once it accepts connections.
    ``config``: what it enforces (:meth:`GateConfig.check` it first; None: the defaults).

    Raises :class:`HostError` (with the gate's own message) if it cannot listen.
    """
    log_path = Path(log_path)
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmctl.gate", "--listen", f"{listen_host}:{listen_port}",
             "--upstream", f"127.0.0.1:{upstream_port}", "--engine-pid", str(engine_pid),
             *(config or GateConfig()).to_argv()],
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
        self.opened = False  # True once open() returned: it listens

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
            self.opened = True
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
        """Stop the gate before it ever listened (``up`` failed). Once :meth:`open` returned it
        listens in front of the engine and is the engine run's to stop: nothing is done."""
        if self.opened:
            return
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
             config: GateConfig | None = None) -> PendingGate:
    """Start a gate for ``listen_host:listen_port`` -> ``127.0.0.1:upstream_port`` that waits,
    not listening, for :meth:`PendingGate.open` (see :class:`PendingGate`). ``config``: what
    it enforces (:meth:`GateConfig.check` it first; None: the defaults)."""
    log_path = Path(log_path)
    offset = log_path.stat().st_size if log_path.exists() else 0
    ready_r, ready_w = os.pipe()
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "warmctl.gate", "--listen", f"{listen_host}:{listen_port}",
                 "--upstream", f"127.0.0.1:{upstream_port}", "--wait-open", "--ready-fd", str(ready_w),
                 *(config or GateConfig()).to_argv()],
                stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True, pass_fds=(ready_w,))
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    return PendingGate(proc, ready_r, f"{listen_host}:{listen_port}", log_path, offset)
