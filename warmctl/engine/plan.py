"""The checkpoint flavours of a profile as one plan: what runs before the dump, the dump itself,
after a dump that leaves the source engine serving, and after a restore.

A profile's ``[checkpoint]`` table picks the flavour (see :class:`warmctl.records.profile.Checkpoint`):

- ``weights_outside_image``: before the dump every rank saves its weights as the engine laid
  them out (:meth:`warmctl.engine.sleep.SleepClient.save_weights`) and frees them (or sleep
  level 2 drops them); after a restore they are loaded back in place;
- ``sleep_level``: vLLM sleep mode around the checkpoint (GPU engines; woken after);
- ``cuda``: every GPU rank locked and checkpointed through the CUDA driver around the CRIU dump
  (:mod:`warmctl.checkpoint.ranks`), restored and unlocked after the CRIU restore;
- ``hardware.vendor = "amd"``: no GPU step of its own. CRIU's amdgpu plugin saves and restores
  the GPU state inside ``criu dump`` / ``criu restore`` (:attr:`CheckpointPlan.criu_plugins`);
  the dump records the VRAM each GPU held (KFD's per-process counters), and
  :meth:`CheckpointPlan.before_restore` checks free VRAM per GPU before CRIU starts, since the
  plugin allocates it during the restore. Not run on AMD hardware (docs/gpu.md).

The snapshot pipeline calls :meth:`CheckpointPlan.before_dump`, :meth:`~CheckpointPlan.dump`
and (leave-running only) :meth:`~CheckpointPlan.after_dump` (:func:`warmctl.pipelines.snapshot.snapshot_engine`); ``up`` calls
:meth:`~CheckpointPlan.before_restore` (pre-flight, before anything is written),
:meth:`~CheckpointPlan.after_restore` (before ``/health``) and :meth:`~CheckpointPlan.wake`
(after it). A plain CPU profile makes each of them a CRIU dump or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from warmctl.checkpoint import criu
from warmctl.records.config import Settings
from warmctl.engine.run import EngineRun
from warmctl.base.errors import CheckpointError, EngineError
from warmctl.records.manifest import GpuRestore, RankWeights, RestoreInfo, WeightsRestore
from warmctl.records.profile import Profile
from warmctl.records.progress import Reporter


@dataclass(frozen=True)
class CheckpointPlan:
    """The flavour of one profile's checkpoint (see module doc). ``lock_timeout_s``: the CUDA
    driver's lock timeout per rank, seconds. ``libcuda``/``cuda_checkpoint``/``libnvml``: the
    NVIDIA driver library, ``cuda-checkpoint`` utility and NVML library the GPU steps load (the
    settings of those names; None: the defaults of :mod:`warmctl.checkpoint.cuda` and
    :mod:`warmctl.checkpoint.nvml`)."""

    name: str
    cuda: bool = False
    sleep_level: int = 0
    weights_outside_image: bool = False
    lock_timeout_s: float = 30.0
    vendor: str = "nvidia"
    libcuda: str | None = None
    cuda_checkpoint: str | None = None
    libnvml: str | None = None

    @classmethod
    def of(cls, profile: Profile, settings: Settings | None = None) -> "CheckpointPlan":
        """The plan of ``profile``'s ``[checkpoint]`` table (and ``hardware.vendor``), loading the
        GPU libraries ``settings`` names (None: the defaults)."""
        c = profile.checkpoint
        libs = {} if settings is None else {"libcuda": settings.libcuda, "cuda_checkpoint": settings.cuda_checkpoint,
                                            "libnvml": settings.libnvml}
        return cls(profile.name, c.cuda, c.sleep_level, c.weights_outside_image, c.lock_timeout_s,
                   profile.hardware.vendor, **libs)

    @property
    def criu_plugins(self) -> tuple[str, ...]:
        """CRIU plugins the dump and restore load: ``("amdgpu_plugin.so",)`` for AMD GPUs, else
        none (the CUDA checkpoint runs around CRIU, not inside it)."""
        return ("amdgpu_plugin.so",) if self.vendor == "amd" else ()

    def steps(self) -> list[str]:
        """The checkpoint's steps in order, by name (for ``snapshot --dry-run``-style listings
        and tests): snapshot side, then restore side."""
        out = ["weights_save"] if self.weights_outside_image else []
        if self.sleep_level and (self.cuda or self.vendor == "amd"):
            out.append(f"sleep({self.sleep_level})")
        if self.cuda:
            out += ["checkpoint_prepare", "cuda_lock", "cuda_checkpoint"]
        out.append("criu_dump" + (f"[{','.join(self.criu_plugins)}]" if self.criu_plugins else ""))
        if self.vendor == "amd":
            out.append("vram_preflight")
        out.append("criu_restore" + (f"[{','.join(self.criu_plugins)}]" if self.criu_plugins else ""))
        if self.cuda:
            out += ["gpu_memory_preflight", "cuda_restore", "cuda_unlock", "checkpoint_restore"]
        if self.wakes:
            out.append("wake" + ("+weights_load" if self.weights_outside_image else ""))
        return out

    @property
    def wakes(self) -> bool:
        """True when the engine comes out of a checkpoint frozen (asleep or without weights)
        and must be woken: after a restore, and after a dump that leaves it running."""
        return self.weights_outside_image or bool(self.sleep_level)

    # --- snapshot side --------------------------------------------------------------------

    def before_dump(self, run: EngineRun, reporter: Reporter) -> WeightsRestore | None:
        """With ``weights_outside_image``: every rank writes its weights to ``run.weights``, then
        (without sleep mode) frees them; returns the manifest's ``restore.weights`` record.
        Otherwise nothing (None). Raises :class:`warmctl.base.errors.EngineError` from the engine."""
        if not self.weights_outside_image:
            return None
        from warmctl.engine.sleep import SleepClient  # the engine's sleep and weights endpoints: only sleep and weights profiles

        with reporter.phase("weights_save", "every rank saves its weights as laid out, outside the image"), \
                SleepClient(run.base_url) as sc:
            ranks_ = sc.save_weights(run.weights)
            refused = [r["refused"] for r in ranks_ if r.get("refused")]
            if refused:  # the engine keeps weights where no file can hold them (worker_ext module doc)
                raise EngineError(refused[0])
            if not self.sleep_level:
                sc.release_weights()  # with sleep mode, level 2 in dump() drops them
        w = WeightsRestore(
            bytes=sum(r["bytes"] for r in ranks_), tensors=sum(r["tensors"] for r in ranks_),
            save_s=max(r["seconds"] for r in ranks_),
            ranks=[RankWeights(rank=r["rank"], file=f"weights/{Path(r['path']).name}", bytes=r["bytes"])
                   for r in ranks_])
        reporter.info(f"weights: {w.bytes / 2**20:,.1f} MiB in {w.tensors} tensors over {len(w.ranks)} rank(s), "
                      "kept out of the image")
        return w

    def dump(self, run: EngineRun, leave_running: bool, criu_bin: str | None = None,
             timeout_s: float | None = None) -> GpuRestore | None:
        """CRIU dump of ``run``'s tree into ``run.images``; with ``cuda`` first optional vLLM
        sleep, then every rank locked and checkpointed through the driver around the dump
        (rolled back if anything fails). Returns what the GPU restore needs (``cuda``) or None.
        ``timeout_s``: the bound of ``criu dump`` (None: derived from the tree's memory,
        :func:`warmctl.checkpoint.criu.dump_timeout`; past it
        :class:`~warmctl.checkpoint.criu.DumpTimeout`).
        Raises :class:`CheckpointError`. The GPU part is not run on CPU-only hosts (no GPU was
        available to this project's CI; ``scripts/gpu-check.sh`` exercises the parts)."""
        if self.vendor == "amd":
            return self._dump_amd(run, leave_running, criu_bin, timeout_s)
        if not self.cuda:
            criu.dump(run.root_pid, run.images, leave_running=leave_running, binary=criu_bin, timeout_s=timeout_s)
            return None
        from warmctl.checkpoint import cuda, ranks

        pids = ranks.gpu_rank_pids(run.root_pid, nvml_path=self.libnvml)
        if not pids:
            raise CheckpointError(f"profile {self.name} asks for a CUDA checkpoint, but no process of "
                                  f"the engine (pid {run.root_pid}) holds a GPU")
        from warmctl.engine.sleep import SleepClient

        with SleepClient(run.base_url) as sc:
            if self.sleep_level:
                sc.sleep(self.sleep_level)
            sc.checkpoint_prepare()
        with ranks.checkpoint_ranks(pids, self.lock_timeout_s, api=cuda.load(self.libcuda, self.cuda_checkpoint),
                                    nvml_path=self.libnvml) as rep:
            criu.dump(run.root_pid, run.images, leave_running=leave_running, binary=criu_bin, timeout_s=timeout_s)
        return GpuRestore(nspids=list(rep.nspids.values()), gpu_bytes=rep.gpu_bytes, ranks=rep.to_dict())

    def _dump_amd(self, run: EngineRun, leave_running: bool, criu_bin: str | None,
                  timeout_s: float | None = None) -> GpuRestore:
        """AMD: optional vLLM sleep, the VRAM every GPU holds for the tree recorded (KFD's
        ``proc/<pid>/vram_<gpu_id>``, by the GPU's UUID), then CRIU with the amdgpu plugin."""
        from warmctl import host
        from warmctl.checkpoint import kfd
        from warmctl.base.proc import tree_pids
        from warmctl.engine.sleep import SleepClient

        if self.sleep_level:
            with SleepClient(run.base_url) as sc:
                sc.sleep(self.sleep_level)
        gpus, _, _, reason = host.read_amd_gpus()
        if not gpus:
            raise CheckpointError(f"profile {self.name} is for AMD GPUs, but none is visible: {reason}")
        held = kfd.process_vram(tree_pids(run.root_pid))
        by_id = {g.kfd_gpu_id: g.uuid for g in gpus}
        gpu_bytes = {by_id[gid]: n for gid, n in sorted(held.items()) if gid in by_id}
        criu.dump(run.root_pid, run.images, leave_running=leave_running, binary=criu_bin, plugins=self.criu_plugins,
                  timeout_s=timeout_s)
        return GpuRestore(nspids=[], gpu_bytes=gpu_bytes, ranks={"vendor": "amd", "vram_source": "kfd proc"})

    def after_dump(self, run: EngineRun, reporter: Reporter) -> None:
        """After a dump that left the source engine running: bring it back to serving (rebuild
        the CUDA communicators, wake it, load its weights back). Nothing for a plain profile."""
        if not self.wakes:
            return
        from warmctl.engine.sleep import SleepClient, wake

        with reporter.phase("wake_source", "bringing the source engine back to serving"), \
                SleepClient(run.base_url) as sc:
            if self.cuda:
                sc.checkpoint_restore()
            wake(sc, self.sleep_level, run.weights if self.weights_outside_image else None)

    # --- restore side ---------------------------------------------------------------------

    def before_restore(self, restore: RestoreInfo, reporter: Reporter, sysfs: str | Path | None = None) -> None:
        """Pre-flight before CRIU restores anything (AMD only): every GPU the snapshot used
        needs its recorded VRAM (``restore.gpu.gpu_bytes``) free on a GPU of its own here (free =
        ``mem_info_vram_total - mem_info_vram_used``, :func:`warmctl.checkpoint.kfd.vram_usage`;
        GPUs are paired largest need with most free, as the plugin may map them in any order).
        Raises :class:`CheckpointError` naming the GPUs and bytes; nothing has been written."""
        if self.vendor != "amd":
            return
        from warmctl.checkpoint import kfd

        g = restore.gpu
        need = sorted((g.gpu_bytes if g else {}).values(), reverse=True)
        if not need:
            return
        with reporter.phase("vram_preflight", "free VRAM per GPU"):
            nodes = kfd.read_topology(sysfs)
            free: list[tuple[int, str]] = []
            for n in nodes:
                u = kfd.vram_usage(n, sysfs)
                if u is None:
                    raise CheckpointError(f"cannot read the free VRAM of AMD GPU node {n.node} (gpu_id {n.gpu_id}) "
                                          f"from {kfd.sysfs_root(sysfs)}/class/drm/renderD{n.prop('drm_render_minor')}/device")
                free.append((u[0] - u[1], f"node {n.node}"))
            free.sort(reverse=True)
            if len(free) < len(need) or any(f < b for b, (f, _) in zip(need, free)):
                have = ", ".join(f"{w}: {f / 2**30:.1f} GiB" for f, w in free) or "no GPU"
                raise CheckpointError(
                    f"not enough free VRAM to restore {self.name}: the snapshot's GPUs held "
                    f"{', '.join(f'{b / 2**30:.1f}' for b in need)} GiB; free here: {have}")

    def after_restore(self, run: EngineRun, restore: RestoreInfo, snapshot_gpus: list[str],
                      host_gpus: list[str], reporter: Reporter) -> None:
        """After CRIU restored the processes, before ``/health`` (``cuda`` only): check free GPU
        memory, restore and unlock every rank (GPU UUIDs remapped when this host's differ:
        ``snapshot_gpus`` / ``host_gpus`` in index order), then rebuild what vLLM's checkpoint
        hooks released. On failure the ranks are killed (the caller tears the run down). Not
        run on CPU-only hosts."""
        if not self.cuda:
            return
        from warmctl.checkpoint import cuda, ranks
        from warmctl.engine.sleep import SleepClient

        g = restore.gpu
        if g is None:
            raise CheckpointError(f"snapshot of {self.name} has no GPU restore record (restore.gpu)")
        with reporter.phase("gpu_restore", "CUDA restore and unlock of every rank"):
            pids = ranks.restored_ranks(run.root_pid, g.nspids)
            ranks.restore_ranks(pids, ranks.default_gpu_pairs(snapshot_gpus, host_gpus, g.gpu_bytes or None), g.gpu_bytes,
                                api=cuda.load(self.libcuda, self.cuda_checkpoint), nvml_path=self.libnvml)
            with SleepClient(run.base_url) as sc:
                sc.checkpoint_restore()

    def wake(self, run: EngineRun, restore: RestoreInfo, reporter: Reporter) -> None:
        """After ``/health`` of a restored engine: wake it from sleep and load its weights back
        in place when the snapshot kept them outside the image (from ``run.weights``); reports
        the load in GB/s. Nothing for a plain profile."""
        if not self.wakes:
            return
        from warmctl.engine.sleep import SleepClient, wake

        w = restore.weights if self.weights_outside_image else None
        desc = (f"loading {w.bytes / 2**20:,.1f} MiB of weights into {len(w.ranks)} rank(s)" if w
                else f"waking the engine from sleep level {self.sleep_level}")
        with reporter.phase("weights", desc), SleepClient(run.base_url) as sc:
            reload = wake(sc, self.sleep_level, run.weights if w else None)
        if reload is not None and reload.gb_per_s is not None:
            reporter.info(f"weights: {reload.nbytes / 1e9:.3f} GB loaded in place in {reload.seconds:.2f} s "
                          f"({reload.gb_per_s:.2f} GB/s)")
