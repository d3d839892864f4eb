"""The catalog: names (with tags) -> a profile and the snapshots published for each kind of host.

The catalog is warmctl's **only naming layer**: the store underneath knows snapshots by digest
alone (like containerd's content store under its metadata store). ``snapshot``, ``push``,
``pull``, ``ls``, ``up``, ``gc`` and the agent's snapshot routes all name snapshots through
it, and garbage collection keeps exactly the manifests it names (:meth:`Catalog.referenced_manifests`).

The catalog lives in a store's backend, next to the chunks and manifests (local directory or
S3), as small JSON objects; the format is specified in ``catalog/README.md``:

- ``catalog/<name>/<tag>/<algo>-<hex>.json``: one :class:`CatalogEntry` per published manifest.
  One object per entry, so two hosts publishing at once never overwrite each other; publishing
  replaces the entry of the same tag whose host has the same :func:`compat_key` (it is
  superseded), so a tag holds at most one snapshot per kind of host.
- ``catalog/<name>/profile.json``: the profile last published under that name (digest + the
  validated profile), so a host that fits no snapshot can cold-start from it.

Stores written before the catalog was the only naming layer also hold ``tags/<name>/<tag>``
objects (``"<manifest digest>\n"``). They are read as entries (:meth:`Catalog.entries`), kept by
gc, and turned into entries by :meth:`Catalog.migrate`, which every writing command runs first.

:func:`select` picks, among candidates, the one this host can restore, by the rules in
``catalog/README.md`` (:data:`RULES`); every other candidate gets exactly one :class:`Rejection`
reason, the first rule it fails.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Sequence

import pydantic_core
from pydantic import BaseModel, ConfigDict, ValidationError

from warmctl import names
from warmctl.errors import ImageMismatch, IntegrityError, SnapshotNotFound, WarmctlError
from warmctl.host import FINGERPRINT_FORMAT, HostFingerprint
from warmctl.manifest import Manifest
from warmctl.store.backend import ObjectNotFound, load_limited
from warmctl.store.layout import MAX_ENTRY_BYTES, MAX_PROFILE_BYTES, MAX_SIGNATURE_BYTES, MAX_TAG_BYTES
from warmctl.trust import (
    EntrySignatures,
    TrustError,
    Verification,
    check_entry,
    load_trusted_keys,
    sign_entry,
    sign_manifest,
    verify_manifest,
)

log = logging.getLogger(__name__)

CATALOG_FORMAT = 1
CATALOG_PREFIX = "catalog/"
#: Store tags of the earlier layout (``tags/<name>/<tag>`` -> ``"<digest>\n"``); read, then migrated.
LEGACY_TAG_PREFIX = "tags/"
DEFAULT_TAG = "latest"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")

#: Names and tags follow the one name rule (:mod:`warmctl.names`).
NAME_RE = names.NAME_RE

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
    "image: the same container image digest (made in a pod: restored only in a pod of that image)",
    "arch: same machine architecture (x86_64, aarch64, ...)",
    "gpu: a GPU snapshot needs GPUs, a CPU-only snapshot needs a host without GPUs",
    "gpu model and count: the same multiset of GPU models",
    "driver: the same GPU driver version, NVIDIA or amdgpu (exact; 'major' policy: same major branch)",
    "gpu memory (AMD): every GPU has at least the VRAM of the one it replaces",
    "gpu firmware (AMD): MEC and SDMA firmware on the restoring GPUs not older than at snapshot",
    "cpu: the host has every CPU feature recorded at snapshot (IGNORED_CPU_FLAGS excepted)",
    "ranks: every rank of a multi-rank snapshot gets the CPUs it was bound to (the host lets warmctl use them)",
    "criu: CRIU installed, same major version, not older than at snapshot",
    "criu plugin (AMD): CRIU's amdgpu plugin (amdgpu_plugin.so) in CRIU's plugin directory",
    "known bad: no combination listed in KNOWN_BAD (e.g. CRIU 4.2.x restoring AMD GPU state)",
    "engine: the same engine version",
    "environment: the same environment digest (installed distributions)",
)

DriverPolicy = Literal["exact", "major"]

#: The CRIU plugin that saves and restores AMD GPU state (KFD ioctls; ``plugins/amdgpu`` in CRIU).
AMDGPU_PLUGIN = "amdgpu_plugin.so"


class KnownBad(BaseModel):
    """A combination that is reported broken: a snapshot of ``vendor`` GPUs restored by a CRIU
    whose version starts with ``criu_prefix`` (``(4, 2)``: every 4.2.x). ``reason`` says what
    breaks and cites where it was reported."""

    vendor: str
    criu_prefix: tuple[int, ...]
    reason: str


#: Known-bad combinations, checked by the "known bad" rule (see ``catalog/README.md``).
KNOWN_BAD = (
    KnownBad(
        vendor="amd", criu_prefix=(4, 2),
        reason=("CRIU 4.2's amdgpu plugin restores buffer objects in parallel and has no switch to turn "
                "that off; reported to crash PyTorch after restore (checkpoint-restore/criu#2812, and "
                "#2814: 'We currently don't have a way of disabling the parallel restore'). Use a CRIU "
                "with that fixed, or prove on the target that warmctl's trees are unaffected "
                "(docs/gpu.md, AMD Instinct)"),
    ),
)


def _pairwise_at_least(snap: list[int], host: list[int]) -> bool:
    """True when every value of ``snap`` can be given its own value of ``host`` that is at
    least as large (sorted pairing; same lengths assumed, as the GPU rule checked)."""
    return len(snap) == len(host) and all(h >= v for v, h in zip(sorted(snap), sorted(host)))


class CatalogError(WarmctlError):
    """A catalog operation failed: bad name/tag, manifest missing from the store, ..."""


def _check_name(what: str, value: str) -> str:
    return names.check_name(what, value, CatalogError)


class Ref(BaseModel):
    """A snapshot reference as users write it: ``NAME``, ``NAME:TAG`` or ``NAME@sha256:<hex>``
    (a digest pins one manifest, whether or not a tag still names it)."""

    name: str
    tag: str = DEFAULT_TAG
    digest: str | None = None

    @classmethod
    def parse(cls, ref: str, default_tag: str = DEFAULT_TAG) -> "Ref":
        """Parse ``ref``; raises :class:`CatalogError` naming what is malformed."""
        if "@" in ref:
            name, _, digest = ref.partition("@")
            if not _DIGEST_RE.match(digest):
                raise CatalogError(f"snapshot reference {ref!r}: want NAME@sha256:<64 hex digits>")
            return cls(name=_check_name("snapshot name", name), digest=digest)
        name, _, tag = ref.partition(":")
        return cls(name=_check_name("snapshot name", name), tag=_check_name("tag", tag or default_tag))

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag}"


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
    """What :meth:`Catalog.resolve` found: the manifest ``digest``, the ``entry`` that named it
    (``None`` when ``up`` pinned the digest itself), the verified manifest, and the candidates
    that were rejected (with their one reason each). ``skipped``: the rejections of candidates
    that fit this host and were newer than the one chosen, but unusable (unsigned, missing,
    a rollback), each a fallback ``up`` reports. ``entry_key``: the trusted key that signed
    ``entry`` (None for a pinned digest, or an insecure resolve of an unsigned entry)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    digest: str
    entry: CatalogEntry | None
    verification: Verification
    rejections: list[Rejection] = []
    skipped: list[Rejection] = []
    entry_key: str | None = None

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
    if snap.image_digest != host.image_digest:
        return "image", image_mismatch(snap.image_digest, host.image_digest)
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
            kind = "amdgpu driver" if snap.gpu_vendor == "amd" else "driver"
            return "driver", f"{kind} {sd} != host {hd}" + (" (major)" if driver == "major" else "")
    if snap.gpu_vendor == "amd":
        failed = _check_amd_gpus(snap, host)
        if failed:
            return failed
    missing = sorted(compatible_flags(snap.cpu.flags) - set(host.cpu.flags))
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        return "cpu", f"host CPU lacks {shown}, recorded at snapshot ({snap.cpu.model or '?'} vs host {host.cpu.model or '?'})"
    if snap.rank_cpus and host.cpus_allowed:
        from warmctl.parallel import parse_cpu_list
        from warmctl.checkpoint.layout import host_problems

        short = host_problems(snap.rank_cpus, parse_cpu_list(host.cpus_allowed))
        if short:
            return "ranks", "; ".join(short)
    if snap.criu_version:
        if not host.criu_version:
            return "criu", f"snapshot was dumped by criu {snap.criu_version}; criu not found on host"
        sv, hv = _version_tuple(snap.criu_version), _version_tuple(host.criu_version)
        if not sv or not hv or sv[0] != hv[0] or hv < sv:
            return "criu", f"criu {snap.criu_version} at snapshot; host has {host.criu_version} (need same major, not older)"
    if snap.gpu_vendor == "amd":
        failed = _check_amd_criu(snap, host)
        if failed:
            return failed
    if snap.engine_version != host.engine_version:
        return "engine", f"{snap.engine} {snap.engine_version or 'absent'} != host {host.engine_version or 'absent'}"
    if snap.env_digest != host.env_digest:
        return "environment", (
            f"environment digest {snap.env_digest[:19]}... != host {host.env_digest[:19]}... "
            "(installed Python distributions differ)"
        )
    return None


