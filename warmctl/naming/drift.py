"""Stale snapshots: which fields of a profile changed since a snapshot was made from it.

A manifest embeds the validated profile it was made from (``Manifest.profile``, with its
``profile_digest``); ``up`` restores a snapshot only when that digest is the profile's on disk.
When they differ, every listing names the snapshot as made from another version of the profile
and which fields changed (:func:`warmctl.records.profile.diff_profiles`): ``warmctl ls``, ``warmctl
status``, ``GET /v1/snapshots``, ``up`` (before it cold-starts) and ``warmctl snapshot`` (before it
starts), and ``warmctl profile diff NAME`` shows it in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from warmctl.records.profile import Profile, ProfileError, describe_diff, diff_profiles, find_profile, load_profile_file

if TYPE_CHECKING:
    from warmctl.naming.catalog import CatalogEntry
    from warmctl.records.config import Settings


@dataclass
class Drift:
    """How a snapshot's embedded profile compares with the profile file of the same name.

    ``profile_file``: the file a lookup of the name finds (None: no such profile here, nothing
    to compare). ``current``: digests equal. ``changes``: ``(dotted field, in the snapshot, on
    disk)`` when not current; empty with ``current`` False means the digests differ but no
    field does once defaults are filled in (a warmctl with other profile fields made it).
    ``error``: the profile file does not load (its message)."""

    name: str
    profile_file: Path | None = None
    current: bool | None = None
    changes: list[tuple[str, object, object]] = field(default_factory=list)
    error: str | None = None

    @property
    def stale(self) -> bool:
        return self.current is False

    def message(self, what: str) -> str:
        """One line for ``what`` (e.g. ``snapshot tiny:latest (sha256:1234...)``), or "" when
        nothing is to be said."""
        if self.error:
            return f"{what}: profile {self.name} does not load, so it cannot be compared: {self.error.splitlines()[0]}"
        if not self.stale:
            return ""
        head = f"{what} was made from another version of profile {self.name}" + (
            f" ({self.profile_file})" if self.profile_file else "")
        if not self.changes:
            return head + ": no field differs once defaults are filled in (made by a warmctl whose profiles had other fields)"
        return f"{head}; changed: {describe_diff(self.changes)}"

    def as_json(self) -> dict:
        """``{"profile_file", "current", "changes": [{"field", "snapshot", "profile"}], "error"}``."""
        return {"profile_file": str(self.profile_file) if self.profile_file else None, "current": self.current,
                "changes": [{"field": k, "snapshot": a, "profile": b} for k, a, b in self.changes], "error": self.error}


def compare(snapshot_profile: dict, snapshot_digest: str, profile: Profile, profile_file: Path | None = None) -> Drift:
    """:class:`Drift` of a snapshot (its embedded profile and its ``profile_digest``) against
    ``profile`` (read from ``profile_file``, named in the message when given)."""
    d = Drift(profile.name, profile_file, current=snapshot_digest == profile.digest())
    if not d.current:
        d.changes = diff_profiles(snapshot_profile, profile)
    return d


def profile_source(name: str, search: list[Path] | None = None) -> Path | None:
    """The file a lookup of profile ``name`` finds, or None."""
    try:
        return find_profile(name, search)
    except ProfileError:
        return None


class DriftCache:
    """Compares many snapshots with the profiles on disk, loading each profile file once.

    ``search``: the configured ``profile_dirs``."""

    def __init__(self, search: list[Path] | None = None):
        self.search = search
        self._profiles: dict[str, tuple[Path | None, Profile | None, str | None]] = {}

    def _profile(self, name: str) -> tuple[Path | None, Profile | None, str | None]:
        if name not in self._profiles:
            path = profile_source(name, self.search)
            prof, err = None, None
            if path is not None:
                try:
                    prof = load_profile_file(path)
                except ProfileError as e:
                    err = str(e)
            self._profiles[name] = (path, prof, err)
        return self._profiles[name]

    def drift(self, name: str, snapshot_digest: str, snapshot_profile: dict | None) -> Drift:
        """The :class:`Drift` of a snapshot of ``name`` (``snapshot_profile`` None: the manifest
        could not be read; the digests still decide ``current``)."""
        path, prof, err = self._profile(name)
        if path is None:
            return Drift(name)
        if prof is None:
            return Drift(name, path, error=err)
        if snapshot_profile is None:
            return Drift(name, path, current=snapshot_digest == prof.digest())
        return compare(snapshot_profile, snapshot_digest, prof, path)


def against_newest(store_url: str | Path, profile: Profile, tag: str | None = None,
                   profile_file: Path | None = None, *, settings: "Settings | None" = None) -> tuple[CatalogEntry, Drift] | None:
    """``(catalog entry, Drift)`` of the newest snapshot of ``profile.name`` (of ``tag``, or of any
    tag) in the catalog of the store at ``store_url`` against ``profile``; None when there is
    none. Only reads (no lock is taken). ``settings``: as for :func:`warmctl.store.open_store`."""
    from warmctl.naming.catalog import Catalog
    from warmctl.base.errors import WarmctlError
    from warmctl.store import open_store

    store = open_store(store_url, settings=settings)
    cat = Catalog(store)
    entries = [e for t in ([tag] if tag else cat.tags(profile.name)) for e in cat.entries(profile.name, t)]
    if not entries:
        return None
    e = max(entries, key=lambda x: x.created)
    try:
        m = store.get_manifest(e.manifest)
    except WarmctlError:
        return e, Drift(profile.name, profile_file, current=e.profile_digest == profile.digest())
    return e, compare(m.profile, m.profile_digest, profile, profile_file)


def of_engine(state, store_url: str | Path, cache: DriftCache, *, settings: "Settings | None" = None) -> Drift:
    """The :class:`Drift` of a recorded engine (:class:`warmctl.records.state.EngineState`): its snapshot's
    embedded profile (read from the store at ``store_url``) against the profile on disk; for a
    cold-started engine only its ``profile_digest`` (no fields to name). ``settings``: as for
    :func:`warmctl.store.open_store`."""
    from warmctl.base.errors import WarmctlError
    from warmctl.store import open_store

    if not state.profile_digest:
        return Drift(state.name)
    prof = None
    if state.manifest_digest:
        try:
            prof = open_store(store_url, settings=settings).get_manifest(state.manifest_digest).profile
        except (WarmctlError, ValueError, OSError):
            prof = None
    return cache.drift(state.name, state.profile_digest, prof)
