"""The snapshot pipeline: cold start, warm up, record the canary, CRIU-dump, store.

``snapshot(profile)`` runs, each phase timed:

1. pre-flight, holding the name's lock (:mod:`warmctl.records.enginelock`: one ``snapshot``/``up``/``down``
   of a name at a time): CRIU usable, no engine of that name serving (what a killed run left is
   torn down), the engine's internal port free; the engine is recorded as soon as it starts;
2. cold start (:mod:`warmctl.engine.cold`): the engine tree in its own PID namespace with
   io_uring blocked, ``/health``, the start-up log parsed into phases (weights, torch.compile,
   ...); then the warm-up grid and the canary record;

then :func:`snapshot_engine`, one short function per phase:

3. ``before_dump`` of the profile's checkpoint plan (:mod:`warmctl.engine.plan`): with
   ``checkpoint.weights_outside_image`` every rank saves its weights as the engine laid them out
   and drops them from memory; they are stored as ``weights`` files, not as image pages;
4. :func:`_dump`: CRIU dump of the whole tree (around the CUDA checkpoint of every rank on GPU
   profiles) under the host's CRIU lock, with the ``/dev/shm`` files and CRIU's ``link_remap``
   files it needs (:mod:`warmctl.checkpoint.capture`); with ``leave_running`` the plan's
   ``after_dump`` then brings the source engine back to serving;
5. :func:`_refuse_secrets`: before anything is stored, every file to store and the manifest
   as it will be written are scanned for every secret value warmctl knows on this host
   (:mod:`warmctl.records.credentials`); a match refuses the snapshot, naming the secret's source and
   the file, and nothing is stored or pushed;
6. :func:`_store_files`: every file chunked into the content-addressed store;
   :func:`_publish`: the manifest (:func:`_build_manifest`) is written last, then signed and
   tagged ``NAME:TAG``.

A failure at any point leaves no manifest and no tag (chunks already written are unreferenced
and ``warmctl gc`` removes them), no process and no ``/dev/shm`` file of the tree: the run is
torn down (:meth:`warmctl.engine.run.EngineRun.teardown`). Scratch files (images, weights) live
in the run directory and are removed in every case.
"""

from __future__ import annotations

import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from warmctl import host
from warmctl.naming import fleet, trust
from warmctl.records import credentials, enginelock
from warmctl.naming.catalog import Catalog, Ref
from warmctl.checkpoint import affinity, capture, criu, filedigest, layout, rankfaults, zeropages
from warmctl.records.config import Settings
from warmctl.engine import cold
from warmctl.engine.plan import CheckpointPlan
from warmctl.engine.run import EngineRun
from warmctl.base.errors import CheckpointError
from warmctl.records.manifest import (CanaryRecord, FileEntry, GpuRestore, Manifest, ParallelLayout, Phase, RestoreInfo,
                              WeightsRestore)
from warmctl.records.profile import Profile
from warmctl.records.progress import Reporter
from warmctl.store import open_store


@dataclass
class SnapshotResult:
    """What ``snapshot`` produced: manifest digest, the manifest, and its total size in bytes."""

    digest: str
    manifest: Manifest
    size: int


def signing_key(settings: Settings, reporter: Reporter) -> Path:
    """The key that signs manifests: ``settings.signing_key``, else this home's own key
    ``<home>/keys/local.key``, generated on first use; its public half is then installed as
    ``<keys_dir>/local-<hostname>-<key id>.pub`` so that snapshots made here are trusted here (and
    nowhere else until an operator copies that file). Named by key id, the file of one home
    never replaces another home's on the same host (:func:`warmctl.naming.trust.install_public_key`).
    When this home's key is not trusted in ``keys_dir`` (trust removed, or a file of the earlier
    ``local-<hostname>.pub`` name replaced), that is said: its snapshots will not restore here.
    See :mod:`warmctl.naming.trust`.
    """
    if settings.signing_key:
        return Path(settings.signing_key)
    d = settings.home / "keys"
    key = d / "local.key"
    if not key.exists():
        pair = trust.generate_keypair(d, "local")
        dest, _ = trust.install_public_key(pair.public, settings.keys_dir, f"local-{_host_stem()}")
        reporter.info(f"generated this home's signing key {pair.private} (key id {pair.key_id}); "
                      f"trusted here via {dest}")
        return key
    try:
        kid = trust.key_id(trust.load_private_key(key).public_key())
        if kid not in trust.load_trusted_keys(settings.keys_dir):
            reporter.warn(f"this home's signing key {key} (key id {kid}) is not trusted in "
                          f"{settings.keys_dir}: its snapshots will not restore on this host; trust it with "
                          f"`warmctl keys trust {d / 'local.pub'}`")
    except trust.TrustError:
        pass  # publish reports an unusable key itself
    return key


