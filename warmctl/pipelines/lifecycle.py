"""``up``, ``down`` and ``status``: bring a snapshot (or a cold engine) to the public port.

``up(request)`` reads top-down as its phases, one short function each (timed phases in quotes):

1. :func:`_adopt_or_clear`: an engine already up is left alone (``up`` changes nothing); what a
   crash or a dead engine left is torn down first;
2. "catalog", :func:`_find_snapshot`: the catalog picks the snapshot ``NAME:TAG`` (or takes
   ``NAME@digest``) for this host and verifies its signature; with none (or one made from
   another profile), :func:`_cold_up` says why and cold-starts instead
   (:mod:`warmctl.engine.cold`), unless the ``cold_start`` setting is ``never``: then ``up``
   fails, naming every candidate and why it was rejected;
3. :func:`_restore_up`: pre-flight (public and internal ports free, CRIU usable; on AMD
   profiles the plan's "vram_preflight": free VRAM per GPU) before
   anything is written, and the gate's process started (it listens only at step 6); then,
   under the host's CRIU lock, "materialize" (:mod:`warmctl.pipelines.materialize`; streamed to CRIU
   as it is written with ``restore_stream``, :mod:`warmctl.pipelines.restore_stream`: the verified image this host keeps for the
   snapshot's digest reused, :mod:`warmctl.checkpoint.imagecache`; or else every chunk fetched
   and verified against its digest -- a corrupt chunk stops ``up`` here, naming the chunk; from
   a remote store each chunk streams into the local store, its cache (uncommitted until step 6),
   and into place -- and the
   image written into that cache; ``/dev/shm`` files and bundled files put back, required files
   checked) and "restore" (CRIU restores the tree: new host PIDs, its own PID namespace);
4. the checkpoint plan's ``after_restore`` ("gpu_restore" on CUDA profiles: every rank's CUDA
   state restored and unlocked), "health", the plan's ``wake`` ("weights" when the snapshot kept
   weights outside the image: woken from sleep and copied back in place, GB/s reported);
5. "canary": the canary replayed and compared bit for bit with the record; on any mismatch
   :class:`CanaryMismatch` is raised -- the public port never opens;
6. "gate": the public port opens (:mod:`warmctl.gate`: the process started at step 3 is told to
   listen); a snapshot restored from a remote store then has the chunks fetched into the local
   store committed there ("commit", :func:`_commit_fetched`: until then they are temporary
   files, :class:`warmctl.store.CacheFill`; the fsyncs no longer stand between the fetch and
   CRIU) and is named in the local store's catalog too ("keep", :func:`_keep_locally`), both
   timed after the port opened, so not in ``total``, so the next ``up`` finds it without the
   remote. A restore that fails commits what it fetched before it raises (kept for the next try).

What is asked and what comes of it are :class:`warmctl.records.contract.UpRequest` and
:class:`warmctl.records.contract.UpResult`, the same for the CLI, the agent and its client; one ``up``
is one :class:`_Up` (the request, the settings, the reporter, the profile) handed down the phases.

Every engine is held as an :class:`~warmctl.engine.run.EngineRun` (paths resolved once, PIDs
with identity, ``/dev/shm`` files), recorded in ``<home>/run/NAME/state.json`` before anything
can leave a process or a file behind; any failure ends in its one ``teardown()``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timezone

from pydantic import ValidationError

from warmctl.records import enginelock
from warmctl.naming.catalog import Accepted, Catalog, CatalogEntry, CatalogError
from warmctl.base import faults
from warmctl.checkpoint import capture, criu, layout, rankfaults
from warmctl.checkpoint.filedigest import DigestCache
from warmctl.checkpoint.imagecache import CachedImage, ImageCache
from warmctl.records.config import Settings
from warmctl.records.contract import UpRequest, UpResult
from warmctl.engine import canary, loopback, vllm
from warmctl.engine.plan import CheckpointPlan
from warmctl.engine.run import LAZY_FAILED, EngineRun
from warmctl.base.errors import EngineError, HostError, IntegrityError, SnapshotNotFound, WarmctlError
from warmctl.gate import drain as drain_gate
from warmctl.gate import GateConfig, LazyWatch, require_port_free
from warmctl.gate import prestart as prestart_gate
from warmctl.gate import start as start_gate
from warmctl.host import HostFingerprint, fingerprint
from warmctl.records.manifest import Manifest
from warmctl.pipelines.materialize import materialize, protected_paths, rebind
from warmctl.base.names import check_name
from warmctl.records.profile import Profile
from warmctl.records.progress import Reporter
from warmctl.pipelines.restore_stream import materialize_and_restore_streamed, streams
from warmctl.records.state import EngineState, all_states
from warmctl.store import CacheFill, Fetched, open_store


@dataclass
class _Up:
    """One ``up``: what was asked (:class:`~warmctl.records.contract.UpRequest`), the settings it runs
    under (``cold_start`` as the request asks), where it reports, and the profile to cold-start
    from and check the snapshot against (None: no profile of that name)."""

    request: UpRequest
    settings: Settings
    reporter: Reporter
    profile: Profile | None

    @property
    def name(self) -> str:
        return self.request.name


def _public(profile: Profile, settings: Settings, port: int | None, host: str | None) -> tuple[str, int]:
    return (host or settings.gate_host or profile.gate.host,
            port or settings.gate_port or profile.gate.port)


def up(request: UpRequest, settings: Settings, reporter: Reporter, *, profile: Profile | None = None) -> UpResult:
    """Bring ``request.name`` up on its public port (see module doc and
    :class:`~warmctl.records.contract.UpOptions` for what the request says). Idempotent: an engine
    already up (serving, ``/health`` answering) is left alone and reported (``already_up``).
    Returns an :class:`~warmctl.records.contract.UpResult` (``failure`` None); raises on failure
    (:meth:`UpResult.failed` turns the error into a result).

    One ``up``/``down`` of ``name`` at a time on this host (:mod:`warmctl.records.enginelock`): a second
    ``up`` started meanwhile waits for the first, then reports ``already_up`` when the first
    succeeded, or raises the first's error (same class and exit code) when it failed; an ``up``
    that was killed is cleaned up after and tried again. Different names do not wait.

    The snapshot is chosen by the catalog's rules for this host's fingerprint (or pinned by
    ``request.digest``) and its signature verified before anything is written
    (:meth:`warmctl.naming.catalog.Catalog.resolve`);
    ``insecure`` turns an unsigned or untrusted snapshot into a loud warning instead of an error.
    A snapshot older than the newest this node accepted for ``name:tag`` on this kind of host is
    refused (a rollback) unless ``allow_rollback`` or pinned by ``digest``; an unusable newer
    entry is passed over with a line saying why; the digest and age of what is restored are said.
    ``request.cold_start``, when set, replaces the ``cold_start`` setting for this ``up``.
    ``profile`` is needed for the cold path (no snapshot) and to check that a snapshot was made
    from the same profile (default: the profile ``name`` in ``settings.profile_dirs``, if there
    is one); without one, the snapshot's embedded profile is used.
    ``request.restart``/``restart_limit`` are the agent's, not read here.
    Raises :class:`HostError` (pre-flight), :class:`SnapshotNotFound` (no snapshot, and no
    profile or ``cold_start == "never"`` or a pinned ``digest``), :class:`warmctl.naming.trust.TrustError`, :class:`IntegrityError`,
    :class:`CheckpointError`, :class:`CanaryMismatch`.
    """
    name = request.name
    check_name("engine name", name, CatalogError)  # before the name becomes a lock file's name
    if request.cold_start is not None and request.cold_start != settings.cold_start:
        settings = settings.model_copy(update={"cold_start": request.cold_start,
                                               "sources": {**settings.sources, "cold_start": "request"}})
    if profile is None:
        profile = find_profile(name, settings)
    with enginelock.hold(settings.run_dir, name, "up", on_wait=lambda o: reporter.info(
            f"waiting for the {o.op if o else 'other'} of {name} already running"
            + (f" (pid {o.pid})" if o else "") + " on this host")) as held:
        if held.waited and held.previous is not None and held.previous.op == "up" and held.previous.ok is False:
            raise held.previous.error(name)
        already = _adopt_or_clear(name, settings, request.digest)
        if already is not None:
            return already
        return _up(_Up(request, settings, reporter, profile))


def find_profile(name: str, settings: Settings) -> Profile | None:
    """The profile ``name`` in ``settings.profile_dirs`` (what ``up`` cold-starts from), or
    None when there is none (or it does not load). Raises
    :class:`warmctl.records.profile.CredentialInProfile` when it carries a credential: refused, not
    ignored."""
    from warmctl.records.profile import CredentialInProfile, ProfileError, load_profile

    try:
        return load_profile(name, settings.profile_dirs)
    except CredentialInProfile:
        raise
    except ProfileError:
        return None


def _up(u: _Up) -> UpResult:
    """:func:`up` once no engine ``u.name`` is serving (under its lock)."""
    req, settings, name = u.request, u.settings, u.name
    with u.reporter.phase("catalog", "choosing the snapshot, checking its signature"):
        found = _find_snapshot(name, settings, u.reporter, req.tag, req.digest, u.profile, req.insecure,
                               req.allow_rollback)
    try:
        if found.manifest is None:
            if u.profile is None:
                raise found.not_found(f"{found.reason}; and no profile named {name} to cold-start from")
            if req.digest is not None:
                raise found.not_found(f"{found.reason}; a pinned snapshot ({name}@{req.digest[:19]}) is never replaced by a cold start")
            if settings.cold_start == "never":
                raise found.not_found(f"{found.reason}\nnot cold-starting {name}: cold_start is 'never' "
                                       f"({settings.sources.get('cold_start', 'flag')})")
            return _cold_up(u, found.reason)
        return _restore_up(u, found)
    finally:
        found.close()


def _adopt_or_clear(name: str, settings: Settings, digest: str | None = None) -> UpResult | None:
    """``already-up`` if ``name`` is up (engine and gate alive, serving, ``/health`` answering);
    else tear down whatever a crash or a dead engine left of it and return None. Raises
    :class:`EngineError` when it is serving but ``/health`` does not answer (a live engine is
    never killed by ``up``), :class:`HostError` when it serves another snapshot than the pinned
    ``digest``."""
    existing = EngineRun.load(settings.run_dir, name)
    if existing is None:
        return None
    st = existing.state
    assert st is not None
    if existing.alive() and existing.gate is not None and existing.gate.alive() and st.phase == "serving":
        if not loopback.healthy(st.internal_port):
            raise EngineError(f"{name} is running (pid {st.root_pid}) but its /health does not answer on "
                              f"127.0.0.1:{st.internal_port}; `warmctl down {name}` first")
        if digest is not None and st.manifest_digest != digest:
            raise HostError(f"{name} is up from {st.manifest_digest or 'a cold start'}, not {digest}; "
                            f"`warmctl down {name}` first")
        return UpResult(name=name, state=st, source=st.source, snapshot_digest=st.manifest_digest, already_up=True,
                        lazy_copy=_lazy_copy(st))
    existing.teardown(strays=True)  # under the name's lock its owner is gone; strays: a root known
    return None                     # only by engine.pid / restore.pid (identity-checked)


@dataclass
class _Found:
    """The catalog's answer for ``up`` of engine ``name``: the snapshot (``manifest`` and
    ``digest``, or None and the ``reason`` why not; ``entry``, the catalog entry that named it,
    None when pinned by digest), the store it streams from, the local store that caches its
    chunks (None when they are the same), this host's fingerprint, and the bytes fetched."""

    name: str
    store: object
    cache: object | None
    fp: HostFingerprint
    manifest: Manifest | None = None
    digest: str | None = None
    entry: CatalogEntry | None = None
    reason: str = ""
    fetched: Fetched = field(default_factory=Fetched)
    insecure: bool = False  # a signature was not verified: nothing of it is named locally
    refusal: type[SnapshotNotFound] = SnapshotNotFound  # the class of the catalog's answer (ImageMismatch)

    def not_found(self, message: str) -> SnapshotNotFound:
        """The error when no snapshot is restored and nothing cold-starts: of the catalog's
        class (:class:`~warmctl.base.errors.ImageMismatch` for another container image)."""
        return self.refusal(message)

    def close(self) -> None:
        """Release the stores' writer locks (the cache writes chunks)."""
        for s in (self.store, self.cache):
            if s is not None:
                s.close()


