"""The exceptions warmctl raises on purpose. Each carries a message meant for the operator.

The CLI prints ``str(err)`` and exits with :attr:`WarmctlError.exit_code`; anything else is a
bug and is shown with its traceback.

Every :class:`WarmctlError` subclass, wherever it is defined, has its own exit code, given in
one place: :data:`EXIT_CODES` (class name -> (code, defining module)); the table in
docs/exit-codes.md is the same list. The one exception is a *case* of a failure that code must
tell apart by type (not by message text) while scripts keep seeing the failure's code: such a
class subclasses the class whose code it shares (``RollbackRefused``, a ``TrustError``: 8). A subclass takes its code from the table when it is
defined (:meth:`WarmctlError.__init_subclass__`), and the agent client maps an error's class
name, as a job reports it, back to the same class (:func:`error_class`). Codes 0 (success),
2 and 7 (:data:`OTHER_EXIT_CODES`) are not errors of this family; codes above 125 are the
shell's.
"""

from __future__ import annotations

import importlib

#: class name -> (exit code, module that defines it). Codes never change meaning; a new class
#: takes the next free code.
EXIT_CODES: dict[str, tuple[int, str]] = {
    "WarmctlError": (1, "warmctl.base.errors"),
    "CanaryMismatch": (3, "warmctl.base.errors"),
    "SnapshotNotFound": (4, "warmctl.base.errors"),
    "IntegrityError": (5, "warmctl.base.errors"),
    "StoreLocked": (6, "warmctl.store.lock"),
    "TrustError": (8, "warmctl.naming.trust"),
    "ObjectNotFound": (9, "warmctl.store.backend"),
    "HostError": (10, "warmctl.base.errors"),
    "EngineError": (11, "warmctl.base.errors"),
    "CheckpointError": (12, "warmctl.base.errors"),
    "ConfigError": (13, "warmctl.records.config"),
    "CatalogError": (14, "warmctl.naming.catalog.errors"),
    "ProfileError": (15, "warmctl.records.profile"),
    "GateConfigError": (16, "warmctl.gate.files"),
    "TransientBackendError": (17, "warmctl.store.backend"),
    "BackendUnavailable": (18, "warmctl.store.backend"),
    "ChunkMissing": (19, "warmctl.store.chunkio"),
    "ChunkCorrupt": (20, "warmctl.store.chunkio"),
    "AgentError": (21, "warmctl.client"),
    "JobFailed": (22, "warmctl.client"),
    "Conflict": (23, "warmctl.agent.jobs"),
    "RankCheckpointError": (24, "warmctl.checkpoint.ranks"),
    "InsufficientGpuMemory": (25, "warmctl.checkpoint.ranks"),
    "InsufficientHostMemory": (26, "warmctl.checkpoint.ranks"),
    "PhaseTimeout": (27, "warmctl.checkpoint.ranks"),
    "CudaCheckpointError": (28, "warmctl.checkpoint.cuda"),
    "CudaUnavailable": (29, "warmctl.checkpoint.cuda"),
    "DriverTooOld": (30, "warmctl.checkpoint.cuda"),
    "NotSupported": (31, "warmctl.checkpoint.cuda"),
    "GpuOutOfMemory": (32, "warmctl.checkpoint.cuda"),
    "IllegalState": (33, "warmctl.checkpoint.cuda"),
    "LockTimeout": (34, "warmctl.checkpoint.cuda"),
    "LockLost": (35, "warmctl.store.lock"),
    "LazyPagesError": (36, "warmctl.checkpoint.criu"),
    "SecretInSnapshot": (37, "warmctl.records.credentials"),
    "SealKeyError": (38, "warmctl.store.sealed"),
    "RankError": (39, "warmctl.checkpoint.layout"),
    "CredentialInProfile": (40, "warmctl.records.profile"),
    "KubeError": (41, "warmctl.kube.client"),
    "ImageMismatch": (42, "warmctl.base.errors"),
    "RemoteTooSlow": (43, "warmctl.store.backend"),
    "DumpTimeout": (44, "warmctl.checkpoint.criu"),
    # cases of a failure above that code tells apart by type; each exits with its parent's code
    "RollbackRefused": (8, "warmctl.naming.catalog.errors"),
}
#: Exit codes that are not error classes: 2 is click's usage error; ``up --foreground`` exits
#: :data:`warmctl.cli.foreground.ENGINE_DIED_EXIT` (7) when the engine it supervises dies.
OTHER_EXIT_CODES = {2: "command-line usage error (click)", 7: "up --foreground: the supervised engine died"}


class WarmctlError(Exception):
    """Base class: an expected failure with an operator-facing message. ``exit_code``: the
    class's code from :data:`EXIT_CODES`."""

    exit_code = 1

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        entry = EXIT_CODES.get(cls.__name__)
        if entry is not None and entry[1] == cls.__module__:
            cls.exit_code = entry[0]


def error_class(name: str) -> type[WarmctlError] | None:
    """The :class:`WarmctlError` subclass called ``name`` (as a job reports ``type``), imported
    from its module if need be; ``None`` for a name not in :data:`EXIT_CODES`."""
    entry = EXIT_CODES.get(name)
    if entry is None:
        return None
    try:
        cls = getattr(importlib.import_module(entry[1]), name, None)
    except ImportError:
        return None
    return cls if isinstance(cls, type) and issubclass(cls, WarmctlError) else None


def rebuild(name: str, message: str) -> WarmctlError | None:
    """An instance of the class ``name`` carrying ``message`` (its ``str``), for errors that
    crossed a process boundary (the agent's jobs); ``None`` if ``name`` is not a known class.
    Classes whose constructor wants more than a message get the message only (their extra
    attributes are not rebuilt)."""
    cls = error_class(name)
    if cls is None:
        return None
    try:
        return cls(message)
    except Exception:  # noqa: BLE001 - a constructor with other arguments
        err = cls.__new__(cls)
        Exception.__init__(err, message)
        return err


class HostError(WarmctlError):
    """The host lacks something warmctl needs (criu, a free port, disk space, a GPU...)."""


class EngineError(WarmctlError):
    """The engine failed to start, crashed, or did not become healthy in time."""


class CheckpointError(WarmctlError):
    """CRIU (or the CUDA checkpoint API) failed to dump or restore a process tree."""


class CanaryMismatch(WarmctlError):
    """The restored engine's canary output differs from the recorded one."""


class SnapshotNotFound(WarmctlError):
    """No snapshot of that name (and tag) fits this host."""


class IntegrityError(WarmctlError):
    """A stored object does not match its digest, is truncated, or is missing."""


class ImageMismatch(SnapshotNotFound):
    """The snapshot was made in another container image than the one this pod runs (or made
    in one, and this host runs in none, or the reverse): the message names both digests (the
    ``image_digest`` setting; the catalog's "image" rule)."""
