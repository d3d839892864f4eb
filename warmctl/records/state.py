"""Runtime state of engines on this host: ``<home>/run/NAME/state.json``.

Written before anything that leaves processes or files behind (restore, cold start, gate) so
that ``warmctl down`` (or the agent after a crash) can always find and remove them. Writes are
atomic (temp file + rename).
"""

# No `from __future__ import annotations` here: pydantic would then evaluate each field's
# annotation from its string when the class is made (compiling it), about 4 ms of every
# `warmctl up` over the model modules it imports (docs/benchmarks.md).

import logging
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from warmctl.base.errors import HostError
from warmctl.base.private import private_dir, write_private
from warmctl.base.proc import ProcessId, Stamp

log = logging.getLogger(__name__)

EnginePhase = Literal["starting", "restoring", "health", "canary", "serving", "failed"]
#: How an engine came up: restored from a snapshot, or started cold from its profile.
EngineSource = Literal["restore", "cold"]


class EngineState(BaseModel):
    """One engine on this host. PIDs are host PIDs; ports are TCP ports; times are Unix seconds."""

    model_config = ConfigDict(defer_build=True)

    name: str
    phase: EnginePhase
    source: EngineSource
    manifest_digest: str | None = None
    profile_digest: str | None = None
    root_pid: int | None = None
    gate_pid: int | None = None
    #: Creation times (Unix seconds, for reports) of those PIDs: PIDs are reused quickly (pid_max
    #: can be 32768 and an engine uses ~70 of them), so a PID alone never identifies our process.
    root_ctime: float | None = None
    gate_ctime: float | None = None
    #: Their start times in clock ticks since boot (``/proc/PID/stat`` ``starttime``): the
    #: identity (:class:`warmctl.base.proc.ProcessId`; None in records written before they were kept,
    #: which are judged by ``*_ctime``).
    root_start: int | None = None
    gate_start: int | None = None
    #: The boot (``/proc/sys/kernel/random/boot_id``) the start ticks and ``started_boot`` count in.
    boot_id: str | None = None
    #: Executables (``/proc/PID/exe``) and command lines of those processes when recorded: a
    #: signal goes only to a PID that still runs the recorded executable
    #: (:class:`warmctl.base.proc.ProcessId`; None in records written before they were kept).
    root_exe: str | None = None
    gate_exe: str | None = None
    root_cmdline: list[str] = []
    gate_cmdline: list[str] = []
    internal_port: int
    public_host: str
    public_port: int
    #: What the gate enforces on the public port: an API key (``gate_api_key_file``) and TLS.
    gate_api_key: bool = False
    gate_tls: bool = False
    served_model_name: str
    shm_files: list[str] = []
    #: (st_dev, st_ino) of the /dev/shm files restore wrote: CRIU re-links a ``link_remap.N``
    #: file to its original name during restore, and that name must go at ``down`` too.
    shm_inodes: list[tuple[int, int]] = []
    log_path: str
    #: The engine's scratch directory (``VLLM_RPC_BASE_PATH``: vLLM's ZMQ IPC sockets), removed
    #: by the teardown; None in records written before engines had one.
    tmp_dir: str | None = None
    #: When the run began: Unix seconds (reports; ``/dev/shm`` file times) and seconds since boot
    #: (``CLOCK_BOOTTIME``; None in older records): processes "started after the record" are
    #: judged against ``started_boot`` (:func:`warmctl.base.proc.created_during`).
    started_at: float = 0.0
    started_boot: float | None = None
    timings: dict[str, float] = {}
    #: How the restore copied the engine's memory: ``lazy`` (a ``criu lazy-pages`` daemon copies
    #: pages on demand and in the background, see :func:`warmctl.checkpoint.criu.lazy_restore`),
    #: ``eager``, or None (a cold start, or a record written before this was kept).
    restore_pages: str | None = None
    #: The lazy-pages daemon as recorded (PID, start time, executable, argv); None without one.
    lazy_pid: int | None = None
    lazy_ctime: float | None = None
    lazy_start: int | None = None
    lazy_exe: str | None = None
    lazy_cmdline: list[str] = []
    #: The engine's parallel layout (``"TP2"``; :meth:`warmctl.records.manifest.ParallelLayout.describe`
    #: without the ranks) and its ranks as found serving: ``{role: host PID}`` (``Worker_TP0``,
    #: or ``EngineCore`` for one rank; :mod:`warmctl.checkpoint.layout`). Empty when not known.
    layout: str | None = None
    ranks: dict[str, int] = {}
    #: Why the snapshot ``up --snapshot-after`` asked for was not made while this (cold-started)
    #: engine kept serving (one line); None otherwise.
    snapshot_error: str | None = None

    def set_root(self, ident: ProcessId | None) -> None:
        """Record the engine tree's root process (PID, start time, executable, argv)."""
        self.root_pid, self.root_ctime, self.root_exe, self.root_cmdline, self.root_start = _fields(ident)
        self._keep_boot(ident)

    def set_gate(self, ident: ProcessId | None) -> None:
        """Record the gate process (PID, start time, executable, argv)."""
        self.gate_pid, self.gate_ctime, self.gate_exe, self.gate_cmdline, self.gate_start = _fields(ident)
        self._keep_boot(ident)

    @property
    def root(self) -> ProcessId | None:
        """The engine tree's root process as recorded (None before it started)."""
        return ProcessId.recorded(self.root_pid, self.root_ctime, self.root_exe, self.root_cmdline,
                                  self.root_start, self.boot_id)

    @property
    def gate(self) -> ProcessId | None:
        """The gate process as recorded (None before it opened)."""
        return ProcessId.recorded(self.gate_pid, self.gate_ctime, self.gate_exe, self.gate_cmdline,
                                  self.gate_start, self.boot_id)

    def set_lazy(self, ident: ProcessId | None) -> None:
        """Record the lazy-pages daemon (PID, start time, executable, argv)."""
        self.lazy_pid, self.lazy_ctime, self.lazy_exe, self.lazy_cmdline, self.lazy_start = _fields(ident)
        self._keep_boot(ident)

    @property
    def lazy(self) -> ProcessId | None:
        """The lazy-pages daemon as recorded (None for an eager restore or a cold start)."""
        return ProcessId.recorded(self.lazy_pid, self.lazy_ctime, self.lazy_exe, self.lazy_cmdline,
                                  self.lazy_start, self.boot_id)

    def _keep_boot(self, ident: ProcessId | None) -> None:
        if ident is not None and ident.boot is not None:
            self.boot_id = ident.boot

    @property
    def since(self) -> Stamp:
        """When the run began, in both clocks (:class:`warmctl.base.proc.Stamp`)."""
        return Stamp(self.started_at, self.started_boot, self.boot_id if self.started_boot is not None else None)

    def engine_alive(self) -> bool:
        """True if the recorded root PID still is *our* process (same start time) and alive."""
        return self.root is not None and self.root.alive()

    def gate_alive(self) -> bool:
        """True if the recorded gate PID still is *our* gate and alive."""
        return self.gate is not None and self.gate.alive()