def _find_snapshot(name: str, settings: Settings, reporter: Reporter, tag: str, digest: str | None,
                   profile: Profile | None, insecure: bool, allow_rollback: bool = False) -> _Found:
    """Resolve ``NAME:TAG`` in the catalog (the remote store when configured; chunks then stream
    from it through the local store, which keeps them as a cache for the next up). A snapshot
    made from another profile than ``profile`` is not used. Raises
    :class:`warmctl.naming.trust.TrustError` (signature)."""
    local = open_store(settings.store_dir, settings=settings)
    store = local if settings.catalog_url == str(settings.store_dir) else open_store(settings.catalog_url, settings=settings)
    found = _Found(name, store, None if store is local else local, fingerprint(criu=settings.criu, image_digest=settings.image_digest))
    try:
        res = Catalog(store).resolve(name, found.fp, settings.keys_dir, tag=tag, digest=digest,
                                     insecure=insecure, driver=settings.match_driver,
                                     accepted=Accepted.for_settings(settings), allow_rollback=allow_rollback)
        found.manifest, found.digest, found.entry = res.manifest, res.digest, res.entry
        found.insecure = res.verification.insecure
        for r in res.skipped:
            from warmctl.naming.fleet import fallback_line  # copying between stores: a remote's, not every up's

            reporter.warn(fallback_line(r))
        if res.verification.warning:
            reporter.warn(res.verification.warning, severe=True)
        reporter.info(restoring_line(f"{name}@{res.digest}" if digest else f"{name}:{tag}", res))
        reporter.chosen(f"{name}@{res.digest}" if digest else f"{name}:{tag}", res.digest)
    except SnapshotNotFound as e:
        found.reason, found.refusal = str(e), type(e)
    except BaseException:
        found.close()
        raise
    m = found.manifest
    if m is not None and profile is not None and m.profile_digest != profile.digest():
        from warmctl.naming.drift import compare

        found.reason = compare(m.profile, m.profile_digest, profile).message(
            f"snapshot {name}:{tag} ({found.digest[:19]})")
        found.manifest = None
    return found


