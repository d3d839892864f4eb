"""One engine run on this host: its paths, its processes, its ``/dev/shm`` files, one teardown.

An :class:`EngineRun` is what ``snapshot``, ``up`` (restore or cold), ``down`` and the agent's
recovery hold while an engine exists; everything that can leave a process or a file behind is
recorded on it, and :meth:`EngineRun.teardown` is the only place that removes them again.

Paths (resolved once, from ``<home>/run/NAME``)::

    <run>/engine.log    the engine's stdout+stderr (a restore uses the path the snapshot recorded)
    <run>/images/       CRIU image directory (dump target; materialized before a restore)
    <run>/weights/      rank weight files kept outside the image (``checkpoint.weights_outside_image``)
    <run>/shm/          copies of CRIU's ``link_remap.N`` files taken out of ``/dev/shm`` at dump
    <run>/engine.pid    the root PID ``criu restore --pidfile`` writes
    <run>/restore.log   CRIU's restore log
    <run>/gate.log      the gate's output
    <run>/state.json    the persisted record (:mod:`warmctl.state`), while the run is recorded

Processes are held as :class:`warmctl.proc.ProcessId` (PID + creation time), so a teardown
never signals a process that merely reuses a recorded PID.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from warmctl.checkpoint import capture
from warmctl.proc import ProcessId, kill_tree, pid_alive
from warmctl.state import EngineState
from warmctl.state import load as load_state
from warmctl.state import remove as remove_state
from warmctl.state import save as save_state


@dataclass
class TeardownReport:
    """What :meth:`EngineRun.teardown` removed: host PIDs of the trees it killed (gate
    included), ``/dev/shm`` paths it unlinked, and whether a scratch directory (images, weights)
    was left to remove."""

    killed: list[int] = field(default_factory=list)
    removed_shm: list[str] = field(default_factory=list)
    removed_scratch: bool = False


class EngineRun:
    """One engine of this host (see the module doc).

    ``run_dir``: ``<home>/run``; ``name``: the engine's name; ``internal_port``: the engine's
    loopback port. ``log_path`` / ``cwd`` default to ``<run>/engine.log`` and ``<run>``; a
    restore passes those the snapshot recorded (CRIU reopens them at the same paths).
    ``root`` / ``gate``: the engine tree's root process (its PID namespace's PID 1) and the gate,
    once they exist. ``shm_files`` / ``shm_inodes``: ``/dev/shm`` files of the run (by name; by
    (st_dev, st_ino) where known, and then removed by inode only). ``state``: the persisted
    record while the run is recorded (:meth:`record`, :meth:`load`).
    """

    def __init__(self, run_dir: Path, name: str, internal_port: int, *, log_path: Path | str | None = None,
                 cwd: Path | str | None = None, started_at: float | None = None):
        self.run_dir = Path(run_dir)
        self.name = name
        self.dir = self.run_dir / name
        self.internal_port = internal_port
        self.log_path = Path(log_path) if log_path else self.dir / "engine.log"
        self.cwd = Path(cwd) if cwd else self.dir
        self.images = self.dir / "images"
        self.weights = self.dir / "weights"
        self.shm_copies = self.dir / "shm"
        self.pidfile = self.dir / "engine.pid"
        self.restore_log = self.dir / "restore.log"
        self.gate_log = self.dir / "gate.log"
        self.root: ProcessId | None = None
        self.gate: ProcessId | None = None
        self.shm_files: list[str] = []
        self.shm_inodes: list[tuple[int, int]] = []
        self.started_at = started_at if started_at is not None else time.time()
        self.state: EngineState | None = None

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def of_state(cls, run_dir: Path, st: EngineState) -> "EngineRun":
        """The run a persisted record describes (identities, ``/dev/shm`` files, paths)."""
        run = cls(run_dir, st.name, st.internal_port, log_path=st.log_path or None,
                  started_at=st.started_at or None)
        run.root, run.gate = st.root, st.gate
        run.shm_files, run.shm_inodes = list(st.shm_files), [tuple(x) for x in st.shm_inodes]
        run.state = st
        return run

    @classmethod
    def load(cls, run_dir: Path, name: str) -> "EngineRun | None":
        """The run recorded in ``<run_dir>/NAME/state.json``, or None if there is none."""
        st = load_state(run_dir, name)
        return None if st is None else cls.of_state(run_dir, st)

    def prepare(self) -> "EngineRun":
        """Create the run directory, the log's directory and the working directory; returns self."""
        for d in (self.dir, self.log_path.parent, self.cwd):
            d.mkdir(parents=True, exist_ok=True)
        return self

    # --- processes ------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<internal_port>``: the engine's own HTTP server."""
        return f"http://127.0.0.1:{self.internal_port}"

    @property
    def root_pid(self) -> int:
        """Host PID of the tree's root. Raises RuntimeError before the root is known."""
        if self.root is None:
            raise RuntimeError(f"engine {self.name}: no root process recorded yet")
        return self.root.pid

    def set_root(self, pid: int) -> None:
        """Record ``pid`` (now alive) as the tree's root, with its creation time."""
        self.root = ProcessId.of(pid) or ProcessId(pid, 0.0)

    def set_gate(self, pid: int) -> None:
        """Record ``pid`` (now alive) as the gate, with its creation time."""
        self.gate = ProcessId.of(pid) or ProcessId(pid, 0.0)

    def alive(self) -> bool:
        """True while the recorded root is alive and still the same process."""
        return self.root is not None and self.root.alive()

    # --- the persisted record -------------------------------------------------------------

    def record(self, st: EngineState) -> None:
        """Persist ``st`` as this run's record (``<run>/state.json``) and keep it in sync from
        now on: every :meth:`save` writes the run's identities and ``/dev/shm`` files into it."""
        self.state = st
        self.save()

    def save(self, phase: str | None = None) -> None:
        """Write the record (with ``phase``, when given). No-op for an unrecorded run."""
        st = self.state
        if st is None:
            return
        if phase is not None:
            st.phase = phase  # type: ignore[assignment]
        st.root_pid, st.root_ctime = (self.root.pid, self.root.ctime) if self.root else (None, None)
        st.gate_pid, st.gate_ctime = (self.gate.pid, self.gate.ctime) if self.gate else (None, None)
        st.shm_files, st.shm_inodes = list(self.shm_files), [tuple(x) for x in self.shm_inodes]
        st.started_at = self.started_at
        save_state(self.run_dir, st)

    # --- teardown -------------------------------------------------------------------------

    def remove_scratch(self) -> bool:
        """Remove the scratch directories (images, weights, shm copies); True if there was one."""
        found = False
        for d in (self.images, self.weights, self.shm_copies):
            if d.exists():
                found = True
                shutil.rmtree(d, ignore_errors=True)
        return found

    def teardown(self, *, strays: bool = False) -> TeardownReport:
        """Stop everything of this run and remove what it left; safe to call more than once.

        In order: the gate's tree; the engine's tree (its ``/dev/shm`` files and the inodes of
        the semaphores it maps under removed names are listed first); with ``strays`` (agent
        recovery, where the record may lag behind), also the tree whose PID CRIU wrote to
        ``engine.pid`` and every process whose working directory is the run directory; then the
        recorded ``/dev/shm`` files (by inode where known: CRIU consumed the ``link_remap.N``
        names at restore, and another restore on this host may have written the same names
        since), multiprocessing semaphores orphaned since the run started
        (:func:`warmctl.checkpoint.capture.orphaned_shm`), the scratch directories and the
        record. Identities are checked before any signal: a PID that now belongs to another
        process is left alone.
        """
        rep = TeardownReport()
        if kill_tree(self.gate, timeout_s=5):
            rep.killed.append(self.gate.pid)  # type: ignore[union-attr]
        live_shm: list[Path] = []
        live_inodes: set[tuple[int, int]] = set()
        if self.alive():
            live_shm = capture.referenced_files(self.root.pid).shm  # type: ignore[union-attr]
            live_inodes = capture.shm_inodes_of(self.root.pid)  # type: ignore[union-attr]
            if kill_tree(self.root):
                rep.killed.append(self.root.pid)  # type: ignore[union-attr]
        if strays:
            rep.killed += self._kill_strays(set(rep.killed))
        for p in live_shm:
            if p.exists():
                p.unlink(missing_ok=True)
                rep.removed_shm.append(str(p))
        for f in ([] if self.shm_inodes else self.shm_files):
            if Path(f).exists():
                Path(f).unlink(missing_ok=True)
                rep.removed_shm.append(f)
        rep.removed_shm += [str(p) for p in capture.remove_by_inode(live_inodes | set(self.shm_inodes))]
        for p in capture.orphaned_shm(self.started_at - 1):
            p.unlink(missing_ok=True)
            rep.removed_shm.append(str(p))
        rep.removed_scratch = self.remove_scratch()
        if self.state is not None:
            remove_state(self.run_dir, self.name)
            self.state = None
        return rep

    def _kill_strays(self, done: set[int]) -> list[int]:
        """Trees the record may not name (see :meth:`teardown`); returns the PIDs killed."""
        import os

        import psutil

        killed: list[int] = []
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            pid = 0
        if pid and pid not in done and pid_alive(pid):
            kill_tree(pid)
            killed.append(pid)
        me = os.getpid()
        d = self.dir.resolve() if self.dir.exists() else self.dir
        for p in psutil.process_iter():
            try:
                if p.pid in done or p.pid in killed or p.pid == me or Path(p.cwd()) != d:
                    continue
            except (psutil.Error, OSError):
                continue
            kill_tree(p.pid)
            killed.append(p.pid)
        return killed
