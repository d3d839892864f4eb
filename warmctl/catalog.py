"""The catalog: names (with tags) -> a profile and the snapshots published for each kind of host.

The catalog lives in a store's backend, next to the chunks and manifests (local directory or
S3), as small JSON objects; the format is specified in ``catalog/README.md``:

- ``catalog/<name>/<tag>/<algo>-<hex>.json``: one :class:`CatalogEntry` per published manifest.
  One object per entry, so two hosts publishing at once never overwrite each other; publishing
  replaces the entry of the same tag whose host has the same :func:`compat_key` (it is
  superseded), so a tag holds at most one snapshot per kind of host.
- ``catalog/<name>/profile.json``: the profile last published under that name (digest + the
  validated profile), so a host that fits no snapshot can cold-start from it.

:func:`select` picks, among candidates, the one this host can restore, by the rules in
``catalog/README.md`` (:data:`RULES`); every other candidate gets exactly one :class:`Rejection`
reason, the first rule it fails.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

from warmctl.errors import SnapshotNotFound, WarmctlError
from warmctl.host import FINGERPRINT_FORMAT, HostFingerprint
from warmctl.manifest import Manifest
from warmctl.trust import TrustError, Verification, sign_manifest, verify_manifest

log = logging.getLogger(__name__)

CATALOG_FORMAT = 1
CATALOG_PREFIX = "catalog/"
DEFAULT_TAG = "latest"

#: Names and tags: a letter or digit, then letters, digits, ``.``, ``_``, ``-`` (at most 128).
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: CPU flags that describe the hypervisor, timekeeping, topology or speculative-execution
#: mitigations rather than instructions a process executes; a host may lack them. Every other
#: flag recorded at snapshot must be present on the restoring host.
IGNORED_CPU_FLAGS = frozenset(
    {
        "hypervisor", "constant_tsc", "nonstop_tsc", "tsc_known_freq", "tsc_reliable", "tsc_adjust",
        "tsc_deadline_timer", "rep_good", "nopl", "xtopology", "cpuid", "extd_apicid", "arat",
        "pti", "ibrs", "ibpb", "stibp", "ssbd", "ibrs_enhanced", "md_clear", "flush_l1d",
        "arch_capabilities", "virt_ssbd", "amd_ssbd", "amd_stibp", "ibpb_brtype", "retpoline",
        "vmmcall", "tsc_scale", "vmcb_clean", "flushbyasid", "decodeassists", "pausefilter",
        "pfthreshold", "v_vmsave_vmload", "vgif", "lbrv", "svm_lock", "nrip_save", "npt", "svm",
        "vmx", "ept", "vpid", "tpr_shadow", "vnmi", "flexpriority", "ept_ad", "aperfmperf",
    }
)  # fmt: skip

#: The rules, in the order they are checked (the first failing one is the rejection reason).
RULES = (
    "fingerprint: the candidate records a host fingerprint of a format this warmctl reads",
    "arch: same machine architecture (x86_64, aarch64, ...)",
    "gpu: a GPU snapshot needs GPUs, a CPU-only snapshot needs a host without GPUs",
    "gpu model and count: the same multiset of GPU models",
    "driver: the same NVIDIA driver version (exact; 'major' policy: same major branch)",
    "cpu: the host has every CPU feature recorded at snapshot (IGNORED_CPU_FLAGS excepted)",
    "criu: CRIU installed, same major version, not older than at snapshot",
    "engine: the same engine version",
    "environment: the same environment digest (installed distributions)",
)

DriverPolicy = Literal["exact", "major"]


class CatalogError(WarmctlError):
    """A catalog operation failed: bad name/tag, manifest missing from the store, ..."""


class CatalogEntry(BaseModel):
    """One published snapshot: ``name``:``tag`` -> ``manifest`` digest, for the host ``host``.

    ``created``: when the snapshot was taken (from the manifest); ``published``: when this entry
    was written (UTC). ``size``: total snapshot bytes. ``compat``: :func:`compat_key` of
    ``host``. ``signed_by``: key ids that signed at publish time (informational; trust is decided
    by :func:`warmctl.trust.verify_manifest`, never by this field).
    """

    model_config = ConfigDict(extra="forbid")

    format: int = CATALOG_FORMAT
    kind: Literal["catalog-entry"] = "catalog-entry"
    name: str
    tag: str
    manifest: str
    created: datetime
    published: datetime
    profile_digest: str
    size: int
    host: dict[str, Any]
    compat: str
    signed_by: list[str] = []


class Rejection(BaseModel):
    """Why candidate ``digest`` does not fit: ``rule`` (short name from :data:`RULES`) and
    ``reason`` (one sentence naming the snapshot's and the host's values)."""

    digest: str
    rule: str
    reason: str

    def __str__(self) -> str:
        return f"{self.digest}: {self.reason}"


class Resolution(BaseModel):
    """What :meth:`Catalog.resolve` found: the chosen entry, the verified manifest, and the
    candidates that were rejected (with their one reason each)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    entry: CatalogEntry
    verification: Verification
    rejections: list[Rejection] = []

    @property
    def manifest(self) -> Manifest:
        return self.verification.manifest