def restoring_line(ref: str, res) -> str:
    """``snapshot REF = DIGEST, created DATE (AGE ago), signed by key K``: what ``up`` says it
    restores (the digest and the age, so a rollback is visible)."""
    created = res.manifest.created
    age = (datetime.now(timezone.utc) - created).total_seconds()
    ago = f"{age / 86400:.1f} days" if age >= 86400 else f"{age / 3600:.1f} h" if age >= 3600 else f"{max(age, 0) / 60:.0f} min"
    key = res.verification.key_id
    who = f"signed by key {key}" if key else "NOT signed by a trusted key"
    return f"snapshot {ref} = {res.digest}, created {created.isoformat(timespec='seconds')} ({ago} ago), {who}"


def _restore_up(u: _Up, found: _Found) -> UpResult:
    """The restore path of :func:`up` (see module doc, 3-6)."""
    settings, reporter = u.settings, u.reporter
    m, digest = found.manifest, found.digest
    assert m is not None and digest is not None
    try:
        prof = Profile.model_validate(m.profile)
    except ValidationError as e:  # the snapshot is unusable: say where and why, no traceback
        why = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:5])
        raise IntegrityError(f"snapshot {m.name} ({digest[:19]}): the profile it records does not validate: {why}") from None
    plan = CheckpointPlan.of(prof, settings)
    host_, port = _public(prof, settings, u.request.port, u.request.host)
    require_port_free(host_, port, "public port")
    gate = GateConfig.from_settings(settings).check()  # a bad key/certificate file fails here, before the restore
    require_port_free("127.0.0.1", prof.engine.port, "engine port")
    binary = criu.check(settings.criu, settings.xtile_perm_lib)
    lay = m.restore.layout
    if lay is not None and lay.world_size > 1:  # the ranks' TCP connections come back under CRIU's network lock
        criu.require_network_lock(binary, settings.cache_dir, f"snapshot {m.name} ({lay.describe()})")
    if lay is not None:  # its listening sockets come back bound to the same ports
        layout.require_ports_free(lay, f"snapshot {m.name} ({lay.sizes()})")
    pages = restore_pages(settings, binary, plan.criu_plugins, reporter)
    plan.before_restore(m.restore, reporter)  # AMD: free VRAM per GPU (the amdgpu plugin allocates it in CRIU)

    run = EngineRun(settings.run_dir, found.name, prof.engine.port, log_path=m.restore.log_path, cwd=m.restore.cwd,
                    tmp_dir=m.restore.tmp_dir or False)
    run.dir.mkdir(parents=True, exist_ok=True)
    # the gate's interpreter starts now, beside the restore; it listens only once opened
    pending_gate = prestart_gate(host_, port, prof.engine.port, run.gate_log, config=gate)
    st = EngineState(name=found.name, phase="restoring", source="restore", manifest_digest=digest,
                     started_at=run.started_at, profile_digest=m.profile_digest, internal_port=prof.engine.port,
                     public_host=host_, public_port=port, served_model_name=prof.engine.served_model_name,
                     **gate.enforces, restore_pages=pages,
                     log_path=str(run.log_path))
    images = ImageCache.for_settings(settings)
    img = None
    lazy = None
    streamed = None
    served = False
    # the chunks fetched into the local store are committed after the port opened ("commit")
    fill = CacheFill(found.cache) if found.cache is not None else None
    try:
        img, lazy, streamed = _materialize_and_restore(run, st, found, images, settings, reporter, plan.criu_plugins,
                                                       pages, fill=fill)
        _check_ranks(run, m, reporter)
        run.save(phase="health")
        plan.after_restore(run, m.restore, [x["uuid"] for x in m.host.get("gpus", [])],
                           [x.uuid for x in found.fp.gpus], reporter)
        with reporter.phase("health", "waiting for /health"):
            vllm.wait_healthy(run, 120, interval_s=0.01)
        if lazy is not None:
            lazy.check("while the engine came up")
        plan.wake(run, m.restore, reporter)
        run.save(phase="canary")
        with reporter.phase("canary", "replaying the canary, bit for bit"):
            canary.verify(m.canary, run.base_url, prof.canary, prof.engine.served_model_name)
        with reporter.phase("gate", f"opening {host_}:{port}"):
            if lazy is not None:  # the canary may have passed on pages that were never copied
                lazy.check("during the canary")
            watch = None if lazy is None else LazyWatch(lazy.ident, lazy.log, run.root, run.lazy_failed)  # type: ignore[arg-type]
            run.set_gate(pending_gate.open(run.root_pid, lazy=watch))
        timings = _timings(reporter)
        _serving(run, timings)
        served = True
    except BaseException:
        pending_gate.cancel()
        # strays: an interrupted restore (Ctrl-C) whose CRIU ended after the interrupt names the
        # tree it restored only in restore.pid (identity-checked: EngineRun._kill_strays)
        run.teardown(strays=True)
        raise
    finally:
        run.remove_scratch()
        if img is not None:  # an image not kept stays while a lazy restore's daemon reads it (down removes it)
            images.release(img, busy=served and lazy is not None)
        if fill is not None and not served:  # the verified chunks are kept for the next try, or none at all
            err = fill.settle()
            if err is not None:
                reporter.warn(f"the fetched chunks were not kept in the local store: {err}")
    fetched = found.fetched.as_dict()
    if found.cache is not None:
        reporter.info(f"fetched {fetched['remote'] / 2**20:,.0f} MiB from {found.store.location}, "
                      f"{fetched['local'] / 2**20:,.0f} MiB from the local store")
        kept = _commit_fetched(fill, reporter)
        timings["commit"] = reporter.seconds("commit")
        if kept:
            with reporter.phase("keep", "naming the snapshot in the local store"):
                _keep_locally(found, reporter, settings)
            timings["keep"] = reporter.seconds("keep")
    return UpResult(name=found.name, state=run.state, source="restore", timings=timings, snapshot_digest=digest,
                    fetched=fetched, streamed=streamed, lazy_copy=_lazy_copy(run.state))


