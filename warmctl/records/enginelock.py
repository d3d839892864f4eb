"""One ``up`` or ``down`` of an engine name at a time on this host, and what the last one did.

``up`` can be started twice for the same name at the same moment (a scheduler's
``POST /v1/engines/NAME/up`` and the ``warmctl-up@NAME`` unit at boot). Each holds
:func:`hold` for its whole run: an exclusive ``flock`` on ``<home>/run/.locks/NAME.lock``
(released by the kernel when the holder exits, however it ends, so a ``kill -9`` never leaves
a stale lock). A second caller waits for the first, then reads what the first recorded in the
same file (:class:`Outcome`) and acts on it (:mod:`warmctl.pipelines.lifecycle`): a finished ``up`` means
"already up", a failed one is reported as its failure, not retried. Two different names never
wait for each other.

The file holds one JSON object, rewritten in place under the lock::

    {"op": "up", "pid": 1234, "started_at": 1764520000.1, "finished_at": 1764520004.3,
     "ok": true, "error_type": null, "error_module": null, "message": null, "exit_code": 0}

``ok`` is null while the holder runs, and stays null when it was killed or interrupted or hit
a bug (anything but a :class:`~warmctl.base.errors.WarmctlError`): the next holder then treats the
engine like any crash's leftovers and tries itself.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from warmctl.base.errors import WarmctlError
from warmctl.base.flock import lock_exclusive


@dataclass
class Outcome:
    """What the previous holder of a name's lock recorded: ``op`` (``"up"``/``"down"``), its
    ``pid``, ``started_at``/``finished_at`` (Unix seconds; ``finished_at`` None if it never
    finished), ``ok`` (None: killed or still running), and on failure the error's class
    (``error_module``.``error_type``), ``message`` and ``exit_code``."""

    op: str = ""
    pid: int = 0
    started_at: float = 0.0
    finished_at: float | None = None
    ok: bool | None = None
    error_type: str | None = None
    error_module: str | None = None
    message: str | None = None
    exit_code: int = 0

    def error(self, name: str) -> WarmctlError:
        """The recorded failure as an exception of the same class (hence the same exit code and
        agent error type) when that class takes a message, else a :class:`WarmctlError` with the
        recorded exit code; its message says it is the failure of the ``up`` waited for."""
        msg = (f"{self.message}\n(the concurrent `{self.op} {name}` this one waited for, pid {self.pid}, "
               f"failed with this; not retried)")
        cls: type | None = None
        try:
            cls = getattr(importlib.import_module(self.error_module or ""), self.error_type or "")
        except (ImportError, AttributeError, ValueError):
            cls = None
        if isinstance(cls, type) and issubclass(cls, WarmctlError):
            try:
                return cls(msg)
            except TypeError:
                pass
        err = WarmctlError(msg)
        err.exit_code = self.exit_code or 1
        return err


@dataclass
class Held:
    """A held lock: ``waited`` is True when another holder had it first, ``previous`` what the
    last holder recorded (None if nothing was ever recorded)."""

    waited: bool
    previous: Outcome | None


#: The directory of the lock files inside the run directory (not an engine: a leading dot is
#: outside the name rule, and agent recovery passes it by).
LOCKS = ".locks"


def lock_path(run_dir: Path, name: str) -> Path:
    """``<run_dir>/.locks/NAME.lock``. Raises ValueError for a name that is not one file name
    (callers check the name rule first, :mod:`warmctl.base.names`)."""
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"engine name {name!r} cannot name a lock file")
    return Path(run_dir) / LOCKS / f"{name}.lock"


def _read(fd: int) -> Outcome | None:
    try:
        data = os.pread(fd, 65536, 0)
        return Outcome(**json.loads(data)) if data.strip() else None
    except (OSError, ValueError, TypeError):
        return None


def _write(fd: int, o: Outcome) -> None:
    data = json.dumps(o.__dict__).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


@contextmanager
def hold(run_dir: Path, name: str, op: str, on_wait: Callable[[Outcome | None], None] | None = None) -> Iterator[Held]:
    """Hold the lock of engine ``name`` for ``op`` (``"up"`` or ``"down"``) while the block runs,
    waiting for another holder first (``on_wait`` is called once, with what that holder
    recorded, before the wait). The block's end is recorded: ``ok`` true, or the error's class,
    message and exit code when it raised a :class:`WarmctlError`. Raises OSError if the lock
    file cannot be created."""
    p = lock_path(run_dir, name)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        waited = lock_exclusive(fd, on_wait=None if on_wait is None else lambda: on_wait(_read(fd)))
        held = Held(waited, _read(fd))
        mine = Outcome(op=op, pid=os.getpid(), started_at=time.time())
        _write(fd, mine)
        try:
            yield held
        except WarmctlError as e:
            mine.finished_at, mine.ok = time.time(), False
            mine.error_type, mine.error_module = type(e).__name__, type(e).__module__
            mine.message, mine.exit_code = str(e) or type(e).__name__, e.exit_code
            _write(fd, mine)
            raise
        except BaseException:
            mine.finished_at = time.time()  # ok stays None: interrupted or a bug, not an answer
            _write(fd, mine)
            raise
        mine.finished_at, mine.ok = time.time(), True
        _write(fd, mine)
    finally:
        os.close(fd)  # releases the flock
