"""``up``, ``down`` and ``status``: bring a snapshot (or a cold engine) to the public port.

``up(name)`` runs, each phase timed (the breakdown of seed 000 section 10):

1. pre-flight: the engine is not already up (then ``up`` changes nothing); the public and
   internal ports are free; CRIU usable — all before anything is written or restored;
2. find the snapshot ``NAME:TAG`` in the store; with none, say why and cold-start instead;
3. ``materialize``: every chunk fetched and verified against its digest (a corrupt chunk stops
   ``up`` here, naming the chunk), the image directory written, ``/dev/shm`` files and bundled
   files put back, required files checked;
4. ``restore``: CRIU restores the tree (new host PIDs, its own PID namespace); on GPU profiles
   ``gpu_restore`` restores and unlocks every rank's CUDA state;
5. ``health``; ``weights`` when the snapshot kept weights outside the image (woken from sleep
   and copied back in place, GB/s reported); then ``canary``: the canary replayed and compared
   bit for bit with the record; on any mismatch the tree is killed, its ``/dev/shm`` files
   removed, and :class:`CanaryMismatch` raised — the public port never opens;
6. ``gate``: the public port opens (:mod:`warmctl.gate`).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from warmctl import snapshot as snap
from warmctl.checkpoint import capture, criu
from warmctl.catalog import Catalog
from warmctl.config import Settings
from warmctl.engine import canary, vllm
from warmctl.engine.sleep import SleepClient, resume
from warmctl.errors import HostError, SnapshotNotFound, WarmctlError
from warmctl.gate import require_port_free
from warmctl.host import fingerprint
from warmctl.gate import start as start_gate
from warmctl.manifest import Manifest
from warmctl.profile import Profile
from warmctl.progress import Reporter
from warmctl.state import EngineState, all_states
from warmctl.state import load as load_state
from warmctl.state import remove as remove_state
from warmctl.state import save as save_state
from warmctl.store import open_store


@dataclass
class UpResult:
    """Outcome of :func:`up`. ``path`` is ``"restore"``, ``"cold"`` or ``"already-up"``;
    ``timings`` are seconds by phase; ``reason`` says why the cold path was taken."""

    state: EngineState
    path: str
    timings: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    snapshot_digest: str | None = None


def _public(profile: Profile, settings: Settings, port: int | None, host: str | None) -> tuple[str, int]:
    return (host or settings.gate_host or profile.gate.host,
            port or settings.gate_port or profile.gate.port)


def _cleanup(st: EngineState) -> None:
    """Kill the gate and the engine tree of ``st`` and remove its ``/dev/shm`` files."""
    if st.gate_alive():
        vllm.kill_tree(st.gate_pid, timeout_s=5)
    live_shm: list[Path] = []
    live_inodes: set[tuple[int, int]] = set()
    if st.engine_alive():  # never act on a PID that now belongs to another process
        live_shm = capture.referenced_files(st.root_pid).shm
        live_inodes = capture.shm_inodes_of(st.root_pid)  # semaphores mapped under removed names
        vllm.kill_tree(st.root_pid)
    for p in live_shm:
        p.unlink(missing_ok=True)
    # restored files are removed by inode, never by name: CRIU consumed the link_remap.N names at
    # restore, and another restore on this host may have written the same names since
    for f in ([] if st.shm_inodes else st.shm_files):
        Path(f).unlink(missing_ok=True)
    capture.remove_by_inode(live_inodes | {tuple(x) for x in st.shm_inodes})
    if st.started_at:
        for p in capture.orphaned_shm(st.started_at - 1):
            p.unlink(missing_ok=True)


def _materialize(store, m: Manifest, images: Path, reporter: Reporter, cache=None) -> tuple[list[str], list[tuple[int, int]]]:
    """Write the manifest's files back (see module doc). Returns the ``/dev/shm`` paths written
    and their (st_dev, st_ino).

    ``cache``: a local store that keeps chunks read from a remote ``store``.
    Raises :class:`IntegrityError` (from the store) on a bad chunk, :class:`HostError` when a
    required file is missing/changed or a ``/dev/shm`` file of the snapshot already exists
    (another restore of it is running on this host).
    """
    problems = capture.missing_or_changed(m.restore.get("required_files", {}))
    if problems:
        raise HostError("this host lacks files the snapshot's processes map (install the same engine "
                        "environment at the same path):\n  " + "\n  ".join(problems[:10]))
    shm_targets = [capture.SHM / f.path for f in m.files if f.role == "shm"]
    clash = [str(p) for p in shm_targets if p.exists()]
    if clash:
        raise HostError(f"shared-memory files of this snapshot already exist ({', '.join(clash[:3])}): "
                        "another restore of it is running on this host; `warmctl down` it first")
    if images.exists():
        shutil.rmtree(images)
    images.mkdir(parents=True)
    total = m.total_size()
    advance = reporter.bytes_progress("materialize", total)
    written_shm: list[str] = []
    try:
        for f in sorted(m.files, key=lambda f: f.hardlink_to is not None):
            if f.role == "image":
                dest = images / f.path
            elif f.role == "shm":
                dest = capture.SHM / f.path
                written_shm.append(str(dest))
            elif f.role == "file":
                dest = Path("/") / f.path
                if dest.is_file() and dest.stat().st_size == f.size:
                    advance(f.size)
                    continue
            else:  # "weights": loaded into the restored engine (warmctl.engine.worker_ext)
                dest = images.parent / "weights" / Path(f.path).name
            if f.hardlink_to is not None:
                os.link(dest.parent / f.hardlink_to, dest)
                continue
            store.read_file(f.chunks, dest, progress=advance, cache=cache)
            os.chmod(dest, f.mode)
        inodes = [(x.st_dev, x.st_ino) for x in map(os.stat, written_shm)]
    except BaseException:
        for p in written_shm:
            Path(p).unlink(missing_ok=True)
        raise
    return written_shm, inodes


def up(name: str, settings: Settings, reporter: Reporter, *, tag: str = "latest",
       profile: Profile | None = None, public_port: int | None = None, public_host: str | None = None,
       snapshot_after: bool = False, insecure: bool = False) -> UpResult:
    """Bring ``name`` up on its public port (see module doc). Idempotent: an engine already up
    is left alone and reported (``path="already-up"``).

    The snapshot is chosen by the catalog's rules for this host's fingerprint and its signature
    verified before anything is written (:meth:`warmctl.catalog.Catalog.resolve`);
    ``insecure`` turns an unsigned or untrusted snapshot into a loud warning instead of an error.
    ``profile`` is needed for the cold path (no snapshot) and to check that a snapshot was made
    from the same profile; without it, the snapshot's embedded profile is used.
    Raises :class:`HostError` (pre-flight), :class:`SnapshotNotFound` (no snapshot and no
    profile), :class:`warmctl.trust.TrustError`, :class:`IntegrityError`,
    :class:`CheckpointError`, :class:`CanaryMismatch`.
    """
    existing = load_state(settings.run_dir, name)
    if existing and existing.engine_alive() and existing.gate_alive():
        return UpResult(existing, "already-up")
    if existing:  # left over from a crash or a dead engine: clean before starting again
        _cleanup(existing)
        remove_state(settings.run_dir, name)

    local = open_store(settings.store_dir)
    # the catalog (remote store when configured) decides; chunks then stream from it through the
    # local store, which keeps them as a cache for the next up
    store = local if settings.catalog_url == str(settings.store_dir) else open_store(settings.catalog_url)
    reason = ""
    manifest = None
    try:
        fp = fingerprint(criu=settings.criu)
        res = Catalog(store).resolve(name, fp, settings.keys_dir, tag=tag,
                                     insecure=insecure, driver=settings.match_driver)
        manifest, digest = res.manifest, res.entry.manifest
        if res.verification.warning:
            reporter.info(f"[bold red]{res.verification.warning}[/]")
    except SnapshotNotFound as e:
        reason = str(e)
    if manifest is not None and profile is not None and manifest.profile_digest != profile.digest():
        reason = (f"snapshot {name}:{tag} ({digest[:19]}) was made from a different profile "
                  f"({manifest.profile_digest[:19]} != {profile.digest()[:19]})")
        manifest = None
    if manifest is None:
        if profile is None:
            raise SnapshotNotFound(f"{reason}; and no profile named {name} to cold-start from")
        return _cold_up(profile, settings, reporter, public_port, public_host, reason, snapshot_after, tag)

    prof = Profile.model_validate(manifest.profile)
    host_, port = _public(prof, settings, public_port, public_host)
    require_port_free(host_, port, "public port")
    require_port_free("127.0.0.1", prof.engine.port, "engine port")
    criu.check(settings.criu)

    run = snap.engine_dir(settings, name)
    log_path = Path(manifest.restore.get("log_path", run / "engine.log"))
    st = EngineState(name=name, phase="restoring", source="restore", manifest_digest=digest, started_at=time.time(),
                     profile_digest=manifest.profile_digest, internal_port=prof.engine.port,
                     public_host=host_, public_port=port, served_model_name=prof.engine.served_model_name,
                     log_path=str(log_path))
    images = run / "images"
    try:
        # one CRIU operation per host from the first /dev/shm file written until CRIU has
        # consumed its link_remap files (see criu.host_lock)
        with criu.host_lock(on_wait=lambda: reporter.info("waiting for another CRIU dump/restore on this host")):
            with reporter.phase("materialize", f"verifying and writing {manifest.total_size() / 2**20:,.0f} MiB"):
                st.shm_files, st.shm_inodes = _materialize(store, manifest, images, reporter,
                                                           cache=None if store is local else local)
                for p in (log_path.parent, Path(manifest.restore.get("cwd", run))):
                    p.mkdir(parents=True, exist_ok=True)
                log_path.touch()
            save_state(settings.run_dir, st)
            with reporter.phase("restore", "CRIU restore of the process tree"):
                st.set_root(criu.restore(images, run / "engine.pid", log_file=run / "restore.log",
                                          binary=settings.criu)[0])
        st.phase = "health"
        save_state(settings.run_dir, st)
        eng = vllm.EngineProcess(None, st.root_pid, prof.engine.port, log_path)
        if prof.checkpoint.cuda:
            with reporter.phase("gpu_restore", "CUDA restore and unlock of every rank"):
                _restore_gpu(st.root_pid, manifest, prof, fp, eng.base_url)
        with reporter.phase("health", "waiting for /health"):
            vllm.wait_healthy(eng, 120)
        if prof.checkpoint.weights_outside_image or prof.checkpoint.sleep_level:
            _resume(eng, manifest, prof, run / "weights", reporter)
        st.phase = "canary"
        with reporter.phase("canary", "replaying the canary, bit for bit"):
            canary.verify(manifest.canary, eng.base_url, prof.canary, prof.engine.served_model_name)
        with reporter.phase("gate", f"opening {host_}:{port}"):
            st.set_gate(start_gate(host_, port, prof.engine.port, st.root_pid, run / "gate.log"))
    except BaseException:
        st.phase = "failed"
        _cleanup(st)
        remove_state(settings.run_dir, name)
        raise
    finally:
        shutil.rmtree(images, ignore_errors=True)
        shutil.rmtree(run / "weights", ignore_errors=True)
    st.phase = "serving"
    st.timings = {p.name: p.seconds for p in reporter.phases}
    st.timings["total"] = sum(st.timings.values())
    save_state(settings.run_dir, st)
    return UpResult(st, "restore", st.timings, snapshot_digest=digest)


def _restore_gpu(root_pid: int, m: Manifest, prof: Profile, fp, base_url: str) -> None:
    """After CRIU restored the processes: check free GPU memory, restore and unlock every rank
    (GPU UUIDs remapped when this host's differ), then rebuild what vLLM's checkpoint hooks
    released. On failure the ranks are killed (the caller cleans the rest). Not run on CPU-only
    hosts.
    """
    from warmctl.checkpoint import ranks

    g = m.restore["gpu"]
    pids = ranks.restored_ranks(root_pid, g["nspids"])
    pairs = ranks.default_gpu_pairs([x["uuid"] for x in m.host.get("gpus", [])], [x.uuid for x in fp.gpus])
    ranks.restore_ranks(pids, pairs, g["gpu_bytes"])
    with SleepClient(base_url) as sc:
        sc.checkpoint_restore()


def _resume(eng: vllm.EngineProcess, m: Manifest, prof: Profile, weights_dir: Path, reporter: Reporter) -> None:
    """Wake a restored engine and load its weights back in place when the snapshot kept them
    outside the image (:func:`warmctl.engine.sleep.resume`); reports the load in GB/s."""
    w = m.restore.get("weights") if prof.checkpoint.weights_outside_image else None
    desc = (f"loading {w['bytes'] / 2**20:,.1f} MiB of weights into {len(w['ranks'])} rank(s)" if w
            else f"waking the engine from sleep level {prof.checkpoint.sleep_level}")
    with reporter.phase("weights", desc), SleepClient(eng.base_url) as sc:
        reload = resume(sc, prof.checkpoint.sleep_level, weights_dir if w else None)
    if reload is not None and reload.gb_per_s is not None:
        reporter.info(f"weights: {reload.nbytes / 1e9:.3f} GB loaded in place in {reload.seconds:.2f} s "
                      f"({reload.gb_per_s:.2f} GB/s)")


def _cold_up(profile: Profile, settings: Settings, reporter: Reporter, public_port: int | None,
             public_host: str | None, reason: str, snapshot_after: bool, tag: str) -> UpResult:
    host_, port = _public(profile, settings, public_port, public_host)
    require_port_free(host_, port, "public port")
    snap.preflight(profile, settings)
    reporter.info(f"[yellow]cold start:[/] {reason}")
    if snapshot_after:
        criu.check(settings.criu)
    started = time.time()
    eng, startup = snap.cold_start(profile, settings, reporter)
    st = EngineState(name=profile.name, phase="canary", source="cold", profile_digest=profile.digest(), started_at=started,
                     internal_port=profile.engine.port, public_host=host_,
                     public_port=port, served_model_name=profile.engine.served_model_name,
                     log_path=str(eng.log_path))
    st.set_root(eng.root_pid)
    save_state(settings.run_dir, st)
    digest = None
    try:
        record = snap.warm_and_record(eng, profile, reporter)
        if snapshot_after:
            res = snap.checkpoint(eng, profile, settings, record, startup, reporter, tag=tag, leave_running=True)
            digest = res.digest
            reporter.info(f"snapshot {profile.name}:{tag} = {digest}")
        st.shm_files = [str(p) for p in capture.referenced_files(eng.root_pid).shm]
        with reporter.phase("gate", f"opening {host_}:{port}"):
            st.set_gate(start_gate(host_, port, profile.engine.port, eng.root_pid,
                                   snap.engine_dir(settings, profile.name) / "gate.log"))
    except BaseException:
        _cleanup(st)
        remove_state(settings.run_dir, profile.name)
        raise
    st.phase = "serving"
    st.timings = {**startup, **{p.name: p.seconds for p in reporter.phases}}
    save_state(settings.run_dir, st)
    return UpResult(st, "cold", st.timings, reason=reason, snapshot_digest=digest)


def down(name: str, settings: Settings) -> EngineState | None:
    """Stop ``name``: close the gate, kill the engine tree, remove its ``/dev/shm`` files and
    state. Returns the state it stopped, or None if nothing of that name was recorded."""
    st = load_state(settings.run_dir, name)
    if st is None:
        return None
    _cleanup(st)
    remove_state(settings.run_dir, name)
    return st


@dataclass
class EngineStatus:
    """``state`` plus live facts: processes alive, ``/health`` answering."""

    state: EngineState
    engine_alive: bool
    gate_alive: bool
    healthy: bool


def status(settings: Settings, name: str | None = None) -> list[EngineStatus]:
    """Status of every recorded engine (or just ``name``)."""
    out = []
    for st in all_states(settings.run_dir):
        if name and st.name != name:
            continue
        healthy = False
        if st.engine_alive():
            try:
                healthy = httpx.get(f"http://127.0.0.1:{st.internal_port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
        out.append(EngineStatus(st, st.engine_alive(), st.gate_alive(), healthy))
    return out


def snapshots(settings: Settings) -> list[tuple[str, str, str, Manifest]]:
    """Every tagged snapshot in the local store: (name, tag, digest, manifest)."""
    store = open_store(settings.store_dir)
    out = []
    for name, tag, digest in store.list_tags():
        try:
            out.append((name, tag, digest, store.get_manifest(digest)))
        except WarmctlError:
            continue
    return out