def image_mismatch(snap: str | None, host: str | None) -> str:
    """Why a snapshot made in container image ``snap`` is not restored in image ``host`` (either
    None: outside a cluster), naming both digests."""
    made = f"made in container image {snap}" if snap else "made outside a container image (no image_digest)"
    here = f"this pod runs image {host}" if host else "this host runs in no container image (no image_digest)"
    return f"snapshot {made}; {here} (a snapshot is restored only in the image it was made in)"


def _check_amd_gpus(snap: HostFingerprint, host: HostFingerprint) -> tuple[str, str] | None:
    """The AMD GPU rules CRIU's amdgpu plugin would otherwise fail late on, at restore
    (``amdgpu_plugin_topology.c``, ``device_properties_match``: ``vram_size``, ``fw_version`` and
    ``sdma_fw_version`` of the restoring GPU >= the dumped one's). GPUs may be matched in any
    order, as the plugin maps them; each number is compared by sorted pairing."""
    sm, hm = [g.memory_bytes for g in snap.gpus], [g.memory_bytes for g in host.gpus]
    if not _pairwise_at_least(sm, hm):
        return "gpu memory", (f"GPU memory at snapshot {_gib(sm)} GiB; host has {_gib(hm)} GiB "
                              "(each restoring GPU needs at least the VRAM of the one dumped)")
    for key, what in (("fw_version", "MEC firmware"), ("sdma_fw_version", "SDMA firmware")):
        sv = [getattr(g, key) or 0 for g in snap.gpus]
        hv = [getattr(g, key) or 0 for g in host.gpus]
        if not _pairwise_at_least(sv, hv):
            return "gpu firmware", (f"{what} ({key}) at snapshot {sorted(set(sv))}, host {sorted(set(hv))}: "
                                    "older firmware on the restoring GPUs (CRIU's amdgpu plugin refuses that at restore)")
    return None


