"""The parallel layout of an engine: its ranks, found, recorded and checked at both ends.

A vLLM engine with ``--tensor-parallel-size`` (TP), ``--pipeline-parallel-size`` (PP) or
``--data-parallel-size`` (DP) above 1 runs one worker process per rank (``VLLM::Worker_TP0``,
``VLLM::Worker_PP1_TP0``, ``..._EP1`` with ``--enable-expert-parallel``: the process titles
vLLM 0.32 sets, ``v1/executor/multiproc_executor.py``); a one-rank engine runs its rank in a
``VLLM::Worker`` process (the multiprocessing executor, vLLM 0.32's default on the CPU build)
or inside ``VLLM::EngineCore``. The ranks talk over loopback TCP (gloo) and shared memory, so a
snapshot is only good when every rank is in it, and a restore only when every rank came back.

This module is the one rank model for the CPU build and GPU hosts alike:

- :func:`sizes_of`: TP, PP, DP and EP from a profile's ``engine.args``; :class:`Sizes` names
  the roles the ranks must have;
- :func:`cpu_binding`: the CPU build binds each rank's OpenMP threads to its own cores
  (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's ``auto`` needs a NUMA node per rank): the profile's
  binding checked against this host's CPUs, or a default split of the CPUs warmctl may use;
- :func:`discover` (before the dump): every rank present and alive, its PID inside the engine's
  PID namespace, its bound CPUs and (GPU hosts) the GPU it holds; the manifest records it
  (:class:`warmctl.records.manifest.ParallelLayout`, ``restore.layout``);
- :func:`check_restored` (after the CRIU restore, before the canary): every recorded rank back
  under its namespace PID with the same role, alive, and bound to the CPUs recorded.

A missing or dead rank is an error naming the rank, its process and its last log lines
(:class:`RankError`). :mod:`warmctl.checkpoint.ranks` (the CUDA checkpoint of GPU ranks) finds
its ranks again after a restore through :func:`restored_pids`, the same records.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from warmctl.checkpoint.affinity import cpu_list, parse_cpu_list
from warmctl.base.errors import CheckpointError, HostError
from warmctl.base.parallel import Sizes, sizes_of
from warmctl.base.proc import nspid, pid_alive, tree_pids

if TYPE_CHECKING:
    from warmctl.records.manifest import ParallelLayout, RankRecord
    from warmctl.records.profile import Profile

#: The process title of a rank (``/proc/PID/cmdline`` after setproctitle): group 1 is its role.
RANK_TITLE = re.compile(r"^VLLM::((?:Worker|EngineCore)(?:_[A-Z]+\d+)*)\b")
#: The variable vLLM's CPU build reads for each rank's OpenMP thread binding.
BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"


class RankError(CheckpointError):
    """A rank of the layout is missing, dead, or not what was recorded (before a dump or after
    a restore). ``ranks``: the roles concerned."""

    def __init__(self, message: str, ranks: list[str]):
        super().__init__(message)
        self.ranks = ranks


def profile_sizes(profile: "Profile") -> Sizes:
    """:func:`sizes_of` the profile's ``engine.args`` (already validated by the profile)."""
    return sizes_of(list(profile.engine.args))


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (``sched_getaffinity``): what an engine it starts gets."""
    return set(os.sched_getaffinity(0))


def numa_nodes(cpus: set[int], sysfs: str = "/sys/devices/system/node") -> int:
    """How many NUMA nodes hold at least one of ``cpus`` (1 when sysfs does not say)."""
    nodes = 0
    try:
        for d in Path(sysfs).glob("node[0-9]*"):
            try:
                if parse_cpu_list((d / "cpulist").read_text().strip() or "x") & cpus:
                    nodes += 1
            except (OSError, ValueError):
                continue
    except OSError:
        pass
    return max(nodes, 1)


def default_binding(n_ranks: int, cpus: set[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``n_ranks`` ranks over ``cpus``: contiguous, equal
    shares in CPU order (the remainder to the first ranks), ``"0|1"`` for 2 ranks on CPUs 0-1.
    Raises :class:`HostError` when there are fewer CPUs than ranks."""
    order = sorted(cpus)
    if len(order) < n_ranks:
        raise HostError(f"{n_ranks} ranks need a CPU each; warmctl may use only {len(order)} "
                        f"(CPUs {cpu_list(order) or 'none'})")
    share, extra = divmod(len(order), n_ranks)
    out, i = [], 0
    for r in range(n_ranks):
        k = share + (1 if r < extra else 0)
        out.append(cpu_list(order[i:i + k]))
        i += k
    return "|".join(out)


