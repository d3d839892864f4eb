"""The earlier layout's store tags (``tags/<name>/<tag>`` -> ``"<manifest digest>\\n"``), from
before the catalog was the only naming layer: read as entries (:func:`legacy_tags`), kept by
gc, and turned into catalog entries by :func:`migrate`, which every writing command runs first."""

from __future__ import annotations

import logging
from typing import Any

from warmctl.base.errors import WarmctlError
from warmctl.store.backend import load_limited
from warmctl.store.layout import MAX_TAG_BYTES

from .model import _DIGEST_RE, LEGACY_TAG_PREFIX, NAME_RE, _entry_key, entry_for

log = logging.getLogger(__name__)


def legacy_tags(backend: Any) -> dict[tuple[str, str], str]:
    """``{(name, tag): manifest digest}`` of the store tags in ``backend`` (a
    :class:`warmctl.store.backend.Backend`). Keys that are not ``tags/<name>/<tag>`` with valid
    names, and tags that are unreadable or hold no digest, are left out."""
    out: dict[tuple[str, str], str] = {}
    for info in backend.list(LEGACY_TAG_PREFIX):
        parts = info.key[len(LEGACY_TAG_PREFIX) :].split("/")
        if len(parts) != 2 or not (NAME_RE.match(parts[0]) and NAME_RE.match(parts[1])):
            continue
        try:
            d = load_limited(backend, info.key, MAX_TAG_BYTES, "store tag").decode().strip()
        except (WarmctlError, UnicodeDecodeError):
            continue
        if _DIGEST_RE.match(d):
            out[(parts[0], parts[1])] = d
    return out


def migrate(store: Any) -> int:
    """Turn the store tags of ``store`` (a :class:`warmctl.store.Store`) into catalog entries and
    remove them; returns how many were migrated. Idempotent and cheap when there are none (one
    listing). A tag whose manifest is unreadable is left in place, with a warning."""
    backend = store.backend
    n = 0
    for (name, tag), digest in legacy_tags(backend).items():
        key = f"{LEGACY_TAG_PREFIX}{name}/{tag}"
        if not backend.exists(_entry_key(name, tag, digest)):
            try:
                m = store.get_manifest(digest)
            except WarmctlError as e:
                log.warning("not migrating tag %s:%s (%s): %s", name, tag, backend.location(key), e)
                continue
            backend.save(_entry_key(name, tag, digest), entry_for(m, digest, tag).model_dump_json().encode())
        backend.remove(key)
        n += 1
    if n:
        log.warning("migrated %d store tag(s) at %s into catalog entries", n, backend.location(LEGACY_TAG_PREFIX))
    return n
