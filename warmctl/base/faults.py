"""A test hook that kills warmctl at a named point, to try what a crash there leaves.

With ``WARMCTL_TEST_KILL_AT_PHASE=NAME`` in its environment, warmctl sends itself SIGKILL when
it reaches the point ``NAME``: the start of every timed phase of ``snapshot`` and ``up``
(:meth:`warmctl.records.progress.Reporter.phase`: ``cold_start``, ``warmup``, ``canary_record``,
``criu_dump``, ``store``, ``publish``, ``push``; ``materialize``, ``restore``, ``health``,
``canary``, ``gate``...) and the steps of the store commands that have no timed phase:
``transfer_chunks``, ``transfer_manifest``, ``transfer_catalog`` (``push``/``pull``, after the
chunks, manifest and signatures respectively are written: :func:`warmctl.naming.fleet.transfer`),
``gc_manifests`` and ``gc_chunks`` (``gc``, after its first removal of each kind), and
``serving_record`` (``up``: the public port is open, the engine not yet recorded as serving) and
``serving`` (``up``: the engine recorded as serving, before ``up`` returns). Nothing runs after
the signal: no ``finally``, no ``atexit``, as with ``kill -9`` or a power loss of the process. ``NAME:SIG`` sends signal ``SIG`` instead (``serving:TERM``: a stop
that lands in that moment, as a pod deleted as soon as it is Ready). Unset (always, outside
tests), :func:`point` costs one dictionary lookup.
Processes warmctl starts (the engine, the gate) inherit the variable and never read it.

The hooks that kill or stop one rank of an engine (``WARMCTL_TEST_KILL_RANK``) are
:mod:`warmctl.checkpoint.rankfaults`, beside the rank model they find ranks with.
"""

from __future__ import annotations

import os
import signal

#: The environment variable naming the point to die at.
ENV = "WARMCTL_TEST_KILL_AT_PHASE"


def point(name: str) -> None:
    """SIGKILL this process if ``WARMCTL_TEST_KILL_AT_PHASE`` is ``name``; send it ``SIGSIG`` if the
    variable is ``name:SIG`` (see module doc)."""
    want = os.environ.get(ENV)
    if want is None:
        return
    at, _, sig = want.partition(":")
    if at == name:
        os.kill(os.getpid(), signal.Signals[f"SIG{sig}"] if sig else signal.SIGKILL)