def check_binding(value: str, sizes: Sizes, cpus: set[int]) -> list[str]:
    """Problems of the binding ``value`` (``VLLM_CPU_OMP_THREADS_BIND``) for ``sizes`` on a host
    whose usable CPUs are ``cpus``, one sentence each naming the rank and the CPUs; [] when it
    can be satisfied. ``auto`` needs a NUMA node per rank; ``nobind`` is always accepted."""
    roles = sizes.roles()
    if value == "nobind":
        return []
    if value == "auto":
        nodes = numa_nodes(cpus)
        if nodes < len(roles):
            return [f"{BIND_VAR}=auto binds a NUMA node per rank: {len(roles)} ranks ({sizes.describe()}: "
                    f"{', '.join(roles)}) but CPUs {cpu_list(cpus)} are on {nodes} NUMA node(s); give one CPU "
                    f"list per rank (e.g. {default_binding(len(roles), cpus) if len(cpus) >= len(roles) else '0|1'}) "
                    "or leave it unset for warmctl's default"]
        return []
    lists = value.split("|")
    if len(lists) != len(roles):
        return [f"{BIND_VAR}={value!r} gives {len(lists)} CPU list(s) for {len(roles)} rank(s) "
                f"({sizes.describe()}: {', '.join(roles)})"]
    problems = []
    seen: dict[int, str] = {}
    for role, s in zip(roles, lists):
        try:
            want = parse_cpu_list(s)
        except ValueError:
            problems.append(f"{BIND_VAR}: rank {role} has {s!r}, not a CPU list")
            continue
        if not want <= cpus:
            problems.append(f"{BIND_VAR}: rank {role} is bound to CPU(s) {cpu_list(want - cpus)}, which this host "
                            f"does not let warmctl use (usable: {cpu_list(cpus)})")
        for c in sorted(want):
            if c in seen:
                problems.append(f"{BIND_VAR}: ranks {seen[c]} and {role} are both bound to CPU {c}")
            seen.setdefault(c, role)
    return problems


@dataclass(frozen=True)
class Binding:
    """The CPU binding an engine's ranks get: ``value`` of ``VLLM_CPU_OMP_THREADS_BIND`` (None:
    not set, vLLM's own ``auto``) and its ``source``: ``"profile"`` (``engine.env``),
    ``"default"`` (warmctl's, :func:`default_binding`) or ``"none"``."""

    value: str | None
    source: str

    def env(self) -> dict[str, str]:
        """What warmctl adds to the engine's environment: the default binding, else nothing."""
        return {BIND_VAR: self.value} if self.source == "default" and self.value else {}


def cpu_binding(profile: "Profile", cpus: set[int] | None = None) -> Binding:
    """The CPU binding of ``profile``'s ranks on this host (``cpus``: the CPUs warmctl may
    use, default :func:`allowed_cpus`). GPU profiles and one-rank CPU profiles get none from
    warmctl. A CPU profile with several ranks (TP x PP x DP > 1) keeps the binding its
    ``engine.env`` gives; without one, warmctl's :func:`default_binding` when the ranks
    outnumber the NUMA nodes (vLLM's ``auto`` would stop at start-up: "Not enough allowed NUMA
    nodes"), else vLLM's ``auto``. Raises :class:`HostError` naming the ranks and CPUs when
    the binding cannot be satisfied here."""
    given = profile.engine.env.get(BIND_VAR)
    sizes = profile_sizes(profile)
    if profile.hardware.gpu_count or not sizes.multi_process:
        return Binding(given, "profile" if given else "none")
    cpus = allowed_cpus() if cpus is None else cpus
    if given is None:
        if numa_nodes(cpus) >= sizes.world_size:
            return Binding(None, "none")
        try:
            return Binding(default_binding(sizes.world_size, cpus), "default")
        except HostError as e:
            raise HostError(f"profile {profile.name}: {sizes.describe()} on the CPU build: {e}; ranks "
                            f"{', '.join(sizes.roles())}") from None
    problems = check_binding(given, sizes, cpus)
    if problems:
        raise HostError(f"profile {profile.name}: engine.env.{BIND_VAR} cannot be satisfied on this host: "
                        + "; ".join(problems))
    return Binding(given, "profile")


