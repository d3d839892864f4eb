"""Result types of the store's maintenance and copying: what verify, gc, du and push/pull report.

Plain dataclasses (no I/O); sizes are bytes, times seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChunkProblem:
    """A chunk that is ``missing`` or ``corrupt`` (``reason``), where it is, and who needs it."""

    digest: str
    location: str
    reason: str
    manifests: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.digest} at {self.location}: {self.reason} (used by {', '.join(self.manifests) or 'no manifest'})"


@dataclass
class VerifyReport:
    """Result of :func:`warmctl.store.maintenance.verify`: counts (bytes uncompressed) and every problem found."""

    manifests_checked: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    missing: list[ChunkProblem] = field(default_factory=list)
    corrupt: list[ChunkProblem] = field(default_factory=list)
    bad_manifests: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.corrupt or self.bad_manifests)

    def __str__(self) -> str:
        lines = [
            f"checked {self.manifests_checked} manifests, {self.chunks_checked} chunks, {self.bytes_checked:,} bytes: "
            + ("OK" if self.ok else f"{len(self.missing)} missing, {len(self.corrupt)} corrupt, {len(self.bad_manifests)} bad manifests")
        ]
        lines += [f"missing {p}" for p in self.missing]
        lines += [f"corrupt {p}" for p in self.corrupt]
        lines += [f"bad manifest {m}" for m in self.bad_manifests]
        return "\n".join(lines)


@dataclass
class GcReport:
    """Result of :func:`warmctl.store.maintenance.gc` (bytes are stored, i.e. compressed, sizes)."""

    manifests_kept: int = 0
    manifests_removed: list[str] = field(default_factory=list)
    chunks_kept: int = 0
    chunks_removed: int = 0
    bytes_removed: int = 0
    chunks_too_new: int = 0
    tmp_removed: int = 0
    locks_removed: int = 0
    attachments_removed: int = 0  # signatures of manifests no longer stored
    dry_run: bool = False


@dataclass
class DuRow:
    """Space used by one manifest: ``logical`` (file bytes), ``stored`` (compressed bytes of its
    chunks), ``unique`` (stored bytes no other manifest uses), ``shared`` (stored - unique),
    ``zero`` (bytes of all-zero chunks, not stored)."""

    digest: str
    tags: list[str]
    name: str
    logical: int
    stored: int
    unique: int
    shared: int
    zero: int
    missing_chunks: int = 0


@dataclass
class DuReport:
    """Result of :func:`warmctl.store.maintenance.du`: a row per manifest plus store totals (bytes)."""

    rows: list[DuRow]
    total_stored: int
    unreferenced: int
    chunk_count: int


@dataclass
class CopyReport:
    """Result of :func:`push`/:func:`pull`: ``digest`` copied; chunk counts; ``bytes_copied``
    (stored bytes moved), ``logical`` (file bytes of the snapshot); ``seconds`` wall time."""

    digest: str
    chunks_total: int = 0
    chunks_copied: int = 0
    bytes_copied: int = 0
    logical: int = 0
    seconds: float = 0.0
