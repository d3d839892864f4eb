"""Writing a snapshot back in place for CRIU, the "materialize" phase of ``up``
(:func:`warmctl.pipelines.lifecycle.up`): the image through the host's image cache
(:mod:`warmctl.checkpoint.imagecache`), weights linked from it, ``/dev/shm`` files copied from
it and bundled files written from the store at their absolute paths -- after checking that
the host has what the snapshot needs and that nothing would be written where it may not
(:func:`check_restorable`) or beyond the free space (:func:`other_writes`,
:mod:`warmctl.diskspace`). Also :func:`rebind`, the step right after CRIU restored the tree
that both restore paths share (the eager one in :mod:`warmctl.pipelines.lifecycle`, the streamed one in
:mod:`warmctl.pipelines.restore_stream`).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from warmctl.checkpoint import affinity, capture
from warmctl.checkpoint.filedigest import DigestCache
from warmctl.checkpoint.imagecache import CachedImage, ImageCache
from warmctl.records.config import Settings
from warmctl.engine.run import EngineRun
from warmctl.base.errors import HostError, IntegrityError
from warmctl.records.manifest import Manifest
from warmctl.records.progress import Reporter
from warmctl.store import CacheFill, Fetched
from warmctl.store.chunks import is_zero_chunk

if TYPE_CHECKING:
    from warmctl import diskspace


def materialize(store, m: Manifest, digest: str, run: EngineRun, images: ImageCache, reporter: Reporter,
                 cache=None, fetched: Fetched | None = None, protected: list[Path] = (),
                 file_digests: DigestCache | None = None, fill: CacheFill | None = None) -> CachedImage:
    """Write the manifest's files back: the CRIU image through the image cache (reused when
    this host already holds the verified image of ``digest``, :mod:`warmctl.checkpoint.imagecache`),
    weights linked from it into ``run.weights``, ``/dev/shm`` files copied from it (recorded on
    the run with their (st_dev, st_ino), so a teardown removes exactly them) and bundled files
    from the store at their absolute paths. Returns the cached image to restore from.

    ``cache``: a local store that keeps chunks read from a remote ``store``; ``fetched``:
    counts the stored bytes loaded from each; ``fill``: a :class:`~warmctl.store.CacheFill` of
    ``cache`` that holds the fetched chunks uncommitted (the caller commits it). ``protected``: warmctl's own directories and
    files (home, keys, config), where no bundled file may be written; ``file_digests``: the
    host's digest cache of required files (:mod:`warmctl.checkpoint.filedigest`).
    Raises as :func:`check_restorable` before anything is written, :class:`IntegrityError`
    (from the store) on a bad chunk. On failure the ``/dev/shm`` files written so far are removed.
    """
    check_restorable(m, digest, protected, file_digests, reporter)
    advance = reporter.bytes_progress("materialize", m.total_size())
    img = images.get(store, m, digest, progress=advance, cache=cache, fetched=fetched,
                     also=lambda: other_writes(m, cache), scratch=run.unkept_image, command=f"up {m.name} ({digest[:19]})",
                     fill=fill)
    say_image(img, reporter)
    try:
        link_weights(run, m, img)
        put_back(run, m, store, images, img, advance, cache, fetched, fill)
    except BaseException:
        images.release(img)
        raise
    return img


def check_restorable(m: Manifest, digest: str, protected: list[Path], file_digests: DigestCache | None,
                     reporter: Reporter | None = None) -> None:
    """Before anything of ``m`` is written: raises :class:`HostError` naming every required file
    that is missing or differs (size or content digest) or when a ``/dev/shm`` file of the
    snapshot already exists (another restore of it is running on this host);
    :class:`IntegrityError` for a bundled file whose destination is not one where bundled files
    may live (:func:`capture.bundled_target_problems`, whatever the signature flags).
    ``reporter``: told how many required files were hashed (their digests not in ``file_digests``)."""
    problems = capture.missing_or_changed(m.restore.required_files, m.restore.required_digests,
                                          file_digests)
    if reporter is not None and file_digests is not None and file_digests.hashed:
        hashed = sum(m.restore.required_files.get(p, 0) for p in file_digests.hashed)
        reporter.info(f"required files: {len(file_digests.hashed)} of {len(m.restore.required_digests)} hashed "
                      f"({hashed / 2**20:,.0f} MiB), their digests not yet cached on this host")
    if problems:
        raise HostError(f"{len(problems)} file(s) the snapshot's processes map are missing or differ on this host "
                        "(install the same engine environment at the same path):\n  " + "\n  ".join(problems))
    unsafe = capture.bundled_target_problems(["/" + f.path for f in m.files if f.role == "file"], protected)
    if unsafe:
        raise IntegrityError(f"snapshot {m.name} ({digest[:19]}) would write bundled files where they may not "
                             "live; refusing to restore it (nothing written):\n  " + "\n  ".join(unsafe[:10]))
    shm_targets = [capture.SHM / f.path for f in m.files if f.role == "shm"]
    clash = [str(p) for p in shm_targets if p.exists()]
    if clash:
        raise HostError(f"shared-memory files of this snapshot already exist ({', '.join(clash[:3])}): "
                        "another restore of it is running on this host; `warmctl down` it first")


@dataclass
class Prehashed:
    """What :func:`prehash` did: ``files_hashed``, the required files whose digests were not yet
    in the host's digest cache (0 when every one was); ``seconds``, the whole check (wall);
    ``problems``, one line per required file missing or differing on this host (``up`` would
    refuse the snapshot with the same lines)."""

    files_hashed: int
    seconds: float
    problems: list[str]


def prehash(m: Manifest, settings: Settings) -> Prehashed:
    """Put the digests of the files snapshot ``m``'s processes map (``restore.required_digests``:
    the engine environment's libraries) into this host's digest cache
    (:meth:`DigestCache.for_settings`, in the store's home), hashing those not there yet, as
    ``up``'s :func:`check_restorable` checks them before a restore: run after a pull
    (``warmctl pull``, the node agent's pre-warm pass), it moves that hashing (0.4 s for
    ``tiny``'s 128 files, docs/benchmarks.md) off the next ``up``. Never raises for a file
    missing or differing (see :class:`Prehashed`); an unreadable or unwritable cache costs a
    re-hash, never an error."""
    t0 = time.monotonic()
    cache = DigestCache.for_settings(settings)
    problems = capture.missing_or_changed(m.restore.required_files, m.restore.required_digests, cache)
    return Prehashed(len(cache.hashed), time.monotonic() - t0, problems)


def say_image(img: CachedImage, reporter: Reporter) -> None:
    """Tell the operator where the image came from (reused, room made, not kept)."""
    if not img.written:
        reporter.info(f"image: reusing the verified image of {img.digest[:19]} ({img.path})")
    if img.evicted:
        from warmctl.diskspace import human

        reporter.info(f"image cache: removed {len(img.evicted)} least recently used image(s) "
                      f"({human(sum(e.bytes for e in img.evicted))}) to make room: "
                      + ", ".join(e.digest[:19] for e in img.evicted))
    if not img.kept:
        reporter.info(f"image: not kept ({img.not_kept}); restoring from {img.path}, removed afterwards")


def link_weights(run: EngineRun, m: Manifest, img: CachedImage) -> None:
    """The weights files of ``img`` linked into ``run.weights`` (loaded into the restored engine
    after the restore, :mod:`warmctl.engine.worker_ext`)."""
    for f in m.files:
        if f.role == "weights":
            run.weights.mkdir(parents=True, exist_ok=True)
            link_or_copy(img.weights / Path(f.path).name, run.weights / Path(f.path).name)


def put_back(run: EngineRun, m: Manifest, store, images: ImageCache, source, advance, cache=None,
              fetched: Fetched | None = None, fill: CacheFill | None = None) -> None:
    """What CRIU needs in place before it starts, besides the image: the ``/dev/shm`` files
    copied from ``source`` (the entry, or where to read each file of an entry being written,
    see :meth:`ImageCache.put_back_shm`) and the bundled files written from ``store`` at their
    absolute paths (those already there at their size skipped); the ``/dev/shm`` files recorded
    on ``run`` with their (st_dev, st_ino); ``cache``/``fetched``/``fill`` as for :func:`_materialize`.
    On failure the ``/dev/shm`` files written are removed."""
    written_shm: list[str] = []
    try:
        written_shm = [str(p) for p in images.put_back_shm(source, m, capture.SHM)]
        for f in m.files:
            if f.role != "file":  # image, weights and shm: from the image cache
                continue
            dest = Path("/") / f.path
            if dest.is_file() and dest.stat().st_size == f.size:
                advance(f.size)
                continue
            if f.hardlink_to is not None:
                os.link(dest.parent / f.hardlink_to, dest)
                continue
            store.read_file(f.chunks, dest, progress=advance, cache=cache, fetched=fetched, fill=fill)
            os.chmod(dest, f.mode)
        inodes = [(x.st_dev, x.st_ino) for x in map(os.stat, written_shm)]
    except BaseException:
        for p in written_shm:
            Path(p).unlink(missing_ok=True)
        raise
    run.shm_files, run.shm_inodes = written_shm, inodes


def other_writes(m: Manifest, cache) -> list[diskspace.Need]:
    """What materializing ``m`` writes besides its image (checked with it before anything is
    written, :mod:`warmctl.diskspace`): the non-zero bytes of its ``/dev/shm`` files, of the
    bundled files missing or changed at their paths, and, restoring from a remote store
    (``cache``: the local store that keeps what is fetched), the chunks the local store lacks,
    at their uncompressed size (an upper bound: the manifest records no compressed sizes)."""
    from warmctl import diskspace

    def nonzero(f) -> int:
        return sum(c.size for c in f.chunks if not is_zero_chunk(c.digest, c.size))

    needs = [diskspace.Need(capture.SHM, sum(nonzero(f) for f in m.files if f.role == "shm" and f.hardlink_to is None),
                            "shared-memory files")]
    for f in m.files:
        dest = Path("/") / f.path
        if f.role == "file" and f.hardlink_to is None and not (dest.is_file() and dest.stat().st_size == f.size):
            needs.append(diskspace.Need(dest.parent, nonzero(f), f"bundled file {dest}"))
    if cache is not None:
        missing: dict[str, int] = {}
        for f in m.files:
            for c in f.chunks:
                if c.digest not in missing and not cache.has_chunk(c.digest, c.size):
                    missing[c.digest] = c.size
        needs.append(diskspace.Need(Path(cache.location), sum(missing.values()),
                                    f"{len(missing)} chunk(s) to fetch into the local store, at their uncompressed size (an upper bound)"))
    return needs


def protected_paths(settings: Settings) -> list[Path]:
    """warmctl's own files and directories, where a snapshot's bundled files are never written:
    under its home the store, the run records (``state.json``, pid files) and the caches; the
    trusted keys, signing key, token and TLS files, the config file (``settings.config_file``)
    and /etc/warmctl. (The rest
    of the home, e.g. ``models/``, is not warmctl's state: a cache an engine keeps there may be
    bundled.)"""
    from warmctl.records.config import DEFAULT_CONFIG_FILE

    out = [settings.store_dir, settings.run_dir, settings.cache_dir, settings.keys_dir, DEFAULT_CONFIG_FILE.parent]
    out += [p for p in (settings.signing_key, settings.agent_token_file, settings.gate_api_key_file,
                        settings.gate_tls_cert, settings.gate_tls_key) if p is not None]
    if settings.config_file != DEFAULT_CONFIG_FILE:
        out.append(settings.config_file)
    return out


def link_or_copy(src: Path, dest: Path) -> None:
    """``dest`` as a hard link of ``src`` (a copy across file systems): the run's scratch
    directory is removed after ``up``, the cached file stays."""
    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def rebind(run: EngineRun, m: Manifest, reporter: Reporter) -> None:
    """Put the threads bound at snapshot time back on their CPUs (CRIU restores no affinity;
    :mod:`warmctl.checkpoint.affinity`); say what could not be."""
    done = affinity.apply(run.root_pid, m.restore.cpu_affinity)
    if note := done.note():
        reporter.warn(f"CPU binding: {note}")