def _lazy_copy(st: EngineState | None) -> str | None:
    """``"running"`` while the lazy-pages daemon of ``st`` still copies pages, ``"done"`` once
    it exited; None for an eager restore or a cold start (:attr:`UpResult.lazy_copy`)."""
    lazy = None if st is None else st.lazy
    return None if lazy is None else ("running" if lazy.alive() else "done")


def _commit_fetched(fill: CacheFill | None, reporter: Reporter) -> bool:
    """The "commit" phase, after the public port opened: the chunks this ``up`` fetched into the
    local store (temporary files until now, :class:`~warmctl.store.CacheFill`) made durable and
    visible there (one fsync per chunk object on 8 threads, one per directory). Nothing on the
    way to the first token reads them, so it no longer runs before CRIU (it was the end of
    "materialize"). Never fails the serving engine: on an error the temporary files are removed,
    the error reported, and False returned (then the snapshot is not named locally: the next
    ``up`` fetches again). A ``kill -9`` before or during it leaves temporary files for gc."""
    if fill is None:
        return True
    with reporter.phase("commit", f"making the {len(fill)} fetched chunk(s) durable in the local store"):
        err = fill.settle()
    if err is not None:
        reporter.warn(f"the fetched chunks were not kept in the local store, nor the snapshot named there: {err}")
        return False
    return True


