"""The snapshot pipeline: cold start, warm up, record the canary, CRIU-dump, store.

``snapshot(profile)`` runs, each phase timed:

1. pre-flight: CRIU usable, the engine's internal port free, no engine of that name running;
2. cold start in its own PID namespace with io_uring blocked (:mod:`warmctl.engine.vllm`),
   wait for ``/health``, parse the start-up log into phases (weights, torch.compile, ...);
3. the warm-up grid (:mod:`warmctl.engine.warmup`), then the canary (:mod:`warmctl.engine.canary`);
   with ``checkpoint.weights_outside_image`` every rank then saves its weights as the engine laid
   them out and drops them from memory (:mod:`warmctl.engine.worker_ext`); they are stored as
   ``weights`` files, not as image pages;
4. CRIU dump of the whole tree (:mod:`warmctl.checkpoint.criu`); capture of ``/dev/shm`` files
   and of files the tree maps outside the interpreter and OS (:mod:`warmctl.checkpoint.capture`);
5. every file chunked into the content-addressed store; the manifest is written last, then
   tagged ``NAME:TAG``. A failure at any point leaves no manifest and no tag (chunks already
   written are unreferenced and ``warmctl gc`` removes them), no process and no ``/dev/shm``
   file of the tree.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from warmctl import host, tinymodel, trust
from warmctl.catalog import Catalog
from warmctl.checkpoint import capture, criu
from warmctl.config import Settings
from warmctl.engine import canary, vllm, warmup
from warmctl.engine.sleep import SleepClient, resume
from warmctl.errors import EngineError, HostError
from warmctl.gate import require_port_free
from warmctl.manifest import CanaryRecord, FileEntry, Manifest, Phase
from warmctl.profile import Profile
from warmctl.progress import Reporter
from warmctl.state import load as load_state
from warmctl.store import open_store


@dataclass
class SnapshotResult:
    """What ``snapshot`` produced: manifest digest, the manifest, and its total size in bytes."""

    digest: str
    manifest: Manifest
    size: int


def resolve_model(profile: Profile, settings: Settings) -> str:
    """The model path for ``profile``; builds the ``builtin:tiny`` model on first use.

    Raises :class:`EngineError` if a model path does not exist.
    """
    m = profile.engine.model
    if m == "builtin:tiny":
        return str(tinymodel.build(tinymodel.model_dir(settings.models_dir)))
    if m.startswith("/") or m.startswith("."):
        if not Path(m).exists():
            raise EngineError(f"profile {profile.name}: engine.model {m} does not exist")
    return m


def engine_dir(settings: Settings, name: str) -> Path:
    """``<home>/run/NAME``: the engine's working directory, log and state."""
    d = settings.run_dir / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def signing_key(settings: Settings, reporter: Reporter) -> Path:
    """The key that signs manifests: ``settings.signing_key``, else this host's own key
    ``<home>/keys/local.key``, generated on first use; its public half is then installed as
    ``<keys_dir>/local-<hostname>.pub`` so that snapshots made here are trusted here (and nowhere
    else until an operator copies that file). See :mod:`warmctl.trust`.
    """
    if settings.signing_key:
        return Path(settings.signing_key)
    d = settings.home / "keys"
    key = d / "local.key"
    if not key.exists():
        pair = trust.generate_keypair(d, "local")
        settings.keys_dir.mkdir(parents=True, exist_ok=True)
        dest = settings.keys_dir / f"local-{socket.gethostname()}.pub"
        shutil.copyfile(pair.public, dest)
        reporter.info(f"generated this host's signing key {pair.private} (key id {pair.key_id}); "
                      f"trusted here via {dest}")
    return key


def preflight(profile: Profile, settings: Settings) -> None:
    """Refuse early: an engine of this name already recorded as running, or the port taken."""
    st = load_state(settings.run_dir, profile.name)
    if st and st.engine_alive():
        raise HostError(f"engine {profile.name} is running (pid {st.root_pid}); `warmctl down {profile.name}` first")
    require_port_free("127.0.0.1", profile.engine.port, f"engine port for {profile.name}:")