# --------------------------------------------------------------------------- matching


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _host_of(c: Any) -> dict[str, Any]:
    return c.host if isinstance(c.host, dict) else dict(c.host)


def _digest_of(c: Any) -> str:
    if isinstance(c, CatalogEntry):
        return c.manifest
    if isinstance(c, Manifest):
        return c.digest()
    d = getattr(c, "digest", None)
    return d() if callable(d) else str(d)


def _created_of(c: Any) -> datetime:
    created = getattr(c, "created", None)
    return created if isinstance(created, datetime) else datetime.min.replace(tzinfo=timezone.utc)


def compatible_flags(flags: Sequence[str]) -> set[str]:
    """The recorded CPU flags a restoring host must have (``flags`` minus :data:`IGNORED_CPU_FLAGS`)."""
    return set(flags) - IGNORED_CPU_FLAGS


def check(snap: HostFingerprint, host: HostFingerprint, *, driver: DriverPolicy = "exact") -> tuple[str, str] | None:
    """``None`` when a snapshot taken on ``snap`` can be restored on ``host``, else
    ``(rule, reason)`` of the first rule (:data:`RULES` order) it fails."""
    if snap.arch != host.arch:
        return "arch", f"architecture {snap.arch} != host {host.arch}"
    if snap.gpus and not host.gpus:
        return "gpu", f"snapshot needs {snap.gpu_summary()}; host has no GPU ({host.gpu_reason or 'none found'})"
    if not snap.gpus and host.gpus:
        return "gpu", (
            f"CPU-only snapshot; host has {host.gpu_summary()} (CPU-only snapshots restore only on hosts without GPUs)"
        )
    if snap.gpu_models() != host.gpu_models():
        if sorted(set(snap.gpu_models())) == sorted(set(host.gpu_models())):
            return "gpu count", f"GPU count {snap.gpu_count} ({snap.gpu_summary()}) != host {host.gpu_count}"
        return "gpu model", f"GPU model {snap.gpu_summary()} != host {host.gpu_summary()}"
    if snap.gpus:
        sd, hd = snap.driver_version or "?", host.driver_version or "?"
        same = sd == hd if driver == "exact" else sd.split(".")[0] == hd.split(".")[0]
        if not same:
            return "driver", f"driver {sd} != host {hd}" + (" (major)" if driver == "major" else "")
    missing = sorted(compatible_flags(snap.cpu.flags) - set(host.cpu.flags))
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        return "cpu", f"host CPU lacks {shown}, recorded at snapshot ({snap.cpu.model or '?'} vs host {host.cpu.model or '?'})"
    if snap.criu_version:
        if not host.criu_version:
            return "criu", f"snapshot was dumped by criu {snap.criu_version}; criu not found on host"
        sv, hv = _version_tuple(snap.criu_version), _version_tuple(host.criu_version)
        if not sv or not hv or sv[0] != hv[0] or hv < sv:
            return "criu", f"criu {snap.criu_version} at snapshot; host has {host.criu_version} (need same major, not older)"
    if snap.engine_version != host.engine_version:
        return "engine", f"{snap.engine} {snap.engine_version or 'absent'} != host {host.engine_version or 'absent'}"
    if snap.env_digest != host.env_digest:
        return "environment", (
            f"environment digest {snap.env_digest[:19]}... != host {host.env_digest[:19]}... "
            "(installed Python distributions differ)"
        )
    return None