def _gib(values: list[int]) -> list[float]:
    return sorted({round(v / 2**30, 1) for v in values})


def _check_amd_criu(snap: HostFingerprint, host: HostFingerprint) -> tuple[str, str] | None:
    """AMD snapshots need CRIU's amdgpu plugin on the host, and no :data:`KNOWN_BAD` CRIU."""
    if AMDGPU_PLUGIN not in (host.criu_plugins or []):
        where = host.criu_plugin_dir or "CRIU's plugin directory"
        return "criu plugin", (f"snapshot holds AMD GPU state, restored by CRIU's {AMDGPU_PLUGIN}; not in {where} "
                               f"(found: {', '.join(host.criu_plugins or []) or 'nothing'}; install CRIU's amdgpu "
                               "plugin or set CRIU_LIBS_DIR)")
    hv = _version_tuple(host.criu_version or "")
    for bad in KNOWN_BAD:
        if bad.vendor == snap.gpu_vendor and hv[: len(bad.criu_prefix)] == bad.criu_prefix:
            return "known bad", f"criu {host.criu_version} with {bad.vendor.upper()} GPUs: {bad.reason}"
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


def ranked(candidates: Sequence[Any], fp: HostFingerprint, *, driver: DriverPolicy = "exact") -> tuple[list[Any], list[Rejection]]:
    """Like :func:`select`, but every candidate that fits, best first (newest ``created``; ties:
    greatest digest), for a caller that falls back to the next when one proves unusable."""
    fits, rejections = [], []
    for c in candidates:
        chosen, rej = select([c], fp, driver=driver)
        if chosen is None:
            rejections += rej
        else:
            fits.append(c)
    fits.sort(key=lambda c: (_created_of(c), _digest_of(c)), reverse=True)
    return fits, rejections


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
        if fp.image_digest:  # the image rule (keys of snapshots made outside a cluster unchanged)
            crit["image"] = fp.image_digest
        if fp.rank_cpus:  # the ranks rule (keys of snapshots without bound ranks unchanged)
            crit["ranks"] = dict(sorted(fp.rank_cpus.items()))
        if fp.gpu_vendor == "amd":  # what the AMD rules compare besides (NVIDIA keys unchanged)
            crit["amd"] = {"memory": sorted(g.memory_bytes for g in fp.gpus),
                           "fw": sorted((g.fw_version or 0, g.sdma_fw_version or 0) for g in fp.gpus)}
    except ValidationError:
        crit = {"raw": host}
    return "sha256:" + hashlib.sha256(json.dumps(crit, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- the catalog


def _entry_key(name: str, tag: str, digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    return f"{CATALOG_PREFIX}{name}/{tag}/{algo}-{hexpart}.json"


def entry_key(e: CatalogEntry) -> str:
    """The object key entry ``e`` lives at: ``catalog/<name>/<tag>/<algo>-<hex>.json``."""
    return _entry_key(e.name, e.tag, e.manifest)


def _sig_key(name: str, tag: str, digest: str) -> str:
    """Key of the signatures of the entry ``_entry_key(name, tag, digest)``: ``...<algo>-<hex>.sig``
    (beside it; readers that predate signed entries ignore it)."""
    return _entry_key(name, tag, digest)[: -len(".json")] + ".sig"


class ProfileRecord(BaseModel):
    """``catalog/<name>/profile.json``: the profile last published under ``name``."""

    format: int = CATALOG_FORMAT
    name: str
    profile_digest: str
    profile: dict[str, Any]


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
        """Raise :class:`TrustError` when ``e`` is older than what this node accepted for its
        name, tag and kind of host."""
        rec = self.get(e)
        if rec is None or rec.get("manifest") == e.manifest or e.created >= rec["created_at"]:
            return
        raise TrustError(
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


class Catalog:
    """The catalog kept in ``store.backend`` (see the module docstring for the layout).

    ``store``: a :class:`warmctl.store.Store` (from :func:`warmctl.store.open_store`); only
    ``store.backend`` (save/load/list/remove/exists/location) and ``store.get_manifest`` are used.
    """

    def __init__(self, store: Any):
        self.store = store
        self.backend = store.backend

    def location(self) -> str:
        """Where the catalog lives, for messages (``s3://bucket/prefix/catalog/`` or a path)."""
        return self.backend.location(CATALOG_PREFIX)

    # -- writing

    def publish(
        self,
        manifest_digest: str,
        manifest: Manifest,
        tag: str = DEFAULT_TAG,
        signer: str | Path | Any | None = None,
    ) -> CatalogEntry:
        """Name ``manifest`` (already in the store, with its chunks) ``manifest.name``:``tag``.

        Signs it first when ``signer`` (an ed25519 private key or its file) is given; an
        unsigned entry is published too, but ``up`` refuses it without the insecure flag.
        Replaces the entry of the same tag with the same :func:`compat_key` and writes
        ``catalog/<name>/profile.json`` (:meth:`add`). Raises :class:`CatalogError` when
        ``manifest_digest`` is not ``manifest``'s digest or the manifest is not in the store;
        :class:`TrustError` for an unusable key.
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
        entry = entry_for(manifest, manifest_digest, tag, signed_by=signed_by)
        sigs = EntrySignatures(signatures=[sign_entry(entry, signer)]) if signer is not None else None
        self.add(entry, profile=manifest.profile, signatures=sigs)
        return entry

    def add(self, entry: CatalogEntry, profile: dict[str, Any] | None = None,
            signatures: EntrySignatures | None = None) -> None:
        """Write ``entry`` (its manifest must already be in this store: the entry is always the
        last object written, after ``signatures``, its :class:`~warmctl.trust.EntrySignatures`),
        then remove the entries of the same name and tag whose
        :func:`compat_key` is the same (a tag holds one snapshot per kind of host: the tag
        *moves*). ``profile``: the validated profile to record as ``catalog/<name>/profile.json``.
        """
        _check_name("snapshot name", entry.name)
        _check_name("tag", entry.tag)
        if not _DIGEST_RE.match(entry.manifest):
            raise CatalogError(f"catalog entry {entry.name}:{entry.tag}: malformed manifest digest {entry.manifest!r}")
        self.migrate()
        key, body = _entry_key(entry.name, entry.tag, entry.manifest), entry.model_dump_json().encode()
        sig_key = _sig_key(entry.name, entry.tag, entry.manifest)
        commit = getattr(self.store, "commit", None)
        if commit is None:
            if signatures is not None:
                self.backend.save(sig_key, signatures.model_dump_json().encode())
            self.backend.save(key, body)
        else:  # a Store: under its writer lock, checked before and after (LockLost)
            self.store.check_lock(f"catalog entry {entry.name}:{entry.tag}")
            if not self.store.has_manifest(entry.manifest):
                raise CatalogError(f"catalog entry {entry.name}:{entry.tag}: manifest {entry.manifest} is not in the "
                                   f"store at {self.backend.location()}; an entry is written after what it names")
            if signatures is not None:
                commit(sig_key, signatures.model_dump_json().encode(), f"signature of catalog entry {entry.name}:{entry.tag}")
            commit(key, body, f"catalog entry {entry.name}:{entry.tag}")
        for old in self.entries(entry.name, entry.tag):
            if old.compat == entry.compat and old.manifest != entry.manifest:
                self.backend.remove(_entry_key(entry.name, entry.tag, old.manifest))
                self.backend.remove(_sig_key(entry.name, entry.tag, old.manifest))
        if profile is not None:
            doc = {"format": CATALOG_FORMAT, "name": entry.name, "profile_digest": entry.profile_digest, "profile": profile}
            self.backend.save(f"{CATALOG_PREFIX}{entry.name}/profile.json", json.dumps(doc, sort_keys=True).encode())

    def remove(self, name: str, tag: str, digest: str) -> bool:
        """Remove the entry of ``digest`` from ``name``:``tag``; ``True`` if it existed. The
        manifest, chunks and signatures stay until ``gc`` (which then no longer keeps them)."""
        self.migrate()
        key = _entry_key(_check_name("snapshot name", name), _check_name("tag", tag), digest)
        existed = self.backend.exists(key)
        self.backend.remove(key)  # the name first: an entry never outlives its signature unseen
        self.backend.remove(_sig_key(name, tag, digest))
        return existed

    def remove_tag(self, name: str, tag: str) -> list[str]:
        """Remove every entry of ``name``:``tag`` (one per kind of host); returns their manifest
        digests (``[]`` when the tag names nothing)."""
        gone = [e.manifest for e in self.entries(name, tag)]
        for d in gone:
            self.remove(name, tag, d)
        return gone

    def migrate(self) -> int:
        """Turn the earlier layout's store tags (``tags/<name>/<tag>``) into catalog entries and
        remove them; returns how many were migrated. Idempotent and cheap when there are none
        (one listing). A tag whose manifest is unreadable is left in place, with a warning."""
        n = 0
        for (name, tag), digest in self._legacy_tags().items():
            key = f"{LEGACY_TAG_PREFIX}{name}/{tag}"
            if not self.backend.exists(_entry_key(name, tag, digest)):
                try:
                    m = self.store.get_manifest(digest)
                except WarmctlError as e:
                    log.warning("not migrating tag %s:%s (%s): %s", name, tag, self.backend.location(key), e)
                    continue
                self.backend.save(_entry_key(name, tag, digest), entry_for(m, digest, tag).model_dump_json().encode())
            self.backend.remove(key)
            n += 1
        if n:
            log.warning("migrated %d store tag(s) at %s into catalog entries", n, self.backend.location(LEGACY_TAG_PREFIX))
        return n

    # -- reading

    def _legacy_tags(self) -> dict[tuple[str, str], str]:
        out: dict[tuple[str, str], str] = {}
        for info in self.backend.list(LEGACY_TAG_PREFIX):
            parts = info.key[len(LEGACY_TAG_PREFIX) :].split("/")
            if len(parts) != 2 or not (NAME_RE.match(parts[0]) and NAME_RE.match(parts[1])):
                continue
            try:
                d = load_limited(self.backend, info.key, MAX_TAG_BYTES, "store tag").decode().strip()
            except (WarmctlError, UnicodeDecodeError):
                continue
            if _DIGEST_RE.match(d):
                out[(parts[0], parts[1])] = d
        return out

    def entries(self, name: str, tag: str = DEFAULT_TAG) -> list[CatalogEntry]:
        """Entries of ``name``:``tag``, newest ``created`` first (an earlier layout's store tag
        without an entry is read as one). Unreadable entry objects are skipped with a logged
        warning naming them. Unknown name/tag: ``[]``."""
        _check_name("snapshot name", name)
        _check_name("tag", tag)
        out: list[CatalogEntry] = []
        prefix = f"{CATALOG_PREFIX}{name}/{tag}/"
        for info in self.backend.list(prefix):
            if not info.key.endswith(".json") or "/" in info.key[len(prefix) :]:
                continue
            where = self.backend.location(info.key)
            try:
                e = CatalogEntry.model_validate_json(load_limited(self.backend, info.key, MAX_ENTRY_BYTES, "catalog entry"))
            except (ValidationError, ValueError, IntegrityError) as err:
                log.warning("skipping unreadable catalog entry %s: %s", where, str(err).splitlines()[0])
                continue
            # its content must say where it lives: an entry copied under another name, tag or
            # digest is not used (an entry under tiny/latest saying "other")
            if (e.name, e.tag) != (name, tag) or not _DIGEST_RE.match(e.manifest) or \
                    info.key != _entry_key(name, tag, e.manifest):
                log.warning("skipping catalog entry %s: it names %s:%s -> %s, which is not where it lives",
                            where, e.name, e.tag, e.manifest)
                continue
            out.append(e)
        legacy = self._legacy_tags().get((name, tag))
        if legacy and all(e.manifest != legacy for e in out):
            try:
                out.append(entry_for(self.store.get_manifest(legacy), legacy, tag))
            except WarmctlError as e:
                log.warning("skipping store tag %s:%s -> %s: %s", name, tag, legacy, e)
        out.sort(key=lambda e: (e.created, e.manifest), reverse=True)
        return out

    def newest(self, name: str, tag: str = DEFAULT_TAG) -> str | None:
        """The manifest digest of ``name:tag``'s newest entry (for a store one kind of host
        writes, the one it names), or ``None``. To choose for a host, use :meth:`resolve`."""
        found = self.entries(name, tag)
        return found[0].manifest if found else None

    def all_entries(self) -> list[CatalogEntry]:
        """Every entry of every name and tag, sorted by name, tag, then newest first."""
        return [e for n in self.names() for t in self.tags(n) for e in self.entries(n, t)]

    def names(self) -> list[str]:
        """Every name that has a profile or at least one entry, sorted."""
        found = {n for n, _ in self._legacy_tags()}
        for info in self.backend.list(CATALOG_PREFIX):
            parts = info.key[len(CATALOG_PREFIX) :].split("/")
            if len(parts) >= 2 and NAME_RE.match(parts[0]):
                found.add(parts[0])
        return sorted(found)

    def tags(self, name: str) -> list[str]:
        """Tags of ``name`` that hold at least one entry, sorted."""
        _check_name("snapshot name", name)
        prefix = f"{CATALOG_PREFIX}{name}/"
        found = {t for n, t in self._legacy_tags() if n == name}
        for info in self.backend.list(prefix):
            parts = info.key[len(prefix) :].split("/")
            if len(parts) == 2 and parts[1].endswith(".json"):
                found.add(parts[0])
        return sorted(found)

    def profile(self, name: str) -> dict[str, Any] | None:
        """``{"name", "profile_digest", "profile"}`` last published for ``name``, or ``None``."""
        _check_name("snapshot name", name)
        key = f"{CATALOG_PREFIX}{name}/profile.json"
        where = self.backend.location(key)
        try:
            data = load_limited(self.backend, key, MAX_PROFILE_BYTES, "profile record")
        except ObjectNotFound:
            return None
        except IntegrityError as e:
            raise CatalogError(str(e)) from None
        try:
            rec = ProfileRecord.model_validate_json(data)
        except ValidationError as e:
            why = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'document'}: {x['msg']}" for x in e.errors()[:3])
            raise CatalogError(f"profile record {where} is unusable: {why}") from None
        if rec.name != name:
            raise CatalogError(f"profile record {where} is of {rec.name!r}, not {name!r}")
        return rec.model_dump()

    def entry_signatures(self, entry: CatalogEntry) -> EntrySignatures | None:
        """The signatures stored beside ``entry`` (None: none). Raises :class:`TrustError` for an
        unreadable or oversized signature object, naming it."""
        key = _sig_key(entry.name, entry.tag, entry.manifest)
        try:
            data = load_limited(self.backend, key, MAX_SIGNATURE_BYTES, "entry signature")
            return EntrySignatures.model_validate_json(data)
        except ObjectNotFound:
            return None
        except (ValidationError, ValueError, IntegrityError) as e:
            raise TrustError(f"catalog entry signature {self.backend.location(key)} is unreadable: "
                             f"{str(e).splitlines()[0]}") from None

    def referenced_manifests(self) -> set[str]:
        """Digests of every manifest some catalog entry (or earlier-layout store tag) names, for
        every name and tag: the roots that garbage collection keeps."""
        out: set[str] = set(self._legacy_tags().values())
        for info in self.backend.list(CATALOG_PREFIX):
            parts = info.key[len(CATALOG_PREFIX) :].split("/")
            if len(parts) == 3 and parts[2].endswith(".json"):
                algo, _, hexpart = parts[2][: -len(".json")].partition("-")
                if algo and hexpart:
                    out.add(f"{algo}:{hexpart}")
        return out

    def names_of(self) -> dict[str, list[str]]:
        """Manifest digest -> the ``name:tag`` references that name it (for listings)."""
        out: dict[str, list[str]] = {}
        for e in self.all_entries():
            out.setdefault(e.manifest, []).append(f"{e.name}:{e.tag}")
        return out

    def resolve(
        self,
        name: str,
        fp: HostFingerprint,
        keys_dir: str | Path,
        *,
        tag: str = DEFAULT_TAG,
        digest: str | None = None,
        insecure: bool = False,
        driver: DriverPolicy = "exact",
        accepted: Accepted | None = None,
        allow_rollback: bool = False,
    ) -> Resolution:
        """What ``up NAME`` restores on this host: among ``name``:``tag``'s entries that fit
        this host (newest first), the first that is usable (:meth:`accept`: the entry signed by
        a trusted key, its manifest signed, intact and agreeing with it, not older than what
        ``accepted`` remembers unless ``allow_rollback``); or the manifest ``digest`` itself
        (``NAME@sha256:...``, named by a tag or not; never a rollback). Each unusable newer
        candidate is in ``resolution.skipped`` with why (``up`` says it fell back). The chosen
        entry is recorded in ``accepted``. Nothing is pulled or materialized here.

        Raises :class:`SnapshotNotFound` when no entry exists or none fits (the message lists
        every rejected candidate with its one reason), :class:`TrustError` (no fitting candidate
        is usable: unsigned, untrusted, bad signature, a rollback, or the signed manifest
        contradicts its entry; ``insecure`` downgrades the signature part to a warning in
        ``resolution.verification.warning``), :class:`warmctl.errors.IntegrityError` (the
        candidates' manifests are missing or corrupt).
        """
        ref = f"{name}@{digest}" if digest else f"{name}:{tag}"
        if digest:
            if not self.store.has_manifest(digest):
                raise SnapshotNotFound(f"no snapshot {ref}: no manifest {digest} in the store at {self.backend.location()}")
            v = verify_manifest(self.store, digest, keys_dir, insecure=insecure)
            if v.manifest.name != name:
                raise TrustError(f"{ref} points at manifest {digest} of {v.manifest.name!r}")
            ok, why = select([v.manifest], fp, driver=driver)
            if ok is None:
                cls = ImageMismatch if why[0].rule == "image" else SnapshotNotFound
                raise cls(f"snapshot {ref} does not fit this host ({fp.summary()}): {why[0].reason}")
            return Resolution(digest=digest, entry=None, verification=v)
        entries = self.entries(name, tag)
        if not entries:
            raise SnapshotNotFound(f"no snapshot {ref} in the catalog at {self.location()}")
        fits, rejections = ranked(entries, fp, driver=driver)
        if not fits:
            raise nothing_fits(ref, len(entries), fp, rejections)
        skipped: list[Rejection] = []
        failures: list[WarmctlError] = []
        for e in fits:
            try:
                v, key = self.accept(e, fp, keys_dir, insecure=insecure, driver=driver)
                if accepted is not None and not allow_rollback:
                    accepted.check(e)
            except (TrustError, IntegrityError, CatalogError) as err:
                rule = "rollback" if str(err).startswith("rollback refused") else \
                    "signature" if isinstance(err, TrustError) else "integrity"
                skipped.append(Rejection(digest=e.manifest, rule=rule, reason=str(err)))
                failures.append(err)
                continue
            if accepted is not None:
                accepted.record(e, self.location())
            return Resolution(digest=e.manifest, entry=e, verification=v, rejections=rejections + skipped,
                              skipped=skipped, entry_key=key)
        if len(failures) == 1:
            raise failures[0]
        lines = "\n".join(f"  - {r.digest} ({r.rule}): {r.reason}" for r in skipped)
        raise type(failures[0])(f"none of the {len(fits)} snapshot(s) of {ref} that fit this host is usable:\n{lines}")

    def accept(self, e: CatalogEntry, fp: HostFingerprint | None, keys_dir: str | Path, *, insecure: bool = False,
               driver: DriverPolicy = "exact") -> tuple[Verification, str | None]:
        """Whether this node may act on entry ``e`` (found under its own name and tag): its
        manifest's signature and bytes verify (:func:`verify_manifest`), a trusted key signed
        the entry itself (:func:`warmctl.trust.check_entry`; an entry is a signed name, not a
        pointer to trust), and the signed manifest agrees with the entry (name, ``created``,
        profile digest, kind of host) and fits this host (``fp``; None: any host). Returns (the manifest's verification,
        the entry's key id; None when ``insecure`` let an unsigned entry through, with a
        warning added to the verification). Raises :class:`TrustError`,
        :class:`warmctl.errors.IntegrityError`."""
        where = self.backend.location(_entry_key(e.name, e.tag, e.manifest))
        v = verify_manifest(self.store, e.manifest, keys_dir, insecure=insecure)
        m = v.manifest
        ref = f"{e.name}:{e.tag}"
        if m.name != e.name:
            raise TrustError(f"{ref} points at manifest {e.manifest} of {m.name!r}")
        ok, why = select([m], fp, driver=driver) if fp is not None else (m, [])
        if ok is None:
            raise TrustError(f"catalog entry {ref} -> {e.manifest}: the signed manifest's host does not fit: {why[0].reason}")
        for what, bad in (("created", m.created != e.created), ("profile digest", m.profile_digest != e.profile_digest),
                          ("host", compat_key(m.host) != e.compat or compat_key(e.host) != e.compat)):
            if bad:
                raise TrustError(f"catalog entry {ref} -> {e.manifest} ({where}): its {what} is not the signed manifest's")
        key: str | None = None
        try:
            key = check_entry(e, self.entry_signatures(e), load_trusted_keys(keys_dir), where)
        except TrustError as err:
            if not insecure:
                raise
            note = f"INSECURE: using a catalog entry whose signature was not verified: {err}"
            log.warning(note)
            v = v.model_copy(update={"insecure": True, "warning": f"{v.warning}; {note}" if v.warning else note})
        return v, key


def nothing_fits(ref: str, candidates: int, fp: HostFingerprint, rejections: list[Rejection], where: str = "") -> SnapshotNotFound:
    """The error when none of ``candidates`` snapshots of ``ref`` fits host ``fp``: one line per
    rejected candidate with its rule and reason (``where``: the catalog, for messages); an
    :class:`~warmctl.errors.ImageMismatch` when every one was made in another container image."""
    lines = "\n".join(f"  - {r.digest} ({r.rule}): {r.reason}" for r in rejections)
    cls = ImageMismatch if rejections and all(r.rule == "image" for r in rejections) else SnapshotNotFound
    return cls(f"none of the {candidates} snapshot(s) of {ref}{' in ' + where if where else ''} "
               f"fits this host ({fp.summary()}):\n{lines}")


def entry_for(manifest: Manifest, digest: str, tag: str, signed_by: list[str] | None = None) -> CatalogEntry:
    """The catalog entry that names ``manifest`` (stored as ``digest``) ``manifest.name``:``tag``,
    published now."""
    return CatalogEntry(
        name=manifest.name,
        tag=tag,
        manifest=digest,
        created=manifest.created,
        published=datetime.now(timezone.utc),
        profile_digest=manifest.profile_digest,
        size=manifest.total_size(),
        host=manifest.host,
        compat=compat_key(manifest.host),
        signed_by=signed_by or [],
    )
