"""One engine run on this host: its paths, its processes, its ``/dev/shm`` files, one teardown.

An :class:`EngineRun` is what ``snapshot``, ``up`` (restore or cold), ``down`` and the agent's
recovery hold while an engine exists; everything that can leave a process or a file behind is
recorded on it, and :meth:`EngineRun.teardown` is the only place that removes them again.

Paths (resolved once, from ``<home>/run/NAME``)::

    <run>/engine.log    the engine's stdout+stderr (a restore uses the path the snapshot recorded)
    <run>/images/       CRIU image directory (dump target; materialized before a restore)
    <run>/weights/      rank weight files kept outside the image (``checkpoint.weights_outside_image``)
    <run>/shm/          copies of CRIU's ``link_remap.N`` files taken out of ``/dev/shm`` at dump
    <run>/unkept-image/ an image restored from but not kept (larger than ``image_cache_bytes``, or
                        0): removed after the restore, or by the teardown when a lazy restore's
                        daemon still reads it (:mod:`warmctl.checkpoint.imagecache`)
    <run>/tmp/          the engine's own scratch directory: ``VLLM_RPC_BASE_PATH``, where vLLM binds
                        its ZMQ IPC sockets (``<uuid>`` files that outlive a killed tree; a run
                        directory too deep for socket paths gets one in the temp dir, see
                        :func:`socket_dir`); a restore uses the directory the snapshot recorded
                        (CRIU binds the sockets at the same paths); the teardown removes the
                        sockets and the directory
    <run>/engine.pid    the root's identity (JSON: pid, start, boot, ctime, exe, cmdline), written the moment
                        the root is known (:meth:`EngineRun.set_root`), removed by the teardown
    <run>/restore.pid   the bare root PID ``criu restore --pidfile`` writes; removed once
                        ``engine.pid`` holds the root's identity (:meth:`EngineRun.adopt_restored`)
    <run>/restore.log   CRIU's restore log
    <run>/lazy-pages.pid     the lazy-pages daemon's identity (JSON, as engine.pid), lazy restores only
    <run>/lazy-pages.log     its log (``-v4``: the per-process copy summaries the gate checks)
    <run>/lazy-pages.failed  why the gate took the engine down (the daemon exited before its copy ended)
    <run>/gate.log      the gate's output
    <run>/state.json    the persisted record (:mod:`warmctl.records.state`), while the run is recorded

Processes are held as :class:`warmctl.base.proc.ProcessId` (PID, start time, executable), so a
teardown never signals a process that merely reuses a recorded PID.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from warmctl.checkpoint import capture, criu
from warmctl.base.private import private_dir, trusted, untrusted, write_private
from warmctl.base.proc import ProcessId, Stamp, created_during, freeze_tree, kill_tree, owned_by_me
from warmctl.records.state import EngineState
from warmctl.records.state import load as load_state
from warmctl.records.state import remove as remove_state
from warmctl.records.state import save as save_state


@dataclass
class TeardownReport:
    """What :meth:`EngineRun.teardown` removed: host PIDs of the trees it killed (gate
    included), ``/dev/shm`` paths it unlinked, and whether a scratch directory (images, weights)
    was left to remove."""

    killed: list[int] = field(default_factory=list)
    removed_shm: list[str] = field(default_factory=list)
    removed_scratch: bool = False
    #: the engine's sockets directory and the sockets in it that were removed (:meth:`EngineRun.remove_tmp`)
    removed_tmp: list[str] = field(default_factory=list)
    #: what the teardown found but left alone, and why (an identity that did not match, a
    #: record it did not write, a recorded path outside ``/dev/shm``)
    refused: list[str] = field(default_factory=list)


#: In a run directory: why the gate took the engine down (its lazy-pages daemon exited before
#: its copy ended), read by ``warmctl status``.
LAZY_FAILED = "lazy-pages.failed"


class EngineRun:
    """One engine of this host (see the module doc).

    ``run_dir``: ``<home>/run``; ``name``: the engine's name; ``internal_port``: the engine's
    loopback port. ``log_path`` / ``cwd`` default to ``<run>/engine.log`` and ``<run>``; a
    restore passes those the snapshot recorded (CRIU reopens them at the same paths).
    ``tmp_dir``: the engine's scratch directory (``VLLM_RPC_BASE_PATH``): True (default)
    ``<run>/tmp`` (:func:`socket_dir`), a path (what a snapshot recorded), or False/None for
    none (a snapshot or record written before warmctl gave engines one: their sockets are in
    the host's temp directory).
    ``root`` / ``gate``: the engine tree's root process (its PID namespace's PID 1) and the gate,
    once they exist. ``shm_files`` / ``shm_inodes``: ``/dev/shm`` files of the run (by name; by
    (st_dev, st_ino) where known, and then removed by inode only). ``state``: the persisted
    record while the run is recorded (:meth:`record`, :meth:`load`).
    """

    def __init__(self, run_dir: Path, name: str, internal_port: int, *, log_path: Path | str | None = None,
                 cwd: Path | str | None = None, since: Stamp | None = None,
                 tmp_dir: Path | str | None | bool = True):
        self.run_dir = Path(run_dir)
        self.name = name
        self.dir = self.run_dir / name
        self.internal_port = internal_port
        self.log_path = Path(log_path) if log_path else self.dir / "engine.log"
        self.cwd = Path(cwd) if cwd else self.dir
        self.images = self.dir / "images"
        self.weights = self.dir / "weights"
        self.shm_copies = self.dir / "shm"
        #: an image restored from but not kept (warmctl.checkpoint.imagecache: over the budget)
        self.unkept_image = self.dir / "unkept-image"
        self.tmp: Path | None = (socket_dir(self.dir) if tmp_dir is True else Path(tmp_dir) if tmp_dir else None)
        self.pidfile = self.dir / "engine.pid"
        self.criu_pidfile = self.dir / "restore.pid"
        self.restore_log = self.dir / "restore.log"
        self.gate_log = self.dir / "gate.log"
        self.lazy_pidfile = self.dir / "lazy-pages.pid"
        self.lazy_log = self.dir / "lazy-pages.log"
        self.lazy_failed = self.dir / LAZY_FAILED
        #: the lazy-pages daemon of a lazy restore (:func:`warmctl.checkpoint.criu.lazy_restore`)
        self.lazy: ProcessId | None = None
        self.root: ProcessId | None = None
        self.gate: ProcessId | None = None
        self.shm_files: list[str] = []
        self.shm_inodes: list[tuple[int, int]] = []
        #: when the run began (wall and boot clock): the reference for "started after the record"
        self.since = since or Stamp.now()
        self.started_at = self.since.wall
        self.state: EngineState | None = None
        #: the engine's environment by name (variable -> source), set by a cold start
        #: (:func:`warmctl.engine.cold.start`) for the manifest; never values
        self.engine_env: dict[str, str] = {}

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def of_state(cls, run_dir: Path, st: EngineState) -> "EngineRun":
        """The run a persisted record describes (identities, ``/dev/shm`` files, paths)."""
        run = cls(run_dir, st.name, st.internal_port, log_path=st.log_path or None,
                  since=st.since if st.started_at else None, tmp_dir=st.tmp_dir)
        run.root, run.gate, run.lazy = st.root, st.gate, st.lazy
        run.shm_files, run.shm_inodes = list(st.shm_files), [tuple(x) for x in st.shm_inodes]
        run.state = st
        return run

    @classmethod
    def load(cls, run_dir: Path, name: str) -> "EngineRun | None":
        """The run recorded in ``<run_dir>/NAME/state.json``, or None if there is none."""
        st = load_state(run_dir, name)
        return None if st is None else cls.of_state(run_dir, st)

    def prepare(self) -> "EngineRun":
        """Create the run directory (0700, as ``<home>/run``), the log's directory, the
        working directory and the scratch directory (0700); returns self. The log's directory
        and the working directory a restore passes are where the publisher's engine had them,
        its run directory, which a snapshot's own cold start made 0700 and CRIU reopens with
        that mode checked (``bad mode 040755 (expect 040700)`` otherwise). So one missing
        here (a node that never had the publisher's home) is made 0700 too; one that exists
        is left as it is."""
        private_dir(self.run_dir)
        private_dir(self.dir)
        for d in (self.log_path.parent, self.cwd):
            if not d.exists():
                private_dir(d)
        if self.tmp is not None:
            private_dir(self.tmp)
        return self

    @property
    def tmp_env(self) -> dict[str, str]:
        """What the engine's environment needs from its run: ``VLLM_RPC_BASE_PATH`` (its ZMQ IPC
        sockets in :attr:`tmp`, not the host's temp directory). TMPDIR is left alone: torch's
        compile cache lives under it and is shared between cold starts on purpose."""
        return {} if self.tmp is None else {"VLLM_RPC_BASE_PATH": str(self.tmp)}

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
        """Record ``pid`` (now alive) as the tree's root with its identity (start time,
        executable, argv): at once in ``<run>/engine.pid`` (0600), and in the record when
        the run is recorded. A PID already gone is recorded with no start and creation time 0
        (matches nothing, so it is never signalled)."""
        self.root = ProcessId.of(pid) or ProcessId(pid, 0.0)
        private_dir(self.dir)
        write_private(self.pidfile, json.dumps(self.root.as_record()))
        self.save()

    def adopt_restored(self, pid: int) -> None:
        """After ``criu restore --pidfile <run>/restore.pid``: record ``pid`` as the root
        (:meth:`set_root`), then remove CRIU's bare PID file."""
        self.set_root(pid)
        self.criu_pidfile.unlink(missing_ok=True)

    def set_gate(self, pid: int) -> None:
        """Record ``pid`` (now alive) as the gate, with its identity (and in the record when
        the run is recorded)."""
        self.gate = ProcessId.of(pid) or ProcessId(pid, 0.0)
        self.save()

    def set_lazy(self, ident: ProcessId) -> None:
        """Record the lazy-pages daemon ``ident``: at once in ``<run>/lazy-pages.pid`` (0600)
        and in the record, so a teardown (and the agent's recovery) stops it."""
        self.lazy = ident
        private_dir(self.dir)
        write_private(self.lazy_pidfile, json.dumps(ident.as_record()))
        self.save()

    def alive(self) -> bool:
        """True while the recorded root is alive and still the same process."""
        return self.root is not None and self.root.alive()

    def sample_shm(self) -> int:
        """Add the (st_dev, st_ino) of every ``/dev/shm`` file the live tree maps or holds open
        now (:func:`warmctl.checkpoint.capture.shm_inodes_of`, deleted names included) to
        :attr:`shm_inodes`, keeping those recorded before: a process of the tree that dies
        (a rank killed, the survivors' shutdown) takes the only mapping of its semaphores with
        it, and the teardown still removes them by inode. Called about once a second while
        warmctl waits on a starting engine and during its warm-up; never another tree's files
        (only inodes this tree maps are added). Returns how many were new."""
        if not self.alive():
            return 0
        have = {tuple(x) for x in self.shm_inodes}
        new = sorted(capture.shm_inodes_of(self.root.pid) - have)  # type: ignore[union-attr]
        self.shm_inodes.extend(new)
        return len(new)

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
        st.set_root(self.root)
        st.set_gate(self.gate)
        st.set_lazy(self.lazy)
        st.shm_files, st.shm_inodes = list(self.shm_files), [tuple(x) for x in self.shm_inodes]
        st.tmp_dir = str(self.tmp) if self.tmp is not None else None
        st.started_at, st.started_boot = self.since.wall, self.since.boot
        st.boot_id = self.since.boot_id or st.boot_id
        save_state(self.run_dir, st)

    # --- teardown -------------------------------------------------------------------------

    def remove_scratch(self) -> bool:
        """Remove the scratch directories (images, weights, shm copies); True if there was one.
        Not the engine's :attr:`tmp` (a running engine's sockets are in it): the teardown
        removes that (:meth:`remove_tmp`)."""
        found = False
        if self.dir.is_symlink():  # never through a link: only the run's own directory
            return False
        for d in (self.images, self.weights, self.shm_copies):
            if d.exists() and not d.is_symlink():
                found = True
                shutil.rmtree(d, ignore_errors=True)
        return found

    def remove_tmp(self) -> list[str]:
        """Remove the engine's scratch directory :attr:`tmp`: the Unix socket files in it that
        this user owns and no live socket is bound to (the engine is gone by then; a restore of
        the same snapshot under another home binds the same paths), then the directory if that
        left it empty (it may be a path a snapshot recorded, outside this run's directory:
        nothing but sockets is ever removed from it). Never follows a link. Returns the paths
        removed."""
        removed: list[str] = []
        d = self.tmp
        if d is None or d.is_symlink() or not d.is_dir():
            return removed
        try:
            entries = list(os.scandir(d))
        except OSError:
            return removed
        bound = capture.bound_unix_sockets() if entries else set()
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISSOCK(st.st_mode) and owned_by_me(st) and e.path not in bound:
                Path(e.path).unlink(missing_ok=True)
                removed.append(e.path)
        try:
            d.rmdir()
            removed.append(str(d))
        except OSError:
            pass  # not empty: something else is in it, left alone
        return removed

    def teardown(self, *, strays: bool = False) -> TeardownReport:
        """Stop everything of this run and remove what it left; safe to call more than once.

        In order: the gate's tree; the engine's tree, stopped first (every process SIGSTOPped,
        :func:`warmctl.base.proc.freeze_tree`), then its ``/dev/shm`` files and the inodes of the
        semaphores it maps under removed names listed, then SIGKILLed (no shutdown of its own:
        a shutdown, or the survivors of a dead rank, would make semaphores after the listing
        that nothing records); with ``strays`` (agent
        recovery, where the record may lag behind), also the root named by ``engine.pid``
        (its recorded identity) and the one CRIU wrote to ``restore.pid`` when the record
        was written before that restore and the process was created between the two (see
        :meth:`_kill_strays`); then the recorded ``/dev/shm`` files (only paths directly in
        ``/dev/shm``; by inode where known: CRIU consumed the ``link_remap.N`` names at
        restore, and another restore on this host may have written the same names since),
        multiprocessing semaphores orphaned since the run started
        (:func:`warmctl.checkpoint.capture.orphaned_shm`), the scratch directories, the
        engine's sockets directory (:meth:`remove_tmp`), the PID files and the record. Identities are checked before any signal
        (:func:`warmctl.base.proc.kill_tree`): a PID that now belongs to another process is left
        alone and named in ``refused``; a process is never killed for its working directory.
        """
        rep = TeardownReport()
        if kill_tree(self.gate, timeout_s=5):
            rep.killed.append(self.gate.pid)  # type: ignore[union-attr]
        live_shm: list[Path] = []
        live_inodes: set[tuple[int, int]] = set()
        if self.alive():
            freeze_tree(self.root)  # nothing of the tree makes a file between the listing and the kill
            live_shm = capture.referenced_files(self.root.pid).shm  # type: ignore[union-attr]
            live_inodes = capture.shm_inodes_of(self.root.pid)  # type: ignore[union-attr]
            if kill_tree(self.root, timeout_s=0):
                rep.killed.append(self.root.pid)  # type: ignore[union-attr]
        elif self.root is not None and self.root.ctime and (why := self.root.mismatch()) not in (None, "gone"):
            rep.refused.append(f"engine root: {why}")
        if strays:
            rep.killed += self._kill_strays(set(rep.killed), rep.refused)
        # the lazy-pages daemon last: stopped before the engine, it would leave zero pages in a
        # running engine (the gate, gone already, would have taken it down)
        lazy = self.lazy or (self._recorded(self.lazy_pidfile, rep.refused) if strays else None)
        if lazy is not None and kill_tree(lazy, timeout_s=2):
            rep.killed.append(lazy.pid)
        for p in live_shm:
            if p.exists():
                p.unlink(missing_ok=True)
                rep.removed_shm.append(str(p))
        for f in ([] if self.shm_inodes else self.shm_files):
            p = Path(f)
            if not in_shm(p):
                rep.refused.append(f"recorded file {f}: not directly in {capture.SHM}")
                continue
            if p.exists() or p.is_symlink():
                p.unlink(missing_ok=True)
                rep.removed_shm.append(f)
        rep.removed_shm += [str(p) for p in capture.remove_by_inode(live_inodes | set(self.shm_inodes))]
        for p in capture.orphaned_shm(self.started_at - 1):
            p.unlink(missing_ok=True)
            rep.removed_shm.append(str(p))
        rep.removed_scratch = self.remove_scratch()
        if self.unkept_image.is_dir() and not self.unkept_image.is_symlink() and not self.dir.is_symlink():
            shutil.rmtree(self.unkept_image, ignore_errors=True)
            rep.removed_scratch = True
        rep.removed_tmp = self.remove_tmp()
        for pf in (self.pidfile, self.criu_pidfile, self.lazy_pidfile, self.lazy_failed):
            if pf.is_file() and not pf.is_symlink():
                pf.unlink(missing_ok=True)
        if self.state is not None:
            remove_state(self.run_dir, self.name)
            self.state = None
        return rep

    @staticmethod
    def _recorded(f: Path, refused: list[str]) -> ProcessId | None:
        """The identity in a pid file this user wrote (JSON: :meth:`ProcessId.as_record`), or None."""
        if not trusted(f):
            if f.exists() or f.is_symlink():
                refused.append(f"{f}: {untrusted(f)}")
            return None
        try:
            d = json.loads(f.read_text())
            return ProcessId.from_record(d)
        except (OSError, ValueError, AttributeError, TypeError):
            refused.append(f"{f}: unreadable")
            return None

    def _kill_strays(self, done: set[int], refused: list[str]) -> list[int]:
        """Trees the record may not name (see :meth:`teardown`); returns the PIDs killed and
        appends to ``refused`` what was left alone.

        - ``engine.pid``: the identity :meth:`set_root` wrote (a cold start or snapshot whose
          state was not recorded yet); killed only while it is still that process.
        - ``restore.pid`` (bare PID from CRIU: the restore finished, the identity was never
          written), read once no CRIU that writes it still runs
          (:func:`warmctl.checkpoint.criu.await_restore_into`): only with a record of this
          restore (``state.json`` written before CRIU ran, :attr:`since`), and only a process
          started after the record and no later than CRIU wrote the file (its mtime):
          :func:`warmctl.base.proc.created_during`, in clock ticks since boot. A stale file
          naming a reused PID fails this.

        Both files must be records this process's user wrote (:func:`warmctl.base.private.trusted`).
        """
        killed: list[int] = []
        if trusted(self.pidfile):
            try:
                d = json.loads(self.pidfile.read_text())
                ident = ProcessId.from_record(d)
            except (OSError, ValueError, AttributeError, TypeError):
                ident = None
                refused.append(f"{self.pidfile}: unreadable")
            if ident is not None and ident.pid not in done:
                if kill_tree(ident):
                    killed.append(ident.pid)
                elif (why := ident.mismatch()) != "gone":
                    refused.append(f"{self.pidfile}: {why}")
        elif self.pidfile.exists() or self.pidfile.is_symlink():
            refused.append(f"{self.pidfile}: {untrusted(self.pidfile)}")
        criu.await_restore_into(self.criu_pidfile)  # a CRIU that outlived its `up` names its tree when it ends
        if self.criu_pidfile.exists() or self.criu_pidfile.is_symlink():
            killed += self._kill_restored(done | set(killed), refused)
        return killed

    def _kill_restored(self, done: set[int], refused: list[str]) -> list[int]:
        """The ``restore.pid`` rule of :meth:`_kill_strays`."""
        f = self.criu_pidfile
        why = untrusted(f)
        if why is None and (self.state is None or not self.state.started_at):
            why = "no record of a restore started before it"
        try:
            pid = int(f.read_text().strip()) if why is None else 0
            mtime = f.stat().st_mtime
        except (OSError, ValueError):
            pid, why = 0, why or "unreadable"
        if why is not None:
            refused.append(f"{f}: {why}")
            return []
        if pid in done:
            return []
        ident, why = created_during(pid, self.state.since, mtime)  # type: ignore[union-attr]
        if why is not None:
            refused.append(f"{f}: {why}")
        return [pid] if ident is not None and kill_tree(ident) else []


#: The longest scratch directory vLLM's socket paths fit under: a Unix socket path is at most
#: 107 bytes (``sun_path``), and vLLM adds ``/<uuid4>`` (37) to ``VLLM_RPC_BASE_PATH``.
MAX_SOCKET_DIR = 107 - 37


def socket_dir(run: Path) -> Path:
    """The engine's scratch directory for the run directory ``run``: ``<run>/tmp``, or, where
    that path is too long for a socket under it (:data:`MAX_SOCKET_DIR`: a deep home or a long
    engine name), ``<temp dir>/warmctl-<16 hex digits of sha256(run)>``: still the run's own,
    recorded and removed the same way."""
    d = run / "tmp"
    if len(os.fsencode(d)) <= MAX_SOCKET_DIR:
        return d
    import hashlib
    import tempfile

    return Path(tempfile.gettempdir()) / f"warmctl-{hashlib.sha256(os.fsencode(run)).hexdigest()[:16]}"


def in_shm(p: Path) -> bool:
    """True if ``p`` names a file directly in ``/dev/shm`` (absolute, no ``..``): the only
    place a teardown removes files by a recorded name."""
    return p.is_absolute() and ".." not in p.parts and p.parent == capture.SHM and p.name not in ("", ".", "..")
