"""The lazy-pages watch: a lazily restored engine's memory is still being copied in by a
``criu lazy-pages`` daemon while the public port is open; the gate watches that daemon (a
pidfd, no polling) and takes the engine down if it exits before its copy ended, since pages
never copied read as zeros."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from warmctl.base.proc import ProcessId, kill_tree


@dataclass
class LazyWatch:
    """What the gate watches of a lazy restore (:func:`warmctl.checkpoint.criu.lazy_restore`):
    the ``criu lazy-pages`` daemon (``daemon``: its recorded identity), its ``log``, the
    engine's root (``engine``: recorded identity, killed with its tree if the daemon exits
    before its copy ended) and ``failed``: the file the gate writes the reason to then (read
    by ``warmctl status``). Sent by ``up`` as JSON after ``open PID`` (:meth:`PendingGate.open`)."""

    daemon: "ProcessId"
    log: Path
    engine: "ProcessId"
    failed: Path

    def to_json(self) -> str:
        return json.dumps({"daemon": self.daemon.as_record(), "log": str(self.log),
                           "engine": self.engine.as_record(), "failed": str(self.failed)})

    @classmethod
    def from_json(cls, text: str) -> "LazyWatch":
        d = json.loads(text)
        ids = [ProcessId.from_record(x) for x in (d["daemon"], d["engine"])]
        if None in ids:
            raise ValueError("a process record without pid and start/ctime")
        return cls(ids[0], Path(d["log"]), ids[1], Path(d["failed"]))  # type: ignore[arg-type]

    def attach(self) -> tuple[int | None, str | None]:
        """Open a pidfd on the daemon (:func:`os.pidfd_open`). Returns (pidfd, None) while it
        runs; (None, None) when it has already exited with its copy complete; (None, reason)
        when it exited before the copy ended (the gate must not open)."""
        from warmctl.checkpoint.criu import lazy_log_status

        try:
            fd = os.pidfd_open(self.daemon.pid)
        except ProcessLookupError:
            fd = None
        if fd is not None and self.daemon.alive():  # the pidfd names *that* process, not a reuse of its PID
            return fd, None
        if fd is not None:
            os.close(fd)
        st = lazy_log_status(self.log)
        return None, (None if st.complete else st.reason)

    def incomplete(self) -> str | None:
        """Once the daemon has exited: None if its log shows the copy complete, else why not."""
        from warmctl.checkpoint.criu import lazy_log_status

        st = lazy_log_status(self.log)
        if st.complete:
            print(f"gate: the lazy-pages daemon (pid {self.daemon.pid}) finished: {st.copied:,} pages copied into "
                  f"{len(st.processes)} processes", flush=True)
            return None
        return st.reason

    def take_down(self, server, writers: list) -> bool:
        """Once the daemon has exited: if its copy did not end (:meth:`incomplete`), close the
        public port (``server``, an ``asyncio.Server``), abort every client connection
        (``writers``), write why to :attr:`failed` and kill the engine's tree; return True.
        False (nothing done) if the copy was complete."""
        why = self.incomplete()
        if why is None:
            return False
        msg = (f"the lazy-pages daemon (pid {self.daemon.pid}) exited before it had copied every page into the "
               f"engine ({why}): pages never copied read as zeros")
        print(f"gate: {msg}; closing the public port, aborting {len(writers)} connection(s), killing the engine "
              f"(pid {self.engine.pid})", flush=True)
        server.close()  # no new connection from here on
        for w in writers:
            w.transport.abort()  # in-flight answers may come from wrong memory: cut them
        try:
            self.failed.write_text(msg + "\n")
        except OSError as e:
            print(f"gate: cannot write {self.failed}: {e.strerror}", flush=True)
        kill_tree(self.engine, timeout_s=5)
        return True
