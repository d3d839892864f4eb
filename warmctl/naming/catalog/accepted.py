"""Rollback protection: what this node accepted (:class:`Accepted`), per name, tag and kind of
host, and the refusal of an older signed entry (:class:`~warmctl.naming.catalog.errors.RollbackRefused`)."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pydantic_core

from .errors import CatalogError, RollbackRefused
from .model import CatalogEntry


class Accepted:
    """What this node accepted, for rollback protection (docs/store-format.md, section
    10, "No rollback"): per name, tag and kind of host (:func:`compat_key`), the newest
    signed entry a resolve chose, as ``ROOT/<name>/<tag>/<compat hex>.json`` =
    ``{"manifest", "created", "accepted", "catalog"}``. An entry older than that (by its signed
    ``created``) is refused unless asked for by digest or with ``allow_rollback``.

    ``root``: a directory of this node (:meth:`for_settings`: ``$WARMCTL_HOME/accepted``),
    never the store's: a store's writer could roll it back with the entries."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @classmethod
    def for_settings(cls, settings: Any) -> "Accepted":
        """This node's record: ``<home>/accepted``."""
        return cls(Path(settings.home) / "accepted")

    def _path(self, e: CatalogEntry) -> Path:
        return self.root / e.name / e.tag / f"{e.compat.partition(':')[2] or 'unknown'}.json"

    def get(self, e: CatalogEntry) -> dict[str, Any] | None:
        """The record for ``e``'s name, tag and kind of host, or None. A record this node cannot
        read is an error (ConfigError-like :class:`CatalogError` naming it), never "none"."""
        p = self._path(e)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        try:
            rec = pydantic_core.from_json(data)
            rec["created_at"] = datetime.fromisoformat(rec["created"])
            return rec
        except (ValueError, KeyError, TypeError) as err:
            raise CatalogError(f"rollback record {p} is unreadable ({err}); remove it to accept any signed entry again") from None

    def check(self, e: CatalogEntry) -> None:
        """Raise :class:`~warmctl.naming.catalog.errors.RollbackRefused` (a :class:`~warmctl.naming.trust.TrustError`) when
        ``e`` is older than what this node accepted for its name, tag and kind of host."""
        rec = self.get(e)
        if rec is None or rec.get("manifest") == e.manifest or e.created >= rec["created_at"]:
            return
        raise RollbackRefused(
            f"rollback refused: {e.name}:{e.tag} -> {e.manifest} was created {e.created.isoformat()}, before "
            f"{rec['manifest']} (created {rec['created']}), which this node accepted for this kind of host on "
            f"{rec.get('accepted', '?')} from {rec.get('catalog', '?')}; a store serving an older entry than it served "
            f"before is what a rollback looks like. To restore it anyway: {e.name}@{e.manifest}, or --allow-rollback")

    def record(self, e: CatalogEntry, where: str) -> None:
        """Remember ``e`` when it is newer than the record (atomically: a temporary file renamed)."""
        rec = self.get(e)
        if rec is not None and rec["created_at"] >= e.created:
            return
        p = self._path(e)
        p.parent.mkdir(parents=True, exist_ok=True)
        body = {"manifest": e.manifest, "created": e.created.isoformat(),
                "accepted": datetime.now(timezone.utc).isoformat(timespec="seconds"), "catalog": where}
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body, sort_keys=True) + "\n")
        os.replace(tmp, p)