def select(
    candidates: Sequence[Any], fp: HostFingerprint, *, driver: DriverPolicy = "exact"
) -> tuple[Any | None, list[Rejection]]:
    """Choose the candidate this host ``fp`` can restore.

    ``candidates``: :class:`CatalogEntry` or :class:`warmctl.manifest.Manifest` objects (anything
    with ``.host`` as a fingerprint dict and a ``manifest``/``digest()``). Each is checked against
    :data:`RULES` in order (:func:`check`); among those that fit, the newest ``created`` wins (ties:
    the greatest digest, so the choice is deterministic). Returns ``(chosen or None, rejections)``
    where ``rejections`` has one entry, with one reason, for every candidate that does not fit,
    in input order. Fitting candidates that lost to a newer one are not rejections.
    """
    fits: list[Any] = []
    rejections: list[Rejection] = []
    for c in candidates:
        digest = _digest_of(c)
        try:
            snap = HostFingerprint.model_validate(_host_of(c))
        except (ValidationError, TypeError, ValueError) as e:
            n = len(e.errors()) if isinstance(e, ValidationError) else 1
            rejections.append(
                Rejection(digest=digest, rule="fingerprint", reason=f"unreadable host fingerprint ({n} problem(s))")
            )
            continue
        if snap.format != FINGERPRINT_FORMAT:
            rejections.append(
                Rejection(digest=digest, rule="fingerprint", reason=f"fingerprint format {snap.format} is not {FINGERPRINT_FORMAT}")
            )
            continue
        failed = check(snap, fp, driver=driver)
        if failed:
            rejections.append(Rejection(digest=digest, rule=failed[0], reason=failed[1]))
        else:
            fits.append(c)
    if not fits:
        return None, rejections
    chosen = max(fits, key=lambda c: (_created_of(c), _digest_of(c)))
    return chosen, rejections