def _keep_locally(found: _Found, reporter: Reporter, settings: Settings) -> None:
    """After a restore from a remote store: name the snapshot in the local store's catalog too
    (its chunks are there already, as the cache; the manifest and signatures are copied), so a
    later ``up`` or ``pull`` needs no remote. A snapshot pinned by digest is not named. Never
    fails the serving engine: a problem is reported and left."""
    if found.entry is None or found.cache is None:
        return
    if found.insecure:
        reporter.warn("the restored snapshot is not named in the local store: its signature was not verified")
        return
    from warmctl.naming.fleet import copy_entry

    try:
        copy_entry(found.store, found.cache, found.entry, keys_dir=settings.keys_dir)
    except Exception as e:  # noqa: BLE001 - the engine serves: never a traceback after the port opened
        reporter.warn(f"the restored snapshot is not named in the local store: {e}")


def restore_pages(settings: Settings, binary: str, plugins: tuple[str, ...], reporter: Reporter) -> str:
    """``"lazy"`` or ``"eager"``: how this restore copies the engine's memory (the
    ``restore_pages`` setting; ``auto``: lazy when ``criu check --feature uffd-noncoop``
    passes, cached per CRIU binary and kernel, :func:`warmctl.checkpoint.criu.uffd_supported`).
    A plan that loads CRIU plugins (``plugins``) restores eagerly: lazy pages with the amdgpu or
    CUDA plugin are not verified. Raises :class:`HostError` when ``lazy`` is asked for on a host
    whose kernel lacks non-cooperative userfaultfd."""
    want = settings.restore_pages
    if want == "eager":
        return "eager"
    if plugins:
        if want == "lazy":
            reporter.info(f"restore_pages lazy: not with CRIU plugins ({', '.join(plugins)}); restoring eagerly")
        return "eager"
    if criu.uffd_supported(binary, settings.cache_dir):
        return "lazy"
    if want == "lazy":
        raise HostError(f"restore_pages is lazy ({settings.sources.get('restore_pages', 'flag')}), but "
                        f"`{binary} check --feature uffd-noncoop` fails on this host (kernel "
                        f"{os.uname().release}: userfaultfd with fork/remove events needed); use eager or auto")
    return "eager"


