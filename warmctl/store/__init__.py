"""Content-addressed snapshot store: chunks and manifests, by digest, on local disk, S3 or an OCI registry.

Typical use::

    from warmctl.store import copy_manifest, open_store
    with open_store("/var/lib/warmctl/store") as store:
        refs = store.add_file(Path("pages-1.img"))        # list[ChunkRef]
        digest = store.put_manifest(manifest)              # after every chunk is stored
    copy_manifest(open_store(local_dir), open_store("s3://bucket/warmctl"), digest)

The store names nothing: names and tags are the catalog's (:mod:`warmctl.naming.catalog`), and
:mod:`warmctl.naming.fleet` copies them between stores with what they name.

The format is specified in ``docs/store-format.md``; docs/design.md ("The store") maps the
modules of this package.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from warmctl.store.backend import (
    DEFAULT_OUTAGE_WINDOW,
    Backend,
    BackendProperties,
    BackendUnavailable,
    ObjectInfo,
    ObjectNotFound,
    RemoteTooSlow,
    RetryingBackend,
    TransferBound,
    TransientBackendError,
)
from warmctl.store.cache import CachingBackend, Fetched
from warmctl.store.chunkio import ChunkCorrupt, ChunkMissing
from warmctl.store.chunks import CHUNK_SIZE, DIGEST_ALGORITHM, STORE_FORMAT, ZSTD_LEVEL
from warmctl.store.layout import chunk_key, manifest_key
from warmctl.store.local import LocalBackend
from warmctl.store.lock import LockLost, StoreLocked
from warmctl.store.sealed import SEALED, SealedBackend, SealKeyError, load_key, read_seal
from warmctl.store.store import CacheFill, Store

if TYPE_CHECKING:
    from warmctl.records.config import Settings
    from warmctl.store.copy import copy_manifest
    from warmctl.store.reports import ChunkProblem, CopyReport, DuReport, DuRow, GcReport, VerifyReport
    from warmctl.store.s3 import S3Backend

__all__ = [
    "Backend",
    "BackendProperties",
    "BackendUnavailable",
    "CHUNK_SIZE",
    "CachingBackend",
    "ChunkCorrupt",
    "ChunkMissing",
    "ChunkProblem",
    "CopyReport",
    "DEFAULT_OUTAGE_WINDOW",
    "DIGEST_ALGORITHM",
    "DuReport",
    "DuRow",
    "Fetched",
    "GcReport",
    "LocalBackend",
    "ObjectInfo",
    "ObjectNotFound",
    "RemoteTooSlow",
    "RetryingBackend",
    "S3Backend",
    "SealedBackend",
    "SealKeyError",
    "STORE_FORMAT",
    "CacheFill",
    "Store",
    "LockLost",
    "StoreLocked",
    "TransferBound",
    "TransientBackendError",
    "VerifyReport",
    "ZSTD_LEVEL",
    "chunk_key",
    "copy_manifest",
    "manifest_key",
    "open_backend",
    "open_store",
]


#: Names imported from their module when first asked for: S3Backend (and an s3:// URL) only by
#: an S3 store's users, so a local store's (`warmctl up` from the local store) never load
#: boto3, http.client and ssl for it; copying between stores and the maintenance reports only
#: by the commands that copy, verify, collect garbage or count (not by `up`)
_LAZY = {"S3Backend": "warmctl.store.s3", "copy_manifest": "warmctl.store.copy",
         **{n: "warmctl.store.reports" for n in ("ChunkProblem", "CopyReport", "DuReport", "DuRow", "GcReport",
                                                  "VerifyReport")}}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_backend(url: str | Path, retry: bool = True, outage_window: float | None = None, unseal: bool = True,
                 *, settings: "Settings | None" = None) -> Backend:
    """The backend for ``url``: a directory path or ``file:///path`` (local), or
    ``s3://bucket[/prefix]`` (endpoint: the ``s3_endpoint`` setting, else ``$AWS_ENDPOINT_URL``;
    credentials from boto3's usual chain), or ``oci://HOST[:PORT]/REPOSITORY`` (an OCI registry,
    :mod:`warmctl.store.oci`: pack size, read deadline, CA and plain-HTTP registries from the
    ``oci_*`` settings; credentials from the Docker config).

    ``settings``: the :class:`warmctl.records.config.Settings` the caller resolved at its edge (CLI,
    agent, test); None: the built-in defaults (``Settings()``; no config file or environment
    is read here). S3 and OCI backends bound each transfer by ``settings.remote_deadline_floor_s``
    + its size / ``settings.remote_min_rate_bytes_s`` (:class:`TransferBound`; past it
    :class:`RemoteTooSlow`). Remote backends are wrapped in :class:`RetryingBackend` when ``retry``,
    retrying an outage for ``outage_window`` seconds (default: ``settings.s3_outage_s``); a
    sealed store (one holding ``sealed.json``, :mod:`warmctl.store.sealed`) in
    :class:`SealedBackend` with ``settings.seal_key`` (``unseal=False``: the raw backend,
    objects as stored). Raises ValueError for another scheme, :class:`SealKeyError` for an
    unusable key file."""
    s = _settings(settings)
    b = _open_plain(url, retry, outage_window, s)
    if unseal and b.exists(SEALED):  # a sealed store: objects encrypted with this host's fleet key
        return _sealed(b, s.seal_key)
    return b


def _settings(settings: "Settings | None") -> "Settings":
    if settings is not None:
        return settings
    from warmctl.records.config import Settings

    return Settings()


def _sealed(b: Backend, path: Path | None) -> Backend:
    """``b`` (a sealed store's backend) wrapped in :class:`SealedBackend` with the key file
    ``path`` (the ``seal_key`` setting; None: every sealed object raises :class:`SealKeyError`
    naming the key ids)."""
    doc = read_seal(b)
    assert doc is not None
    return SealedBackend(b, load_key(path) if path else None, doc, path)


def _open_plain(url: str | Path, retry: bool, outage_window: float | None, settings: "Settings") -> Backend:
    s = str(url)
    u = urlparse(s)
    window = settings.s3_outage_s if outage_window is None else outage_window
    bound = TransferBound(settings.remote_deadline_floor_s, settings.remote_min_rate_bytes_s)
    if u.scheme == "oci":
        from warmctl.store.oci import OCIBackend, parse_url

        b: Backend = OCIBackend(*parse_url(s), pack_bytes=settings.oci_pack_bytes,
                                read_deadline=settings.oci_read_deadline_s, ca_bundle=settings.oci_ca_bundle,
                                certs_d=settings.oci_certs_d, insecure=settings.oci_insecure, bound=bound)
        return _retrying(b, retry, window)
    if u.scheme == "s3":
        if not u.netloc:
            raise ValueError(f"store URL {s!r} names no bucket (want s3://bucket/prefix)")
        from warmctl.store.s3 import S3Backend

        return _retrying(S3Backend(u.netloc, u.path.lstrip("/"), endpoint_url=settings.s3_endpoint, bound=bound,
                                   read_timeout=settings.s3_read_timeout_s),
                         retry, window)
    if u.scheme == "file":
        return LocalBackend(Path(u.path))
    if u.scheme in ("", None) or (len(u.scheme) == 1 and s[1:2] == ":"):
        return LocalBackend(Path(s).expanduser())
    raise ValueError(f"unsupported store URL {s!r}: use a directory, file:///path, s3://bucket/prefix or oci://HOST[:PORT]/REPOSITORY")


def _retrying(b: Backend, retry: bool, outage_window: float) -> Backend:
    """``b`` in a :class:`RetryingBackend` retrying an outage for ``outage_window`` seconds
    (the ``s3_outage_s`` setting, which every remote backend shares), or ``b`` itself without
    ``retry``."""
    if not retry:
        return b
    return RetryingBackend(b, outage_window, setting="s3_outage_s")


def open_store(url: str | Path, workers: int | None = None, chunk_size: int = CHUNK_SIZE,
               *, settings: "Settings | None" = None) -> Store:
    """A :class:`Store` on ``url`` (see :func:`open_backend`, which gets ``settings``; its
    ``lock_stale_s`` is the lifetime of the store's locks). ``workers``: parallel threads
    (default 4 local, 16 S3); ``chunk_size``: bytes per new chunk. Nothing is created until
    the first write. Raises ValueError for an unsupported URL."""
    s = _settings(settings)
    return Store(open_backend(url, settings=s), workers=workers, chunk_size=chunk_size, lock_stale_after=s.lock_stale_s)