def _fields(ident: ProcessId | None) -> tuple[int | None, float | None, str | None, list[str], int | None]:
    if ident is None:
        return None, None, None, [], None
    return ident.pid, ident.ctime, ident.exe, list(ident.cmdline), ident.start


def state_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / name / "state.json"


def load(run_dir: Path, name: str) -> EngineState | None:
    """The recorded state of ``name``, or None if there is none. Raises :class:`HostError`
    naming the file and what is wrong when the record exists but cannot be read or parsed
    (never treated as "no engine": its processes and files may still exist)."""
    p = state_path(run_dir, name)
    try:
        return EngineState.model_validate_json(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise HostError(unreadable_message(p, e)) from None


def unreadable_message(path: Path, err: BaseException) -> str:
    """What to say about the engine record ``path`` that ``err`` made unreadable."""
    why = err.strerror if isinstance(err, OSError) and err.strerror else " ".join(str(err).split())[:300]
    return (f"engine record {path} is unreadable ({why}): warmctl cannot tell which processes and files are "
            f"this engine's; check them by hand, then remove {path.parent} to forget it")


def save(run_dir: Path, st: EngineState) -> None:
    """Write ``st`` to ``<run_dir>/NAME/state.json`` atomically, mode 0600 in 0700 directories
    (:mod:`warmctl.base.private`: the record says what may be killed and removed). Raises
    :class:`HostError` naming the file and the reason when it cannot be written (a full disk, a
    read-only file system); the record before is then left as it was."""
    p = state_path(run_dir, st.name)
    if not st.started_at:
        now = Stamp.now()
        st.started_at, st.started_boot, st.boot_id = now.wall, now.boot, st.boot_id or now.boot_id
    try:
        private_dir(run_dir)
        private_dir(p.parent)
        write_private(p, st.model_dump_json(indent=2))
    except OSError as e:
        raise HostError(f"could not record engine {st.name}'s state in {p}: {e.strerror or e}") from e


def remove(run_dir: Path, name: str) -> None:
    state_path(run_dir, name).unlink(missing_ok=True)


def all_states(run_dir: Path, problems: list[str] | None = None) -> list[EngineState]:
    """Every recorded engine, sorted by name. A record that cannot be read is not an engine
    to list, but never passed over in silence: its :func:`unreadable_message` is logged as a
    warning and, given ``problems``, appended to it."""
    out = []
    for p in sorted(Path(run_dir).glob("*/state.json")):
        try:
            out.append(EngineState.model_validate_json(p.read_text()))
        except (OSError, ValueError) as e:
            msg = unreadable_message(p, e)
            log.warning("%s", msg)
            if problems is not None:
                problems.append(msg)
    return out