def _materialize_and_restore(run: EngineRun, st: EngineState, found: _Found, images: ImageCache,
                             settings: Settings, reporter: Reporter, plugins: tuple[str, ...] = (),
                             pages: str = "eager", fill: CacheFill | None = None
                             ) -> tuple[CachedImage, "criu.LazyPages | None", dict | None]:
    """The "materialize" and "restore" phases, under the host's CRIU lock: one CRIU operation
    per host from the first ``/dev/shm`` file written until CRIU has consumed its link_remap
    files (see :func:`warmctl.checkpoint.criu.host_lock`). The run is recorded before CRIU
    starts, with the ``/dev/shm`` files written; its root once CRIU returns it. ``plugins``:
    the CRIU plugins the restore loads (the plan's ``criu_plugins``). ``pages``: ``lazy``
    starts a ``criu lazy-pages`` daemon first (recorded on the run the moment it runs) and
    returns it; ``eager`` returns None beside the image. ``fill``: where the chunks fetched into
    the local store wait for their commit (:func:`_commit_fetched`). Third: what a streamed
    restore read (:attr:`UpResult.streamed`; :func:`warmctl.pipelines.restore_stream.materialize_and_restore_streamed`), else None."""
    m = found.manifest
    assert m is not None
    netlock = criu.network_lock_method(criu.check(settings.criu, settings.xtile_perm_lib), settings.cache_dir)
    with criu.host_lock(on_wait=lambda: reporter.info("waiting for another CRIU dump/restore on this host"),
                        path=settings.criu_lock):
        if streams(settings, images, m, found.digest, pages, plugins):
            return materialize_and_restore_streamed(run, st, found, images, settings, reporter, plugins, netlock, fill)
        with reporter.phase("materialize", f"verifying and writing {m.total_size() / 2**20:,.0f} MiB"):
            img = materialize(found.store, m, found.digest, run, images, reporter, cache=found.cache,
                               fetched=found.fetched, protected=protected_paths(settings),
                               file_digests=DigestCache.for_settings(settings), fill=fill)
            run.prepare()
            run.log_path.touch()
        run.record(st)
        with reporter.phase("restore", f"CRIU restore of the process tree ({pages} pages)"):
            if pages == "lazy":
                run.lazy_failed.unlink(missing_ok=True)
                pid, lazy, _ = criu.lazy_restore(img.images, run.criu_pidfile, run.dir, log_file=run.restore_log,
                                                 daemon_log=run.lazy_log, binary=settings.criu,
                                                 on_daemon=lambda lp: run.set_lazy(lp.ident), network_lock=netlock,
                                                 xtile_lib=settings.xtile_perm_lib)
                run.adopt_restored(pid)
                rebind(run, m, reporter)
                if lazy.oom_note:
                    reporter.warn(lazy.oom_note)
                return img, lazy, None
            run.adopt_restored(criu.restore(img.images, run.criu_pidfile, log_file=run.restore_log,
                                            binary=settings.criu, work_dir=run.dir, plugins=plugins,
                                            network_lock=netlock, xtile_lib=settings.xtile_perm_lib)[0])
            rebind(run, m, reporter)
    return img, None, None


def _check_ranks(run: EngineRun, m: Manifest, reporter: Reporter) -> None:
    """The "ranks" phase, right after the CRIU restore (threads rebound), before ``/health`` and
    the canary: every rank the snapshot's layout records is back, alive and bound as recorded
    (:func:`warmctl.checkpoint.layout.check_restored`; :class:`~warmctl.checkpoint.layout.RankError`
    names a missing or dead rank, its process and its log lines). Nothing for manifests written
    before the layout was recorded."""
    lay = m.restore.layout
    if lay is None:
        return
    rankfaults.kill_rank("ranks", run.root_pid)  # a test's kill -9 of one restored rank (WARMCTL_TEST_KILL_RANK)
    with reporter.phase("ranks", f"checking {len(lay.ranks)} rank(s): {lay.describe()}"):
        back = layout.check_restored(run.root_pid, lay, run.log_path)
    assert run.state is not None
    run.state.layout, run.state.ranks = lay.sizes(), back