# --- the live ranks ----------------------------------------------------------------------------


@dataclass
class LiveRank:
    """A rank process found in a running tree: ``role``, host ``pid``, ``nspid`` (its PID inside
    the engine's PID namespace), ``cpus`` (CPU list its bound threads use, ``""`` when none is
    bound) and ``gpu`` (the GPU UUID it holds, GPU hosts only)."""

    role: str
    pid: int
    nspid: int
    cpus: str = ""
    gpu: str | None = None


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _comm_is(pid: int, role: str) -> bool:
    """True if ``pid``'s kernel name (``/proc/PID/comm``: setproctitle sets it to the title's
    first 15 bytes) is ``VLLM::<role>`` as far as it goes. For a title that reads empty: right
    after a lazy restore a process's argument pages may not be copied in yet, and the kernel
    then reads ``/proc/PID/cmdline`` as nothing (measured: a restored TP1 rank came back as
    ``''`` under ``--restore-pages lazy``)."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            comm = f.read().rstrip(b"\n").decode(errors="replace")
    except OSError:
        return False
    return bool(comm) and ("VLLM::" + role)[:15] == comm


def _bound_cpus(pid: int, unbound: set[int]) -> str:
    """CPU list of the union of the affinities of ``pid``'s threads that are bound (differ from
    ``unbound``); ``""`` when none is."""
    out: set[int] = set()
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return ""
    for tid in tids:
        try:
            a = os.sched_getaffinity(tid)
        except OSError:
            continue
        if a != unbound:
            out |= a
    return cpu_list(out)


def live_ranks(root_pid: int, unbound: set[int] | None = None) -> dict[str, LiveRank]:
    """``{role: LiveRank}`` of every live rank process in ``root_pid``'s tree (process titles,
    :data:`RANK_TITLE`). At TP1 the rank is the engine core; with worker processes the engine
    core is not a rank. ``unbound``: the CPUs an unbound thread has (default: this process's)."""
    unbound = allowed_cpus() if unbound is None else unbound
    found: dict[str, LiveRank] = {}
    for pid in tree_pids(root_pid):
        m = RANK_TITLE.match(_title(pid))
        if not m or not pid_alive(pid):
            continue
        ns = nspid(pid)
        if ns is None:
            continue
        found[m.group(1)] = LiveRank(m.group(1), pid, ns, _bound_cpus(pid, unbound))
    if any(r.startswith("Worker") for r in found):
        found = {k: v for k, v in found.items() if k.startswith("Worker")}
    return found


def log_lines(log_path: Path | str | None, role: str, n: int = 6) -> list[str]:
    """The last ``n`` lines of the engine log that name ``role`` (vLLM prefixes a worker's lines
    with ``(Worker_TP1 pid=N)``), else the log's last lines."""
    if not log_path:
        return []
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    mine = [ln for ln in lines if role in ln]
    return (mine or lines)[-n:]


def _named(role: str, what: str, log_path, pid: int | None = None) -> str:
    who = f"rank {role}" + (f" (pid {pid})" if pid else "")
    tail = log_lines(log_path, role)
    return f"{who} {what}" + (f"; its log lines ({log_path}):\n    " + "\n    ".join(tail) if tail else "")


#: Seconds a rank may stay stopped (``T``/``t`` in ``/proc/PID/stat``: SIGSTOP, a debugger)
#: before it is an error: its peers wait on it in their collectives (the gloo group, the
#: shared-memory all-reduce) and would wait for ever. Before a dump a stopped rank is
#: refused after this long; during the warm-up and the canary record (:class:`RankWatch`)
#: it ends the run this long after it stopped.
STOP_GRACE_S = 2.0
#: Seconds between two looks at the ranks while the warm-up runs (:class:`RankWatch`).
WATCH_INTERVAL_S = 0.1


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` (``/proc/PID/stat`` field 3: ``R``, ``S``, ``D``, ``T``
    stopped, ``t`` tracing stop, ``Z``...); ``""`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return ""
    rest = data[data.rfind(b")") + 2:]
    return rest[:1].decode(errors="replace")


def cpu_ticks(pid: int) -> int | None:
    """CPU time ``pid`` and its live descendants have used, in clock ticks
    (:data:`warmctl.base.proc.CLK_TCK` per second): user + system time of each (all its threads),
    with that of the children each has reaped (``/proc/PID/stat`` fields 14-17). A rank's
    compile workers and other helpers count as the rank. None when ``pid`` is gone."""
    from warmctl.base.proc import tree_pids

    total, seen = 0, False
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        try:
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime (fields 14-17)
        except (ValueError, IndexError):
            continue
        seen = seen or p == pid
    return total if seen else None


def stopped(pid: int) -> bool:
    """True while ``pid`` is stopped (state ``T`` or ``t``): it runs no instruction, its peers
    in a collective wait on it."""
    return proc_state(pid) in ("T", "t")


def _one_rank_roles(roles: list[str], found: dict[str, "LiveRank"]) -> list[str]:
    """``roles`` with a one-rank engine's rank as its ``Worker`` process where it has one."""
    if roles == ["EngineCore"] and "Worker" in found:  # one rank in a worker process of its own
        return ["Worker"]
    return roles


def discover(root_pid: int, sizes: Sizes, log_path: Path | str | None = None,
             gpus: dict[int, str] | None = None, stop_grace_s: float = STOP_GRACE_S) -> list[LiveRank]:
    """Every rank ``sizes`` names, live in ``root_pid``'s tree, in rank order (before the dump).
    ``gpus``: ``{host pid: GPU UUID}`` of the GPU ranks (GPU hosts). A rank found stopped is
    looked at again every 0.1 s for up to ``stop_grace_s`` seconds (:data:`STOP_GRACE_S`),
    unless a rank is missing too (the run fails at once then: its survivors' shutdown would
    otherwise run, and leave files, while this waits).
    Raises :class:`RankError` naming each missing rank and each rank still stopped, with its
    log lines (``log_path``: the engine log)."""
    found = live_ranks(root_pid)
    roles = _one_rank_roles(sizes.roles(), found)
    missing = [r for r in roles if r not in found]
    import time

    deadline = time.monotonic() + stop_grace_s
    halted = [r for r in roles if r in found and stopped(found[r].pid)]
    while halted and not missing and time.monotonic() < deadline:  # with a rank gone the run fails now
        time.sleep(0.1)
        halted = [r for r in halted if stopped(found[r].pid)]
    if missing or halted:
        have = ", ".join(f"{r.role} (pid {r.pid})" for r in found.values()) or "none"
        raise RankError(f"{sizes.describe()} engine (pid {root_pid}): "
                        + "; ".join([_named(r, "is not running", log_path) for r in missing]
                                    + [_named(r, f"is stopped (state {proc_state(found[r].pid) or '?'})"
                                              + ("" if missing else f" for over {stop_grace_s:g} s")
                                              + ": its peers would wait on it in their collectives",
                                              log_path, found[r].pid) for r in halted])
                        + f"\n  ranks present: {have}", missing + halted)
    out = [found[r] for r in roles]
    for r in out:
        r.gpu = (gpus or {}).get(r.pid)
    return out


def _gone(r: LiveRank) -> bool:
    """True once the process of ``r`` is gone (or a zombie), or no longer titled as a rank."""
    return not pid_alive(r.pid) or not RANK_TITLE.match(_title(r.pid))


def died(root_pid: int, describe: str, ranks: list[LiveRank], what: str,
         log_path: Path | str | None = None, dead_nspids: Sequence[int] | None = None) -> RankError | None:
    """A :class:`RankError` naming each of ``ranks`` (found live before ``what``) whose process
    is gone now (a ``kill -9`` during ``what``, e.g. the CRIU dump), with its PID and its log
    lines (``log_path``: the engine log); None when every one is alive. ``describe``: the
    layout in words (``TP2``), for the message. ``dead_nspids``: instead of looking at the
    processes now, the namespace PIDs known dead (a dump's images:
    :func:`warmctl.checkpoint.criu.dumped_dead`)."""
    dead = [r for r in ranks if (_gone(r) if dead_nspids is None else r.nspid in dead_nspids)]
    if not dead:
        return None
    return RankError(f"{describe} engine (pid {root_pid}): "
                     + "; ".join(_named(r.role, f"died during {what}", log_path, r.pid) for r in dead),
                     [r.role for r in dead])


class RankWatch:
    """The ranks of a running tree watched while warmctl waits on the engine (the warm-up grid
    and the canary record: :func:`warmctl.engine.cold.warm_and_record`), so that a rank that
    dies or stops ends the wait at once, named, instead of the request's timeout.

    Made with the ranks found live (:func:`discover`, which raises :class:`RankError` for one
    missing already). :meth:`problem` looks at each of them (every
    :data:`WATCH_INTERVAL_S` seconds, by the caller): a rank whose process is gone (a
    ``kill -9``) is an error at the first look; one stopped (``SIGSTOP``: its peers wait in
    the all-reduce for ever) once it has stayed stopped ``stop_grace_s`` seconds; one alive and
    running but **silent** (a deadlock, a wait on a peer or a device that never answers) once it
    has used no CPU time at all (:func:`cpu_ticks`: the rank and its descendants, so a
    compile in helper processes counts) for ``silence_s`` seconds while requests are in flight:
    between :meth:`busy` and :meth:`idle` (the caller's warm-up grid and canary record). A
    rank computing, compiling or spinning in a collective uses CPU time, however slowly the
    loaded host runs it; the silence is counted only while requests run, so time between
    them (or before the first) is never silence. ``silence_s`` 0: not watched (the
    ``rank_silence_s`` setting)."""

    def __init__(self, root_pid: int, sizes: Sizes, log_path: Path | str | None = None,
                 stop_grace_s: float = STOP_GRACE_S, silence_s: float = 0.0):
        self.root_pid, self.sizes, self.log_path, self.stop_grace_s = root_pid, sizes, log_path, stop_grace_s
        self.silence_s = silence_s
        self.ranks = discover(root_pid, sizes, log_path, stop_grace_s=stop_grace_s)
        self._stopped_since: dict[str, float] = {}
        #: role -> (CPU ticks last seen, monotonic time they last changed), while busy
        self._cpu: dict[str, tuple[int, float]] | None = None
        self._cpu_look = 0.0
        #: the first problem seen (kept: the ranks a dead one takes with it are not blamed)
        self.first: RankError | None = None

    def busy(self) -> None:
        """Requests are in flight from now on: a rank's silence is counted from here."""
        self._cpu = {}
        self._cpu_look = 0.0

    def idle(self) -> None:
        """No request in flight: silence is not counted until the next :meth:`busy`."""
        self._cpu = None

    def _silent(self, now: float, live: list[LiveRank]) -> list[tuple[LiveRank, float]]:
        """(rank, seconds without CPU time) of each rank of ``live`` silent for ``silence_s``."""
        if self._cpu is None or self.silence_s <= 0 or now - self._cpu_look < min(1.0, self.silence_s / 4):
            return []
        self._cpu_look = now
        out = []
        for r in live:
            ticks = cpu_ticks(r.pid)
            if ticks is None:
                continue
            last = self._cpu.get(r.role)
            if last is None or last[0] != ticks:
                self._cpu[r.role] = (ticks, now)
            elif now - last[1] >= self.silence_s:
                out.append((r, now - last[1]))
        return out

    def problem(self, what: str = "the warm-up") -> RankError | None:
        """A :class:`RankError` naming the ranks that died or stayed stopped during ``what``
        (the first one found is kept and returned again), else None."""
        if self.first is not None:
            return self.first
        import time

        now = time.monotonic()
        dead, halted, running = [], [], []
        for r in self.ranks:
            if _gone(r):
                dead.append(r)
            elif stopped(r.pid):
                since = self._stopped_since.setdefault(r.role, now)
                if now - since >= self.stop_grace_s:
                    halted.append(r)
                if self._cpu is not None:
                    self._cpu.pop(r.role, None)  # a stopped rank is judged as stopped, not as silent
            else:
                self._stopped_since.pop(r.role, None)
                running.append(r)
        silent = self._silent(now, running) if not dead and not halted else []
        if not dead and not halted and not silent:
            return None
        msgs = [_named(r.role, f"died during {what}", self.log_path, r.pid) for r in dead]
        msgs += [_named(r.role, f"is stopped (state {proc_state(r.pid) or '?'}) for {now - self._stopped_since[r.role]:.1f} s "
                        f"during {what}: its peers wait on it in their collectives", self.log_path, r.pid)
                 for r in halted]
        msgs += [_named(r.role, f"is alive (state {proc_state(r.pid) or '?'}) but silent: it used no CPU time for "
                        f"{quiet:.1f} s during {what} while a request was in flight (rank_silence_s = "
                        f"{self.silence_s:g} s); it no longer answers", self.log_path, r.pid)
                 for r, quiet in silent]
        self.first = RankError(f"{self.sizes.describe()} engine (pid {self.root_pid}): " + "; ".join(msgs),
                               [r.role for r in dead + halted] + [r.role for r, _ in silent])
        return self.first


def restored_pids(root_pid: int, nspids: list[int]) -> dict[int, int]:
    """After a CRIU restore: ``{namespace PID: host PID}`` of each of ``nspids`` found in
    ``root_pid``'s tree (CRIU restores namespace PIDs; the host PIDs are new)."""
    want = set(nspids)
    out: dict[int, int] = {}
    for pid in tree_pids(root_pid):
        ns = nspid(pid)
        if ns in want:
            out[ns] = pid
    return out


def check_restored(root_pid: int, layout: "ParallelLayout", log_path: Path | str | None = None) -> dict[str, int]:
    """After the CRIU restore (and the rebinding of threads), before the canary: every rank
    ``layout`` records is back under its namespace PID, alive, with its role as process title,
    and its bound threads on the CPUs recorded (where this host offers them: a one-rank
    snapshot may restore where they are not, :mod:`warmctl.checkpoint.affinity`). Returns
    ``{role: host pid}``. Raises
    :class:`RankError` naming each rank that is not, with its process and log lines."""
    back = restored_pids(root_pid, [r.nspid for r in layout.ranks])
    unbound = allowed_cpus()
    bad: list[tuple[str, str]] = []
    out: dict[str, int] = {}
    for r in layout.ranks:
        pid = back.get(r.nspid)
        if pid is None or not pid_alive(pid):
            bad.append((r.role, _named(r.role, f"(namespace pid {r.nspid}) is not running after the restore", log_path,
                                       pid)))
            continue
        title = _title(pid)
        m = RANK_TITLE.match(title)
        if (not m or m.group(1) != r.role) and not (title == "" and _comm_is(pid, r.role)):
            bad.append((r.role, _named(r.role, f"(namespace pid {r.nspid}) came back as {_title(pid)!r}", log_path,
                                       pid)))
            continue
        if r.cpus and parse_cpu_list(r.cpus) <= unbound and _bound_cpus(pid, unbound) != r.cpus:
            bad.append((r.role, _named(r.role, f"is bound to CPUs {_bound_cpus(pid, unbound) or 'any'}, recorded "
                                       f"{r.cpus}", log_path, pid)))
            continue
        out[r.role] = pid
    if bad:
        raise RankError(f"{len(bad)} of {len(layout.ranks)} rank(s) not back as recorded: "
                        + "; ".join(msg for _, msg in bad), [r for r, _ in bad])
    return out


def listening(root_pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket ``root_pid``'s tree listens on, sorted: what CRIU
    restores bound to the same address and port (the API server's port; a multi-rank engine's
    gloo ports, one per rank and process group, in the kernel's ephemeral range), so another
    process holding one would make the restore fail."""
    import psutil

    out: set[tuple[str, int]] = set()
    for pid in tree_pids(root_pid):
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except (psutil.Error, OSError):
            continue
        out |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN and c.laddr}
    return sorted(out)


def record(ranks: list[LiveRank], sizes: Sizes, binding: Binding, network_lock: str | None,
           listen: Sequence[tuple[str, int]] = ()) -> "ParallelLayout":
    """The manifest's ``restore.layout`` for ``ranks`` (:func:`discover`); ``listen``: the
    tree's listening sockets (:func:`listening`)."""
    from warmctl.records.manifest import ParallelLayout, RankRecord

    recs: list[RankRecord] = []
    for i, r in enumerate(ranks):
        rec = RankRecord(rank=i, role=r.role, nspid=r.nspid, cpus=r.cpus)
        if r.gpu:
            rec.gpu = r.gpu
        recs.append(rec)
    lay = ParallelLayout(tp=sizes.tp, pp=sizes.pp, dp=sizes.dp, ep=sizes.ep_size, world_size=sizes.world_size,
                         ranks=recs)
    if binding.value is not None:
        lay.cpu_bind, lay.cpu_bind_source = binding.value, binding.source
    if network_lock is not None:
        lay.network_lock = network_lock
    if listen:
        lay.listen = [f"{ip}:{port}" for ip, port in listen]
    return lay


def require_ports_free(lay: "ParallelLayout", what: str) -> None:
    """Pre-flight of a restore: every TCP port the snapshot's tree listened on
    (``layout.listen``) is free here, else :class:`HostError` naming each one taken and the
    process that holds it (another engine's rank, a server that got it from the kernel): CRIU
    restores every listening socket bound to its port. A multi-rank engine's gloo ports are
    ephemeral ones the kernel picked on the snapshot's host, so the message also gives the
    ``sysctl`` command that keeps them free on this one (:func:`warmctl.base.ports.reserve_command`)."""
    from warmctl.base.ports import port_free, port_holder, reserve_command

    taken, ports = [], []
    for a in lay.listen:
        ip, _, port = a.rpartition(":")
        ports.append(int(port))
        if not port_free(ip.strip("[]") or "0.0.0.0", int(port)):
            taken.append(f"{a} is already in use{port_holder(int(port))}")
    if taken:
        raise HostError(f"{what}: {len(taken)} of the {len(ports)} ports its tree listened on "
                        f"{'is' if len(taken) == 1 else 'are'} taken here: "
                        f"{'; '.join(taken)}. A restore binds each again: stop the holder, or restore on another "
                        f"node. To keep them free on this node: {reserve_command(ports)} "
                        '(docs/operations.md, "Ports")')


def rank_cpus(layout: "ParallelLayout") -> dict[str, str]:
    """``{role: CPU list}`` of the ranks that were bound (what a restoring host must offer)."""
    return {r.role: r.cpus for r in layout.ranks if r.cpus}


def host_problems(rank_cpus_: dict[str, str], cpus: set[int]) -> list[str]:
    """One sentence per rank whose recorded CPUs (``{role: CPU list}``) are not all among
    ``cpus`` (the CPUs a restoring warmctl may use)."""
    out = []
    for role, s in sorted(rank_cpus_.items()):
        try:
            want = parse_cpu_list(s)
        except ValueError:
            continue
        if not want <= cpus:
            out.append(f"rank {role} ran on CPU(s) {s}, this host offers {cpu_list(cpus) or 'none'}")
    return out