def cold_start(profile: Profile, settings: Settings, reporter: Reporter) -> tuple[vllm.EngineProcess, dict[str, float]]:
    """Start the engine cold and wait until healthy. Returns (engine, start-up phases in seconds).

    On failure the tree is killed and :class:`EngineError` raised (with the log's tail).
    """
    model = resolve_model(profile, settings)
    d = engine_dir(settings, profile.name)
    log_path = d / "engine.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    eng = vllm.start(profile, model, log_path, cwd=d)
    try:
        with reporter.phase("cold_start", f"starting {profile.engine.kind} for {profile.name} (log: {log_path})"):
            total = vllm.wait_healthy(eng, profile.engine.startup_timeout_s)
    except BaseException:
        vllm.kill_tree(eng.root_pid)
        raise
    with open(log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return eng, vllm.parse_startup_phases(text, total_s=total)


def warm_and_record(eng: vllm.EngineProcess, profile: Profile, reporter: Reporter) -> CanaryRecord:
    """Run the warm-up grid, then record the canary."""
    with reporter.phase("warmup", f"warm-up grid: {len(profile.warmup.cells())} cells"):
        warmup.run_grid(eng.base_url, profile.engine.served_model_name, profile.warmup)
    with reporter.phase("canary_record", f"recording canary ({len(profile.canary.prompts)} prompts)"):
        return canary.run(eng.base_url, profile.canary, profile.engine.served_model_name)


def checkpoint(eng: vllm.EngineProcess, profile: Profile, settings: Settings, record: CanaryRecord,
               startup: dict[str, float], reporter: Reporter, tag: str = "latest",
               leave_running: bool = False) -> SnapshotResult:
    """Dump the engine tree with CRIU and write everything into the store (see module doc).

    With ``leave_running`` the engine keeps serving after the dump; otherwise CRIU kills it.
    Raises :class:`warmctl.errors.CheckpointError` or the store's errors; in every case the
    temporary image directory is removed, and without ``leave_running`` the tree and its
    ``/dev/shm`` files are gone.
    """
    store = open_store(settings.store_dir)
    d = engine_dir(settings, profile.name)
    work = Path(tempfile.mkdtemp(prefix=f"snap-{profile.name}-", dir=settings.home))
    images = work / "images"
    shm_files: list[Path] = []
    remap_inodes: list[tuple[int, int]] = []
    gpu: dict | None = None
    weights_dir = work / "weights" if profile.checkpoint.weights_outside_image else None
    weights: dict | None = None
    try:
        time.sleep(0.2)  # let in-flight responses finish before freezing (requests are all done)
        if weights_dir is not None:
            with reporter.phase("weights_save", "every rank saves its weights as laid out, outside the image"):
                weights = _save_weights(eng, profile, weights_dir)
            reporter.info(f"weights: {weights['bytes'] / 2**20:,.1f} MiB in {weights['tensors']} tensors "
                          f"over {len(weights['ranks'])} rank(s), kept out of the image")
        files = capture.referenced_files(eng.root_pid, exclude=[d])
        shm_files = list(files.shm)
        links: dict[Path, Path | None] = {}
        entries: list[FileEntry] = []
        items: list[tuple[Path, str, str]] = []  # (source, role, path in manifest)
        with reporter.phase("criu_dump", f"CRIU dump of pid {eng.root_pid} and its children"), \
                criu.host_lock(on_wait=lambda: reporter.info("waiting for another CRIU dump/restore on this host")):
            shm_before = capture.shm_names()
            if profile.checkpoint.cuda:
                gpu = _dump_with_gpu(eng, profile, images, leave_running, settings.criu)
            else:
                criu.dump(eng.root_pid, images, leave_running=leave_running, binary=settings.criu)
            # CRIU's link_remap.N files leave /dev/shm before the host lock is released: a hard link
            # to a captured file is recorded as such; any other one is copied out first
            remaps = capture.link_remaps_since(shm_before)
            links = capture.group_hardlinks(shm_files + remaps)
            for p in remaps:
                st = p.stat()
                remap_inodes.append((st.st_dev, st.st_ino))
                if links[p] is not None:
                    entries.append(FileEntry(path=p.name, role="shm", size=st.st_size, mode=st.st_mode & 0o7777,
                                             hardlink_to=links[p].name))
                else:
                    (work / "shm").mkdir(exist_ok=True)
                    items.append((Path(shutil.copy2(p, work / "shm" / p.name)), "shm", p.name))
                p.unlink()
        if leave_running and (weights_dir is not None or profile.checkpoint.sleep_level):
            with reporter.phase("resume_source", "bringing the source engine back to serving"), \
                    SleepClient(eng.base_url) as sc:
                if profile.checkpoint.cuda:
                    sc.checkpoint_restore()
                resume(sc, profile.checkpoint.sleep_level, weights_dir)
        for p in sorted(images.iterdir()):
            if p.is_file():
                items.append((p, "image", p.name))
        for p in shm_files:
            if links.get(p) is not None:
                st = p.stat()
                entries.append(FileEntry(path=p.name, role="shm", size=st.st_size, mode=st.st_mode & 0o7777,
                                         hardlink_to=links[p].name))
            else:
                items.append((p, "shm", p.name))
        for p in files.bundled:
            items.append((p, "file", str(p).lstrip("/")))
        for p in sorted(weights_dir.iterdir()) if weights_dir is not None else []:
            items.append((p, "weights", f"weights/{p.name}"))
        total = sum(p.stat().st_size for p, _, _ in items)
        with reporter.phase("store", f"chunking {total / 2**20:,.0f} MiB into {store}"):
            advance = reporter.bytes_progress("store", total)
            for src, role, rel in items:
                st = src.stat()
                chunks = store.add_file(src, progress=advance)
                entries.append(FileEntry(path=rel, role=role, size=st.st_size, mode=st.st_mode & 0o7777, chunks=chunks))
        phases = [Phase(name=k, seconds=v) for k, v in startup.items()] + list(reporter.phases)
        manifest = Manifest(
            name=profile.name,
            profile_digest=profile.digest(),
            profile=profile.model_dump(mode="json"),
            host=host.fingerprint(criu=settings.criu).model_dump(mode="json"),
            canary=record,
            phases=phases,
            restore={
                "log_path": str(eng.log_path),
                "cwd": str(d),
                "internal_port": profile.engine.port,
                "required_files": files.required,
                "images_bytes": sum(p.stat().st_size for p in images.iterdir() if p.is_file()),
                **({"gpu": gpu} if gpu else {}),
                **({"weights": weights} if weights else {}),
            },
            files=entries,
        )
        digest = store.put_manifest(manifest)
        with reporter.phase("publish", f"signing and publishing {profile.name}:{tag}"):
            Catalog(store).publish(digest, manifest, tag=tag, signer=signing_key(settings, reporter))
        return SnapshotResult(digest, manifest, manifest.total_size())
    finally:
        store.close()  # releases the store's writer lock (gc waits for it)
        shutil.rmtree(work, ignore_errors=True)
        if not leave_running:
            vllm.kill_tree(eng.root_pid)
            for p in shm_files:
                Path(p).unlink(missing_ok=True)
            capture.remove_by_inode(remap_inodes)  # the semaphores the remaps stood for


def _save_weights(eng: vllm.EngineProcess, profile: Profile, directory: Path) -> dict:
    """Every rank writes its weights to ``directory`` (:mod:`warmctl.engine.worker_ext`); then,
    on an engine without sleep mode, frees them (with sleep mode, sleep level 2 in
    :func:`_dump_with_gpu` drops them). Returns the manifest's ``restore.weights`` record:
    ``bytes``, ``tensors``, ``ranks`` (per-rank dicts) and ``save_s``. Raises
    :class:`EngineError` from the engine."""
    with SleepClient(eng.base_url) as sc:
        ranks_ = sc.save_weights(directory)
        if not profile.checkpoint.sleep_level:
            sc.release_weights()
    return {"bytes": sum(r["bytes"] for r in ranks_), "tensors": sum(r["tensors"] for r in ranks_),
            "save_s": max(r["seconds"] for r in ranks_),
            "ranks": [{"rank": r["rank"], "file": f"weights/{Path(r['path']).name}", "bytes": r["bytes"]} for r in ranks_]}


def _dump_with_gpu(eng: vllm.EngineProcess, profile: Profile, images: Path, leave_running: bool,
                   criu_bin: str | None = None) -> dict:
    """The GPU path (``checkpoint.cuda``): optional vLLM sleep, then every rank locked and
    checkpointed through the CUDA driver (:mod:`warmctl.checkpoint.ranks`) around the CRIU dump;
    ranks are rolled back (restored and unlocked) if anything fails. Returns what the restore
    needs: namespace PIDs of the ranks and GPU bytes per GPU UUID. Not run on CPU-only hosts
    (no GPU was available to this project's CI; ``scripts/gpu-check.sh`` exercises the parts).
    """
    from warmctl.checkpoint import ranks
    from warmctl.errors import CheckpointError

    pids = ranks.gpu_ranks(eng.root_pid)
    if not pids:
        raise CheckpointError(f"profile {profile.name} asks for a CUDA checkpoint, but no process of "
                              f"the engine (pid {eng.root_pid}) holds a GPU")
    with SleepClient(eng.base_url) as sc:
        if profile.checkpoint.sleep_level:
            sc.sleep(profile.checkpoint.sleep_level)
        sc.checkpoint_prepare()
    with ranks.checkpoint_ranks(pids, profile.checkpoint.lock_timeout_s) as rep:
        criu.dump(eng.root_pid, images, leave_running=leave_running, binary=criu_bin)
    return {"nspids": list(rep.nspids.values()), "gpu_bytes": rep.gpu_bytes, "ranks": rep.to_dict()}


def snapshot(profile: Profile, settings: Settings, reporter: Reporter, tag: str = "latest") -> SnapshotResult:
    """Cold-start ``profile``, warm it up, record its canary and snapshot it into the store.

    Returns the :class:`SnapshotResult`. Raises :class:`HostError` (pre-flight),
    :class:`EngineError` (start-up, warm-up, canary), :class:`warmctl.errors.CheckpointError`
    (CRIU) or store errors; nothing of the engine survives a failure.
    """
    criu.check(settings.criu)
    preflight(profile, settings)
    since = time.time() - 1
    try:
        return _snapshot(profile, settings, reporter, tag)
    finally:
        for p in capture.orphaned_shm(since):
            p.unlink(missing_ok=True)


def _snapshot(profile: Profile, settings: Settings, reporter: Reporter, tag: str) -> SnapshotResult:
    eng, startup = cold_start(profile, settings, reporter)
    try:
        record = warm_and_record(eng, profile, reporter)
    except BaseException:
        vllm.kill_tree(eng.root_pid)
        raise
    return checkpoint(eng, profile, settings, record, startup, reporter, tag=tag)
