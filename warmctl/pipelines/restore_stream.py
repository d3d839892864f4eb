"""The streamed restore (the ``restore_stream`` setting, :mod:`warmctl.checkpoint.stream`):
the image is written by :meth:`~warmctl.checkpoint.imagecache.ImageCache.get` on a thread of
its own (:class:`ImageWriter`) while ``criu restore --stream`` reads each file as its chunks
are verified and written. :func:`streams` says when a restore streams;
:func:`materialize_and_restore_streamed` is :func:`warmctl.pipelines.lifecycle`'s "materialize" and
"restore" phases for it.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from warmctl.checkpoint import criu, criuimage
from warmctl.checkpoint.filedigest import DigestCache
from warmctl.checkpoint.imagecache import CachedImage, ImageCache, entry_sizes
from warmctl.records.config import Settings
from warmctl.engine.run import EngineRun
from warmctl.base.errors import CheckpointError
from warmctl.records.manifest import Manifest
from warmctl.pipelines.materialize import check_restorable, link_weights, other_writes, protected_paths, put_back, rebind, say_image
from warmctl.records.progress import Reporter
from warmctl.records.state import EngineState
from warmctl.store import CacheFill

if TYPE_CHECKING:
    from warmctl.checkpoint.stream import ImageStreamer


def streams(settings: Settings, images: ImageCache, m: Manifest, digest: str, pages: str,
             plugins: tuple[str, ...]) -> bool:
    """Whether this restore streams its image to CRIU while it is written (the
    ``restore_stream`` setting): only when the image must be written (no intact entry on this
    host), the pages are restored eagerly and no CRIU plugin is loaded (streamed images with
    plugins are not verified)."""
    return (settings.restore_stream == "auto" and pages == "eager" and not plugins
            and images.lookup(m, digest) is None)


class ImageWriter:
    """:meth:`ImageCache.get` on its own thread, feeding an :class:`ImageStreamer`: on failure
    the streamer is told (CRIU's pipes end early) and :meth:`join` raises the write's error."""

    def __init__(self, write, streamer: ImageStreamer):
        self.img: CachedImage | None = None
        self.error: BaseException | None = None
        self._streamer = streamer
        self._write = write
        self._thread = threading.Thread(target=self._run, name="warmctl-image-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.img = self._write()
            self._streamer.complete(self.img.path)  # an entry found whole after all: served from it
        except BaseException as e:  # noqa: BLE001 - handed to join()
            self.error = e
            self._streamer.fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

    def join(self) -> CachedImage:
        """The written entry; raises the write's error."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.img is not None
        return self.img


def materialize_and_restore_streamed(run: EngineRun, st: EngineState, found, images: ImageCache,
                                      settings: Settings, reporter: Reporter, plugins: tuple[str, ...],
                                      netlock: str | None, fill: CacheFill | None = None) -> tuple[CachedImage, None, dict]:
    """:func:`warmctl.pipelines.lifecycle._materialize_and_restore` for an image this host does not hold, streamed
    (``restore_stream``, :mod:`warmctl.checkpoint.stream`): the image is written by
    :meth:`ImageCache.get` on a thread while ``criu restore --stream`` reads each file as its
    chunks are verified and written. "materialize" lasts until CRIU can start (the ``/dev/shm``
    files written, the bundled files in place); "restore" until CRIU has restored the tree and
    the image is whole. A bad chunk fails CRIU's restore (its pipe ends early) and ``up``
    reports the chunk's error, not CRIU's; nothing is left (the entry is written or removed
    whole, as without streaming). Returns the entry, None (no lazy-pages daemon) and what CRIU
    read (:attr:`warmctl.records.contract.UpResult.streamed`). ``found``: the catalog's answer
    (``warmctl.pipelines.lifecycle._Found``: manifest, digest, store, cache, fetched)."""
    from warmctl.checkpoint.stream import ImageStreamer, StreamError  # only a streamed restore serves the image so

    m, store, digest = found.manifest, found.store, found.digest
    assert m is not None and digest is not None
    total = m.total_size()
    progress = {"to": reporter.bytes_progress("materialize", total)}
    shm = [r for r in entry_sizes(m) if r.startswith("shm/")]
    # the mount namespace's image (small, written with CRIU's metadata before the pages): the
    # external mounts the restore must name (criu.restore_mount_flags)
    mount_images = [r for r in entry_sizes(m) if re.fullmatch(r"images/mountpoints-\d+\.img", r)]
    sock_dir = Path(tempfile.mkdtemp(prefix="warmctl-stream-"))  # short: a socket path has 107 bytes
    writer = None
    try:
        with ImageStreamer(entry_sizes(m), sock_dir) as streamer:
            with reporter.phase("materialize", f"verifying and writing {total / 2**20:,.0f} MiB, streamed to CRIU"):
                check_restorable(m, digest, protected_paths(settings), DigestCache.for_settings(settings), reporter)
                writer = ImageWriter(lambda: images.get(
                    store, m, digest, progress=lambda n: progress["to"](n), cache=found.cache, fetched=found.fetched,
                    also=lambda: other_writes(m, found.cache), scratch=run.unkept_image,
                    command=f"up {m.name} ({digest[:19]})", fill=fill, watch=streamer), streamer)
                try:
                    sources = streamer.wait(shm + mount_images)
                except StreamError:
                    writer.join()  # the write's own error
                    raise
                mounts = criuimage.mount_keys(sources[r] for r in mount_images)
                put_back(run, m, store, images, lambda rel: sources[rel], progress["to"], found.cache, found.fetched, fill)
                run.prepare()
                run.log_path.touch()
            run.record(st)
            with reporter.phase("restore", "CRIU restore of the process tree, streamed as the image is written"):
                progress["to"] = reporter.bytes_progress("restore (image written)", total)
                try:
                    pid = criu.restore(sock_dir, run.criu_pidfile, log_file=run.restore_log, binary=settings.criu,
                                       work_dir=run.dir, plugins=plugins, network_lock=netlock, stream=True,
                                       xtile_lib=settings.xtile_perm_lib, mounts=mounts)[0]
                except CheckpointError:
                    writer.join()  # a bad chunk ended CRIU's pipes: that is the error to report
                    raise
                run.adopt_restored(pid)
                img = writer.join()
                report = streamer.close(check=False)
                for why in report.errors:  # CRIU restored the tree; the canary judges its memory
                    reporter.warn(f"image streamer: {why}")
                rebind(run, m, reporter)
    except BaseException:
        if writer is not None:
            try:
                img = writer.join()
            except BaseException:  # noqa: BLE001 - the first error is the one to report
                pass
            else:
                images.release(img)
        raise
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    say_image(img, reporter)
    link_weights(run, m, img)
    return img, None, {"files": len(report.served), "bytes": sum(report.served.values()), "waited_s": report.waited_s}