def _open_gate(run: EngineRun, prof: Profile, host_: str, port: int, reporter: Reporter,
               gate: GateConfig) -> None:
    """The "gate" phase: the public port opens in front of ``run`` (:mod:`warmctl.gate`;
    ``gate``: what it enforces, checked)."""
    with reporter.phase("gate", f"opening {host_}:{port}"):
        run.set_gate(start_gate(host_, port, prof.engine.port, run.root_pid, run.gate_log, config=gate))


def _timings(reporter: Reporter) -> dict[str, float]:
    """Seconds of each timed phase of this ``up``, and ``total``: their sum."""
    timings = {p.name: p.seconds for p in reporter.phases}
    timings["total"] = sum(timings.values())
    return timings


def _serving(run: EngineRun, timings: dict[str, float]) -> None:
    """Record ``run`` as serving, with its phase timings (seconds): the last step of ``up``
    that can fail, so the callers run it before they count the engine as up (a record that
    cannot be written, e.g. on a full disk, tears down the engine and its open port like any
    failure of ``up``). Raises :class:`warmctl.base.errors.HostError` when the record cannot
    be written."""
    assert run.state is not None
    run.state.timings = timings
    faults.point("serving_record")  # a test's pause (serving_record:STOP) with the port open, before the record
    run.save(phase="serving")
    faults.point("serving")  # a test's stop signal (or kill -9) once the port is open, before up returns


def _cold_up(u: _Up, reason: str) -> UpResult:
    """The cold path of :func:`up`: start the profile's engine (:mod:`warmctl.engine.cold`),
    warm it up and record its canary, optionally snapshot it and leave it running
    (``snapshot_after``), then open the gate."""
    # imported here, not at the top: a restore never needs them (what `up` imports, docs/benchmarks.md)
    from warmctl.pipelines import snapshot as snap
    from warmctl.engine import cold

    profile, settings, reporter = u.profile, u.settings, u.reporter
    snapshot_after, tag = u.request.snapshot_after, u.request.tag
    assert profile is not None
    host_, port = _public(profile, settings, u.request.port, u.request.host)
    require_port_free(host_, port, "public port")
    gate = GateConfig.from_settings(settings).check()  # a bad key/certificate file fails here, before the start
    cold.preflight(profile, settings.run_dir)
    reporter.warn(f"cold start: {reason}")
    if snapshot_after:
        snap.require_ranks_checkpointable(profile, settings)
    run = EngineRun(settings.run_dir, profile.name, profile.engine.port)
    startup = cold.start(run, profile, cold.resolve_model(profile, settings.models_dir), reporter,
                         settings.engine_env_passthrough)
    digest = snapshot_error = None
    try:
        run.record(EngineState(name=profile.name, phase="canary", source="cold", profile_digest=profile.digest(),
                               started_at=run.started_at, internal_port=profile.engine.port, public_host=host_,
                               public_port=port, served_model_name=profile.engine.served_model_name,
                               **gate.enforces,
                               log_path=str(run.log_path)))
        record = cold.warm_and_record(run, profile, reporter, settings.rank_silence_s)
        run.state.layout = layout.profile_sizes(profile).describe()  # type: ignore[union-attr]
        run.state.ranks = {r: x.pid for r, x in layout.live_ranks(run.root_pid).items()}  # type: ignore[union-attr]
        if snapshot_after:
            try:
                digest = snap.snapshot_engine(run, profile, settings, record, startup, reporter, tag=tag,
                                              leave_running=True).digest
                reporter.info(f"snapshot {profile.name}:{tag} = {digest}")
            except Exception as e:  # noqa: BLE001 - the engine keeps serving when it still can
                snapshot_error = _snapshot_failed(run, profile, record, tag, e)
                run.state.snapshot_error = snapshot_error  # type: ignore[union-attr]  # shown by `up` and `status`
        run.shm_files, run.shm_inodes = [str(p) for p in capture.referenced_files(run.root_pid).shm], []
        _open_gate(run, profile, host_, port, reporter, gate)
        timings = {**startup, **_timings(reporter)}
        _serving(run, timings)
    except BaseException:
        run.teardown()
        raise
    return UpResult(name=u.name, state=run.state, source="cold", timings=timings, reason=reason,
                    snapshot_digest=digest, snapshot_error=snapshot_error)


