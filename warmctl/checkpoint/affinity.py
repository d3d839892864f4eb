"""The engine's CPU binding, carried across a snapshot.

CRIU (up to 4.2, the version these hosts run) neither dumps nor restores a thread's CPU
affinity (``sched_setaffinity(2)``): every restored thread gets the affinity of the ``criu
restore`` process, i.e. any CPU. Engines bind threads on purpose: vLLM's CPU build pins each
rank's OpenMP compute threads to the cores it chose (``VLLM_CPU_OMP_THREADS_BIND``, default
``auto``: its log line ``OpenMP thread binding info``) and keeps other cores for its API server
and scheduler; GPU deployments bind ranks to the NUMA node of their GPU. A restore that drops
the binding serves correctly (the canary passes) but not as the engine was set up to run:
after a restore of ``tiny`` every one of its worker's 47 threads, bound to CPU 0 at the cold
start, was on both CPUs. What that costs depends on the host (``benchmarks/cpu_binding.py``;
docs/benchmarks.md, "CPU binding after restore").

So a snapshot records, for every thread of the tree whose affinity differs from the CPUs the
snapshotting warmctl may use (what an unbound engine inherits), its CPU list and its thread ID
inside the engine's PID namespace (the last ``NSpid`` field of ``/proc/PID/task/TID/status``;
CRIU restores those IDs). ``up`` puts each back right after the CRIU restore, before health
and canary, where every CPU it names is one the restoring warmctl may use; a binding naming a
CPU this host lacks is left off and reported (the thread keeps any CPU).

Format (``restore.cpu_affinity`` of the manifest, :class:`warmctl.records.manifest.RestoreInfo`):
``{CPU list: [namespace thread IDs]}``, the CPU list in the kernel's list syntax as
``/proc/PID/status`` ``Cpus_allowed_list`` writes it (``"0"``, ``"0-3,8"``), thread IDs sorted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from warmctl.base.parallel import cpu_list, parse_cpu_list
from warmctl.base.proc import nspid, tree_pids


def tree_threads(root_pid: int):
    """(host thread ID, namespace thread ID) of every thread in ``root_pid``'s tree."""
    for pid in tree_pids(root_pid):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue  # exited meanwhile
        for tid in tids:
            ns = nspid(pid, tid)
            if ns is not None:
                yield tid, ns


def record(root_pid: int) -> dict[str, list[int]]:
    """The bound threads of ``root_pid``'s tree (module doc's format); {} if none is bound.
    Read from the live tree (call it before the dump: CRIU kills the tree)."""
    unbound = os.sched_getaffinity(0)
    out: dict[str, list[int]] = {}
    for tid, ns in tree_threads(root_pid):
        try:
            cpus = os.sched_getaffinity(tid)
        except OSError:
            continue
        if cpus != unbound:
            out.setdefault(cpu_list(cpus), []).append(ns)
    return {k: sorted(v) for k, v in sorted(out.items())}


@dataclass
class Applied:
    """What :func:`apply` did: ``bound`` threads put back on their CPUs; ``missing``: recorded
    namespace thread IDs not found in the restored tree, or refused by the kernel;
    ``foreign``: ``{CPU list: threads}`` left unbound because the list names
    CPUs this process may not use (another host's CPUs)."""

    bound: int = 0
    missing: list[int] = field(default_factory=list)
    foreign: dict[str, int] = field(default_factory=dict)

    def note(self) -> str | None:
        """One line for the operator when something was left unbound, else None."""
        parts = []
        if self.foreign:
            have = cpu_list(os.sched_getaffinity(0))
            parts.append(f"{sum(self.foreign.values())} thread(s) bound at snapshot time to CPUs this host does not "
                         f"offer ({', '.join(self.foreign)}; available: {have}) run on any CPU")
        if self.missing:
            parts.append(f"{len(self.missing)} recorded thread(s) not found in the restored tree")
        return "; ".join(parts) or None


def apply(root_pid: int, recorded: dict[str, list[int]]) -> Applied:
    """Put the recorded binding (:func:`record`) back on ``root_pid``'s restored tree. Never
    raises for a thread or CPU it cannot bind: those are counted in the result."""
    res = Applied()
    if not recorded:
        return res
    usable = os.sched_getaffinity(0)
    host_tid = {ns: tid for tid, ns in tree_threads(root_pid)}
    for cpus_s, nstids in recorded.items():
        cpus = parse_cpu_list(cpus_s)
        if not cpus <= usable:
            res.foreign[cpus_s] = len(nstids)
            continue
        for ns in nstids:
            tid = host_tid.get(ns)
            try:
                if tid is None:
                    raise ProcessLookupError
                os.sched_setaffinity(tid, cpus)
                res.bound += 1
            except OSError:
                res.missing.append(ns)
    return res
