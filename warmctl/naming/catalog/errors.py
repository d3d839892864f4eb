"""The catalog's own failures, each its own class so that callers tell them apart by type.

:class:`CatalogError` (exit 14): a catalog operation failed. :class:`RollbackRefused` is one
case of :class:`~warmctl.naming.trust.TrustError` and exits with its code (8), as it always has: an
older signed entry than this node accepted (:class:`warmctl.naming.catalog.Accepted`)."""

from __future__ import annotations

from warmctl.base.errors import WarmctlError
from warmctl.naming.trust import TrustError


class CatalogError(WarmctlError):
    """A catalog operation failed: bad name/tag, manifest missing from the store, ..."""


class RollbackRefused(TrustError):
    """A catalog entry is older (by its signed ``created``) than the one this node accepted for
    its name, tag and kind of host: what a store rolled back looks like. A case of
    :class:`~warmctl.naming.trust.TrustError`, with its exit code (8); the message names both
    snapshots and how to restore the older one anyway (``NAME@DIGEST`` or ``--allow-rollback``)."""