def _host_stem() -> str:
    """This host's name as a file name part."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()).lstrip(".") or "host"


def _report_drift(profile: Profile, settings: Settings, tag: str, reporter: Reporter) -> None:
    """Before a snapshot starts: say which fields changed since the snapshot ``NAME:TAG`` it
    replaces in the local store was made (:mod:`warmctl.naming.drift`); nothing when there is none or
    it is current. Never fails the snapshot."""
    from warmctl.naming.drift import against_newest
    from warmctl.base.errors import WarmctlError

    try:
        found = against_newest(settings.store_dir, profile, tag, settings=settings)
    except (WarmctlError, OSError):
        return
    if found is not None and found[1].stale:
        e, d = found
        reporter.info(d.message(f"the snapshot it replaces, {e.name}:{e.tag} ({e.manifest[:19]}),"))


def snapshot(profile: Profile, settings: Settings, reporter: Reporter, tag: str = "latest",
             push_to: str | None = None) -> SnapshotResult:
    """Cold-start ``profile``, warm it up, record its canary and snapshot it into the store;
    with ``push_to`` (a store URL: the fleet's remote), then publish it there (``push`` phase).

    Returns the :class:`SnapshotResult`. Raises :class:`HostError` (pre-flight),
    :class:`EngineError` (start-up, warm-up, canary), :class:`warmctl.base.errors.CheckpointError`
    (CRIU) or store errors; nothing of the engine survives, in any case (CRIU's dump kills it).
    """
    _report_drift(profile, settings, tag, reporter)
    require_ranks_checkpointable(profile, settings)
    with enginelock.hold(settings.run_dir, profile.name, "snapshot",
                         on_wait=lambda o: reporter.info(f"waiting for the {o.op if o else 'other'} of {profile.name} "
                                                         "already running on this host")):
        cold.preflight(profile, settings.run_dir)
        run = EngineRun(settings.run_dir, profile.name, profile.engine.port)
        startup = cold.start(run, profile, cold.resolve_model(profile, settings.models_dir), reporter,
                             settings.engine_env_passthrough)
        try:
            record = cold.warm_and_record(run, profile, reporter, settings.rank_silence_s)
        except BaseException:
            run.teardown()
            raise
        return snapshot_engine(run, profile, settings, record, startup, reporter, tag=tag, push_to=push_to)


def require_ranks_checkpointable(profile: Profile, settings: Settings) -> None:
    """Pre-flight of a snapshot, before any engine starts: CRIU usable; the ranks' CPU binding
    satisfiable here (:func:`warmctl.checkpoint.layout.cpu_binding`); for an engine of several
    ranks (their gloo group holds established loopback TCP connections) a CRIU network-lock
    method on this host (:func:`warmctl.checkpoint.criu.require_network_lock`). Raises
    :class:`warmctl.base.errors.HostError` naming what is missing."""
    binary = criu.check(settings.criu, settings.xtile_perm_lib)
    layout.cpu_binding(profile)
    sizes = layout.profile_sizes(profile)
    if sizes.multi_process:
        criu.require_network_lock(binary, settings.cache_dir, f"profile {profile.name} ({sizes.describe()})")


def snapshot_engine(run: EngineRun, profile: Profile, settings: Settings, record: CanaryRecord,
                    startup: dict[str, float], reporter: Reporter, tag: str = "latest",
                    leave_running: bool = False, push_to: str | None = None) -> SnapshotResult:
    """Dump the running engine ``run`` with CRIU and write everything into the store (see the
    module doc). ``record``: its canary; ``startup``: its cold-start phases (seconds);
    ``push_to``: a store URL to publish the snapshot to once it is in the local store.

    With ``leave_running`` the engine keeps serving after the dump; otherwise it is gone after
    (CRIU kills it; :meth:`EngineRun.teardown` removes what is left, also on failure). Raises
    :class:`warmctl.base.errors.CheckpointError`, :class:`warmctl.base.errors.EngineError` or the store's
    errors; in every case the scratch images and weights are removed.
    """
    plan = CheckpointPlan.of(profile, settings)
    store = open_store(settings.store_dir, settings=settings)
    try:
        time.sleep(0.2)  # let in-flight responses finish before freezing (requests are all done)
        weights = plan.before_dump(run, reporter)
        ranks_ = _ranks(run, profile, settings)
        dumped = _dump(run, plan, leave_running, settings.criu, reporter, ranks_, settings.criu_lock,
                       settings.dump_timeout_s, settings.zero_pages)
        dumped.layout = ranks_
        if leave_running:
            plan.after_dump(run, reporter)
        draft = _build_manifest(run, profile, settings, record, startup, reporter, dumped, weights,
                                list(dumped.links) + [_entry(src, role, rel) for src, role, rel in dumped.items])
        _refuse_secrets(profile, settings, dumped, draft, reporter, push_to)
        entries = _store_files(store, dumped, reporter)
        manifest = draft.model_copy(update={"files": entries, "phases": _phases(startup, reporter)})
        digest = _publish(store, manifest, tag, settings, reporter)
        if push_to:
            _push(store, manifest, digest, tag, push_to, reporter, settings)
        return SnapshotResult(digest, manifest, manifest.total_size())
    finally:
        store.close()  # releases the store's writer lock (gc waits for it)
        if leave_running:
            run.remove_scratch()
        else:
            run.teardown()


@dataclass
class _Dumped:
    """What :func:`_dump` leaves for the store: files to chunk as (source, role, path in the
    manifest), entries that need no chunks (hard links), the files the tree referenced, the GPU
    restore record (CUDA profiles), the images' size in bytes and the tree's bound threads
    (:func:`warmctl.checkpoint.affinity.record`)."""

    files: capture.TreeFiles
    items: list[tuple[Path, str, str]] = field(default_factory=list)
    links: list[FileEntry] = field(default_factory=list)
    gpu: GpuRestore | None = None
    images_bytes: int = 0
    cpu_affinity: dict[str, list[int]] = field(default_factory=dict)
    layout: ParallelLayout | None = None


def _record_shm(run: EngineRun) -> capture.TreeFiles:
    """The files ``run``'s tree references, its ``/dev/shm`` ones recorded on the run (path and
    inode) and saved: whatever happens next (CRIU kills the tree; a rank dies and takes the
    only mapping of its semaphores with it), a teardown removes exactly them."""
    files = capture.referenced_files(run.root_pid, exclude=[run.dir])
    run.shm_files = [str(p) for p in files.shm]
    have = {tuple(x) for x in run.shm_inodes}  # kept: files of processes that died since they were sampled
    run.shm_inodes += [k for st in map(Path.stat, files.shm) if (k := (st.st_dev, st.st_ino)) not in have]
    run.sample_shm()
    run.save()
    return files


def _ranks(run: EngineRun, profile: Profile, settings: Settings) -> ParallelLayout:
    """Right before the dump: every rank the profile's layout names is running and not stopped
    (:func:`warmctl.checkpoint.layout.discover`; :class:`~warmctl.checkpoint.layout.RankError`
    naming a missing one or one stopped for over
    :data:`~warmctl.checkpoint.layout.STOP_GRACE_S` seconds, with its log lines), recorded
    with its namespace PID, CPUs and GPU. A one-rank engine records its one rank (world size
    1: its ``VLLM::Worker`` process, or the engine core), without a network lock or
    listening ports (it holds no rank-to-rank connection: CRIU dumps it as before)."""
    sizes = layout.profile_sizes(profile)
    _record_shm(run)  # a rank found dead below leaves semaphores only it mapped: the teardown needs their inodes
    rankfaults.kill_rank("before_dump", run.root_pid)  # a test's kill -9 / SIGSTOP of a rank (WARMCTL_TEST_KILL_RANK)
    gpus = None
    if profile.hardware.gpu_count:
        from warmctl.checkpoint import nvml

        gpus = {pid: next(iter(used)) for pid, used in nvml.compute_processes(settings.libnvml).items() if used}
    live = layout.discover(run.root_pid, sizes, run.log_path, gpus)
    if not sizes.multi_process:
        return layout.record(live, sizes, layout.cpu_binding(profile), None)
    netlock = criu.network_lock_method(criu.check(settings.criu, settings.xtile_perm_lib), settings.cache_dir)
    return layout.record(live, sizes, layout.cpu_binding(profile), netlock, layout.listening(run.root_pid))


def _dump(run: EngineRun, plan: CheckpointPlan, leave_running: bool, criu_bin: str | None,
          reporter: Reporter, lay: ParallelLayout | None = None, criu_lock: Path | None = None,
          timeout_s: float | None = None, zero_pages: str = "drop") -> _Dumped:
    """The ``criu_dump`` phase: the plan's dump of ``run`` into ``run.images`` under the host's
    CRIU lock, with the ``/dev/shm`` files of the tree recorded on the run (so a teardown finds
    them by inode) and CRIU's ``link_remap.N`` files taken out of ``/dev/shm`` before the lock is
    released: one that is a hard link of a captured file is recorded as such, any other is
    copied to the run's scratch first. Then every file to store is listed. ``criu_lock``: the
    host lock's file (the ``criu_lock`` setting; :func:`warmctl.checkpoint.criu.host_lock`).
    ``timeout_s``: the dump's bound (the ``dump_timeout_s`` setting; None: derived from the
    tree's memory, :func:`warmctl.checkpoint.criu.dump_timeout`); past it
    :class:`~warmctl.checkpoint.criu.DumpTimeout`, CRIU killed and its partial image removed.
    Then, after the lock is released, ``zero_pages`` (the setting: ``drop`` or ``keep``) says
    whether the image's all-zero anonymous pages leave it (the ``zero_pages`` phase,
    :func:`warmctl.checkpoint.zeropages.compact`).

    A dump that fails with a rank of ``lay`` (the layout :func:`_ranks` just checked) gone
    since (a ``kill -9`` of the rank while CRIU ran: CRIU then fails on the dead task) raises
    :class:`~warmctl.checkpoint.layout.RankError` naming the rank, its PID and its log lines,
    CRIU's own error after them. A dump that succeeds with such a rank held as a dead process
    (killed after CRIU seized it, before CRIU had collected the whole tree:
    :func:`~warmctl.checkpoint.criu.dumped_dead`) raises the same. Any other failure: CRIU's
    :class:`~warmctl.base.errors.CheckpointError`. Nothing is stored either way (the caller's
    teardown removes the engine, its images and its ``/dev/shm`` files)."""
    files = _record_shm(run)  # again: what the tree holds now, right before CRIU runs
    out = _Dumped(files, cpu_affinity=affinity.record(run.root_pid))
    roles = {r.role for r in lay.ranks} if lay is not None else set()
    ranks_before = [r for r in layout.live_ranks(run.root_pid).values() if r.role in roles]
    shutil.rmtree(run.images, ignore_errors=True)
    with reporter.phase("criu_dump", f"CRIU dump of pid {run.root_pid} and its children"), \
            criu.host_lock(on_wait=lambda: reporter.info("waiting for another CRIU dump/restore on this host"),
                           path=criu_lock):
        shm_before = capture.shm_names()
        try:
            with rankfaults.kill_rank_during_dump(run.root_pid):  # a test's kill -9 of a rank amid the dump
                out.gpu = plan.dump(run, leave_running, criu_bin, timeout_s)
        except CheckpointError as e:
            lost = layout.died(run.root_pid, lay.sizes() if lay is not None else "the", ranks_before,
                               "the CRIU dump", run.log_path)
            if lost is None or isinstance(e, criu.DumpTimeout):  # a killed dump is named as such
                raise
            raise layout.RankError(f"{lost}\n  {e}", lost.ranks) from e
        remaps = capture.link_remaps_since(shm_before)
        links = capture.group_hardlinks(list(files.shm) + remaps)
        for p in remaps:
            st = p.stat()
            run.shm_inodes.append((st.st_dev, st.st_ino))  # the semaphore it stands for goes at teardown
            if links[p] is not None:
                out.links.append(_link_entry(p, links[p]))
            else:
                run.shm_copies.mkdir(parents=True, exist_ok=True)
                out.items.append((Path(shutil.copy2(p, run.shm_copies / p.name)), "shm", p.name))
            p.unlink()
        # a rank killed while CRIU collected the tree is dumped as a zombie, and CRIU succeeds
        zombies = criu.dumped_dead(run.images, [r.nspid for r in ranks_before])
        if (lost := layout.died(run.root_pid, lay.sizes() if lay is not None else "the", ranks_before,
                                "the CRIU dump", run.log_path, dead_nspids=zombies)) is not None:
            raise layout.RankError(f"{lost}\n  criu dump of pid {run.root_pid} stored it as a dead process "
                                   "(a zombie, no memory): such a snapshot could never serve", lost.ranks)
    if zero_pages == "drop":
        with reporter.phase("zero_pages", "all-zero pages of anonymous memory out of the image"):
            zero = zeropages.compact(run.images)  # a restore neither reads nor writes them (zeropages)
        reporter.info(f"image: {zero.dropped} of {zero.pages} pages were all zero "
                      f"({zero.bytes_dropped / 2**20:.1f} MiB), left out: the restored engine finds them zero")
    for p in sorted(run.images.iterdir()):
        if p.is_file():
            out.items.append((p, "image", p.name))
            out.images_bytes += p.stat().st_size
    for p in files.shm:
        if links.get(p) is not None:
            out.links.append(_link_entry(p, links[p]))
        else:
            out.items.append((p, "shm", p.name))
    out.items += [(p, "file", str(p).lstrip("/")) for p in files.bundled]
    if plan.weights_outside_image:
        out.items += [(p, "weights", f"weights/{p.name}") for p in sorted(run.weights.iterdir())]
    run.save()  # with CRIU's link_remap inodes: what a killed snapshot leaves, the next run removes
    return out


def _link_entry(p: Path, target: Path) -> FileEntry:
    """A ``/dev/shm`` file stored as a hard link to ``target`` (no chunks of its own)."""
    st = p.stat()
    return FileEntry(path=p.name, role="shm", size=st.st_size, mode=st.st_mode & 0o7777, hardlink_to=target.name)


def _entry(src: Path, role: str, rel: str, chunks: list | None = None) -> FileEntry:
    """The manifest entry of the file ``src`` stored as ``rel`` with ``role``."""
    st = src.stat()
    return FileEntry(path=rel, role=role, size=st.st_size, mode=st.st_mode & 0o7777, chunks=chunks or [])


def _label(role: str, rel: str) -> str:
    """How a file to store is named to the operator: its place at restore."""
    return {"image": f"image file {rel}", "shm": f"/dev/shm/{rel}", "file": f"bundled file /{rel}"}.get(role, rel)


def _refuse_secrets(profile: Profile, settings: Settings, dumped: _Dumped, draft: Manifest, reporter: Reporter,
                    push_to: str | None) -> None:
    """The ``secret_scan`` phase, before anything is stored: every file to store (CRIU images,
    ``/dev/shm`` captures, bundled files, weights) and the manifest as it will be written
    (profile, host, canary and restore records) searched for every secret value warmctl can
    know on this host (:func:`warmctl.records.credentials.known_secrets`: also the secret part of every
    value of warmctl's environment, a passed-through variable's included, that has a
    credential's shape), all of them in one pass (:func:`warmctl.records.credentials.scan_files`). Raises
    :class:`warmctl.records.credentials.SecretInSnapshot` naming each secret's source and the file it
    is in, never the value; the caller's teardown then removes the images and ``/dev/shm`` files."""
    known = credentials.known_secrets(settings, store_urls=[push_to] if push_to else [],
                                      profile_env=profile.engine.env)
    files = [(src, _label(role, rel)) for src, role, rel in dumped.items]
    with reporter.phase("secret_scan", f"scanning {len(files)} files and the manifest for {len(known.secrets)} "
                                       f"secret values this host knows"):
        found, nbytes = credentials.scan_files(files, known.secrets)
        found += credentials.scan_bytes(draft.model_dump_json().encode(), known.secrets,
                                        "the manifest (profile, host, canary and restore records)")
    credentials.refuse_if_found(found, f"snapshot {profile.name}")
    skipped = f"; {known.short} value(s) under {credentials.MIN_SECRET_BYTES} bytes not scanned for" if known.short else ""
    reporter.info(f"secret scan: {nbytes / 2**20:,.0f} MiB, none of {len(known.secrets)} secret values found{skipped}")


def _store_files(store, dumped: _Dumped, reporter: Reporter) -> list[FileEntry]:
    """The ``store`` phase: every listed file chunked into ``store``; returns the manifest's
    file entries (hard links included)."""
    total = sum(p.stat().st_size for p, _, _ in dumped.items)
    entries = list(dumped.links)
    with reporter.phase("store", f"chunking {total / 2**20:,.0f} MiB into {store}"):
        advance = reporter.bytes_progress("store", total)
        for src, role, rel in dumped.items:
            entries.append(_entry(src, role, rel, store.add_file(src, progress=advance)))
    return entries


def _phases(startup: dict[str, float], reporter: Reporter) -> list[Phase]:
    """The manifest's phases: the cold start's, then every phase of this pipeline so far."""
    return [Phase(name=k, seconds=v) for k, v in startup.items()] + list(reporter.phases)


def _build_manifest(run: EngineRun, profile: Profile, settings: Settings, record: CanaryRecord,
                    startup: dict[str, float], reporter: Reporter, dumped: _Dumped,
                    weights: WeightsRestore | None, entries: list[FileEntry]) -> Manifest:
    """The manifest of the snapshot: profile, host fingerprint, canary, every phase so far, the
    restore record (with the content digest of every required file: seconds on the first
    snapshot of a home, a ``stat`` each after, :mod:`warmctl.checkpoint.filedigest`) and the files."""
    restore = RestoreInfo(log_path=str(run.log_path), cwd=str(run.cwd), internal_port=run.internal_port,
                          required_files=dumped.files.required, images_bytes=dumped.images_bytes,
                          required_digests=filedigest.digests_of(dumped.files.required,
                                                                 filedigest.DigestCache.for_settings(settings)),
                          engine_env=run.engine_env)
    if dumped.cpu_affinity:
        restore.cpu_affinity = dumped.cpu_affinity
    if run.tmp is not None:
        restore.tmp_dir = str(run.tmp)
    if dumped.gpu is not None:
        restore.gpu = dumped.gpu
    if weights is not None:
        restore.weights = weights
    fp = host.fingerprint(criu=settings.criu, image_digest=settings.image_digest)
    if dumped.layout is not None:
        restore.layout = dumped.layout
        if dumped.layout.world_size > 1 and (bound := layout.rank_cpus(dumped.layout)):
            fp.rank_cpus = bound  # the catalog's "ranks" rule: a restoring host must offer these CPUs
    return Manifest(
        name=profile.name,
        profile_digest=profile.digest(),
        profile=profile.model_dump(mode="json"),
        host=fp.model_dump(mode="json"),
        canary=record,
        phases=_phases(startup, reporter),
        restore=restore,
        files=entries,
    )


def _publish(store, manifest: Manifest, tag: str, settings: Settings, reporter: Reporter) -> str:
    """Write the manifest (after its chunks), then sign it and tag it ``NAME:TAG`` in the
    catalog (the ``publish`` phase). Returns the manifest's digest."""
    digest = store.put_manifest(manifest)
    with reporter.phase("publish", f"signing and publishing {manifest.name}:{tag}"):
        Catalog(store).publish(digest, manifest, tag=tag, signer=signing_key(settings, reporter))
    return digest


def _push(store, manifest: Manifest, digest: str, tag: str, url: str, reporter: Reporter, settings: Settings) -> None:
    """The ``push`` phase: publish ``NAME:TAG`` (this snapshot's entry) from the local ``store``
    to the store at ``url``: chunks it lacks, manifest, signature, then the catalog entry, last
    (:mod:`warmctl.naming.fleet`). On failure the snapshot stays published locally; the error says
    how to push it again."""
    remote = open_store(url, settings=settings)
    try:
        with reporter.phase("push", f"publishing {manifest.name}:{tag} to {url}"):
            advance = reporter.bytes_progress("push", manifest.total_size())
            fleet.transfer(store, remote, fleet.entries_to_copy(store, Ref(name=manifest.name, tag=tag), only=digest), advance)
    except BaseException:
        reporter.warn(f"the snapshot is in the local store as {manifest.name}:{tag} ({digest[:19]}); "
                      f"`warmctl push {manifest.name}:{tag}` publishes it")
        raise
    finally:
        remote.close()