def compat_key(host: dict[str, Any]) -> str:
    """``sha256:<hex>`` over what :func:`check` compares (arch, GPU models, driver, CPU flags
    minus ignored ones, CRIU major, engine version, environment digest). Two snapshots with the
    same key suit the same hosts; publishing replaces the older one under the same tag."""
    try:
        fp = HostFingerprint.model_validate(host)
        crit = {
            "arch": fp.arch,
            "gpus": fp.gpu_models(),
            "driver": fp.driver_version if fp.gpus else None,
            "cpu": sorted(compatible_flags(fp.cpu.flags)),
            "criu": _version_tuple(fp.criu_version)[:1] if fp.criu_version else None,
            "engine": fp.engine_version,
            "env": fp.env_digest,
        }
    except ValidationError:
        crit = {"raw": host}
    return "sha256:" + hashlib.sha256(json.dumps(crit, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- the catalog


def _check_name(what: str, value: str) -> str:
    if not NAME_RE.match(value):
        raise CatalogError(f"{what} {value!r}: want a letter or digit, then letters, digits, '.', '_' or '-' (max 128)")
    return value


def _entry_key(name: str, tag: str, digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    return f"{CATALOG_PREFIX}{name}/{tag}/{algo}-{hexpart}.json"


class Catalog:
    """The catalog kept in ``store.backend`` (see the module docstring for the layout).

    ``store``: a :class:`warmctl.store.Store` (from :func:`warmctl.store.open_store`); only
    ``store.backend`` (save/load/list/remove/location), ``store.get_manifest`` and, when
    present, ``store.set_tag`` are used.
    """

    def __init__(self, store: Any):
        self.store = store
        self.backend = store.backend

    def location(self) -> str:
        """Where the catalog lives, for messages (``s3://bucket/prefix/catalog/`` or a path)."""
        return self.backend.location(CATALOG_PREFIX)

    def publish(
        self,
        manifest_digest: str,
        manifest: Manifest,
        tag: str = DEFAULT_TAG,
        signer: str | Path | Any | None = None,
    ) -> CatalogEntry:
        """Add ``manifest`` (already in the store, with its chunks) as ``manifest.name``:``tag``.

        Signs it first when ``signer`` (an ed25519 private key or its file) is given; an
        unsigned entry is published too, but ``up`` refuses it without the insecure flag.
        Replaces the entry of the same tag with the same :func:`compat_key`, writes
        ``catalog/<name>/profile.json``, and sets the store tag ``name:tag`` (so store-level
        listings and gc see it). Raises :class:`CatalogError` when ``manifest_digest`` is not
        ``manifest``'s digest or the manifest is not in the store; :class:`TrustError` for an
        unusable key.
        """
        name = _check_name("snapshot name", manifest.name)
        _check_name("tag", tag)
        if manifest.digest() != manifest_digest:
            raise CatalogError(f"publish {name}:{tag}: manifest digest is {manifest.digest()}, not {manifest_digest}")
        try:
            self.store.get_manifest(manifest_digest)
        except WarmctlError as e:
            raise CatalogError(
                f"publish {name}:{tag}: manifest {manifest_digest} is not readable from the store at "
                f"{self.backend.location()} (push it first): {e}"
            ) from None
        signed_by: list[str] = []
        if signer is not None:
            signed_by.append(sign_manifest(self.store, manifest_digest, signer).key_id)
        compat = compat_key(manifest.host)
        entry = CatalogEntry(
            name=name,
            tag=tag,
            manifest=manifest_digest,
            created=manifest.created,
            published=datetime.now(timezone.utc),
            profile_digest=manifest.profile_digest,
            size=manifest.total_size(),
            host=manifest.host,
            compat=compat,
            signed_by=signed_by,
        )
        self.backend.save(_entry_key(name, tag, manifest_digest), entry.model_dump_json().encode())
        for old in self.entries(name, tag):
            if old.compat == compat and old.manifest != manifest_digest:
                self.backend.remove(_entry_key(name, tag, old.manifest))
        profile_doc = {"format": CATALOG_FORMAT, "name": name, "profile_digest": manifest.profile_digest, "profile": manifest.profile}
        self.backend.save(f"{CATALOG_PREFIX}{name}/profile.json", json.dumps(profile_doc, sort_keys=True).encode())
        if hasattr(self.store, "set_tag"):
            self.store.set_tag(name, tag, manifest_digest)
        return entry

    def entries(self, name: str, tag: str = DEFAULT_TAG) -> list[CatalogEntry]:
        """Entries of ``name``:``tag``, newest ``created`` first. Unreadable entry objects are
        skipped with a logged warning naming them. Unknown name/tag: ``[]``."""
        _check_name("snapshot name", name)
        _check_name("tag", tag)
        out: list[CatalogEntry] = []
        prefix = f"{CATALOG_PREFIX}{name}/{tag}/"
        for info in self.backend.list(prefix):
            if not info.key.endswith(".json") or "/" in info.key[len(prefix) :]:
                continue
            try:
                out.append(CatalogEntry.model_validate_json(self.backend.load(info.key)))
            except (ValidationError, ValueError) as e:
                log.warning("skipping unreadable catalog entry %s: %s", self.backend.location(info.key), e)
        out.sort(key=lambda e: (e.created, e.manifest), reverse=True)
        return out

    def names(self) -> list[str]:
        """Every name that has a profile or at least one entry, sorted."""
        found = set()
        for info in self.backend.list(CATALOG_PREFIX):
            parts = info.key[len(CATALOG_PREFIX) :].split("/")
            if len(parts) >= 2 and NAME_RE.match(parts[0]):
                found.add(parts[0])
        return sorted(found)

    def tags(self, name: str) -> list[str]:
        """Tags of ``name`` that hold at least one entry, sorted."""
        _check_name("snapshot name", name)
        prefix = f"{CATALOG_PREFIX}{name}/"
        found = set()
        for info in self.backend.list(prefix):
            parts = info.key[len(prefix) :].split("/")
            if len(parts) == 2 and parts[1].endswith(".json"):
                found.add(parts[0])
        return sorted(found)

    def profile(self, name: str) -> dict[str, Any] | None:
        """``{"name", "profile_digest", "profile"}`` last published for ``name``, or ``None``."""
        _check_name("snapshot name", name)
        key = f"{CATALOG_PREFIX}{name}/profile.json"
        if not self.backend.exists(key):
            return None
        return json.loads(self.backend.load(key))

    def remove(self, name: str, tag: str, digest: str) -> bool:
        """Remove the entry of ``digest`` from ``name``:``tag``; ``True`` if it existed. The
        manifest, chunks and signatures stay (gc decides)."""
        key = _entry_key(_check_name("snapshot name", name), _check_name("tag", tag), digest)
        existed = self.backend.exists(key)
        self.backend.remove(key)
        return existed

    def referenced_manifests(self) -> set[str]:
        """Digests of every manifest some catalog entry points to, for every name and tag.
        Garbage collection must keep these (only the newest entry of a tag is also a store tag)."""
        out: set[str] = set()
        for info in self.backend.list(CATALOG_PREFIX):
            parts = info.key[len(CATALOG_PREFIX) :].split("/")
            if len(parts) == 3 and parts[2].endswith(".json"):
                algo, _, hexpart = parts[2][: -len(".json")].partition("-")
                if algo and hexpart:
                    out.add(f"{algo}:{hexpart}")
        return out

    def resolve(
        self,
        name: str,
        fp: HostFingerprint,
        keys_dir: str | Path,
        *,
        tag: str = DEFAULT_TAG,
        insecure: bool = False,
        driver: DriverPolicy = "exact",
    ) -> Resolution:
        """What ``up NAME`` restores on this host: select among ``name``:``tag`` entries, then
        verify the chosen manifest's signature and integrity (:func:`verify_manifest`), then
        re-check the *signed* manifest (its name and host fingerprint, since catalog entries are
        unsigned pointers). Nothing is pulled or materialized here.

        Raises :class:`SnapshotNotFound` when no entry exists or none fits (the message lists
        every rejected candidate with its one reason), :class:`TrustError` (unsigned, untrusted,
        bad signature, or the signed manifest contradicts its entry; ``insecure`` downgrades the
        signature part to a warning in ``resolution.verification.warning``),
        :class:`warmctl.errors.IntegrityError`.
        """
        entries = self.entries(name, tag)
        if not entries:
            raise SnapshotNotFound(f"no snapshot {name}:{tag} in the catalog at {self.location()}")
        chosen, rejections = select(entries, fp, driver=driver)
        if chosen is None:
            lines = "\n".join(f"  - {r.digest} ({r.rule}): {r.reason}" for r in rejections)
            raise SnapshotNotFound(
                f"none of the {len(entries)} snapshot(s) of {name}:{tag} fits this host ({fp.summary()}):\n{lines}"
            )
        v = verify_manifest(self.store, chosen.manifest, keys_dir, insecure=insecure)
        if v.manifest.name != name:
            raise TrustError(f"catalog entry {name}:{tag} points at manifest {chosen.manifest} of {v.manifest.name!r}")
        ok, why = select([v.manifest], fp, driver=driver)
        if ok is None:
            raise TrustError(
                f"catalog entry {name}:{tag} -> {chosen.manifest}: the signed manifest's host does not fit: {why[0].reason}"
            )
        return Resolution(entry=chosen, verification=v, rejections=rejections)