def _snapshot_failed(run: EngineRun, profile: Profile, record, tag: str, error: Exception) -> str:
    """After ``up --snapshot-after``'s snapshot of the running cold-started engine ``run``
    failed with ``error``: the one-line message saying so, once the engine is known to still
    serve as it did (alive, ``/health`` answering within 30 s, the canary ``record`` replayed
    bit for bit). Raises ``error`` itself when it does not (a dump that stopped or damaged the
    engine): the cold path then fails as a whole, as before."""
    what = str(error) if isinstance(error, WarmctlError) else f"{type(error).__name__}: {error}"
    if not run.alive():
        raise error
    try:
        vllm.wait_healthy(run, 30)
        canary.verify(record, run.base_url, profile.canary, profile.engine.served_model_name)
    except Exception as check:  # noqa: BLE001 - the snapshot's error is the one to report
        raise error from check
    why = "; ".join(ln.strip() for ln in what.splitlines() if ln.strip()) or type(error).__name__  # one line
    return (f"the snapshot of {profile.name}:{tag} failed, nothing of it is named in the catalog; "
            f"{profile.name} keeps serving from its cold start: {why}")


def down(name: str, settings: Settings, now: bool = False) -> EngineState | None:
    """Stop ``name``: close the gate's listener and let in-flight requests finish (up to
    ``settings.gate_drain_s``; ``now``: no wait), kill the engine tree, remove its ``/dev/shm``
    files and state. Returns the state it stopped, or None if nothing of that name was recorded.
    An ``up`` of ``name`` under way is waited for first (:mod:`warmctl.records.enginelock`).
    Raises :class:`~warmctl.naming.catalog.CatalogError` for a name outside the name rule (:mod:`warmctl.base.names`)."""
    check_name("engine name", name, CatalogError)
    with enginelock.hold(settings.run_dir, name, "down"):  # waits for an `up` of it under way
        run = EngineRun.load(settings.run_dir, name)
        if run is None:
            return None
        st = run.state
        if not now:
            drain_gate(run.gate, settings.gate_drain_s)
        # strays: under the name's lock no `up` of it runs, and one that was killed in its
        # restore may have named the tree only in restore.pid (identity-checked)
        run.teardown(strays=True)
        return st


@dataclass
class EngineStatus:
    """``state`` plus live facts: processes alive, ``/health`` answering, and the ``/dev/shm``
    files the engine holds (``shm_count`` files taking ``shm_bytes`` bytes of memory; see
    :func:`warmctl.checkpoint.capture.shm_of`: what its processes map or hold open, and what
    its run recorded). ``lazy_copy``: for a lazy restore, ``"running"`` while the lazy-pages
    daemon still copies pages in the background, ``"done"`` once it has exited (None for an
    eager restore or a cold start). ``failure``: why the gate took the engine down (the
    daemon exited before its copy ended: the engine's memory would read zeros), else empty."""

    state: EngineState
    engine_alive: bool
    gate_alive: bool
    healthy: bool
    shm_count: int = 0
    shm_bytes: int = 0
    lazy_copy: str | None = None
    failure: str = ""


def status(settings: Settings, name: str | None = None, probe: bool = True) -> list[EngineStatus]:
    """Status of every recorded engine (or just ``name``; CatalogError outside the name rule).
    ``probe``: ask each live engine's ``/health`` (up to 2 s each); without it ``healthy`` is False."""
    if name is not None:
        check_name("engine name", name, CatalogError)
    return [row for row, _ in _status_with_shm(settings, name, probe)]


def _status_with_shm(settings: Settings, name: str | None = None, probe: bool = True) -> list[tuple[EngineStatus, set]]:
    out = []
    for st in all_states(settings.run_dir):
        if name and st.name != name:
            continue
        healthy = False
        alive = st.engine_alive()
        if probe and alive:
            healthy = loopback.healthy(st.internal_port, timeout_s=2)
        shm = capture.shm_of(st.root_pid if alive else None, st.shm_inodes, [] if st.shm_inodes else st.shm_files)
        lazy_copy = _lazy_copy(st)
        try:
            failure = (settings.run_dir / st.name / LAZY_FAILED).read_text().strip()
        except OSError:
            failure = ""
        out.append((EngineStatus(st, alive, st.gate_alive(), healthy, len(shm), capture.shm_bytes(shm), lazy_copy,
                                 failure),
                    set(shm) if alive else set()))
    return out


def shm_orphans(settings: Settings) -> list[capture.ShmFile]:
    """Files in ``/dev/shm`` that no live engine of this home holds (:func:`status`'s
    ``shm_*``), oldest first, each with its size, age and the PIDs that use it (an empty
    ``users``: nothing does -- what a killed engine left, which ``down`` of a recorded dead
    engine, or a reboot, removes). An engine being restored right now holds files not recorded
    yet: they are listed too, with users once CRIU has restored its tree."""
    owned: set = set()
    for _, keys in _status_with_shm(settings, probe=False):
        owned |= keys
    return capture.shm_not_owned(owned)
