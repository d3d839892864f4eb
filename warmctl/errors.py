"""The exceptions warmctl raises on purpose. Each carries a message meant for the operator.

The CLI prints ``str(err)`` and exits with :attr:`WarmctlError.exit_code`; anything else is a
bug and is shown with its traceback.
"""


class WarmctlError(Exception):
    """Base class: an expected failure with an operator-facing message."""

    exit_code = 1


class HostError(WarmctlError):
    """The host lacks something warmctl needs (criu, a free port, disk space, a GPU...)."""


class EngineError(WarmctlError):
    """The engine failed to start, crashed, or did not become healthy in time."""


class CheckpointError(WarmctlError):
    """CRIU (or the CUDA checkpoint API) failed to dump or restore a process tree."""


class CanaryMismatch(WarmctlError):
    """The restored engine's canary output differs from the recorded one."""

    exit_code = 3


class SnapshotNotFound(WarmctlError):
    """No snapshot of that name (and tag) fits this host."""

    exit_code = 4


class IntegrityError(WarmctlError):
    """A stored object does not match its digest, is truncated, or is missing."""

    exit_code = 5
