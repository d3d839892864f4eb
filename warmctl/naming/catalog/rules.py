"""Which snapshot a host can restore: the compatibility rules of ``catalog/README.md``.

:func:`check` compares one snapshot's host fingerprint with this host's, rule by rule
(:data:`RULES`, in order); :func:`select` and :func:`ranked` apply it to candidates (catalog
entries or manifests) and give every candidate that does not fit exactly one
:class:`Rejection`, the first rule it fails; :func:`compat_key` is the digest of what the rules
compare (two snapshots with the same key suit the same hosts). Nothing here reads a store.
"""

# No `from __future__ import annotations` here: pydantic would then evaluate each field's
# annotation from its string when the class is made (compiling it), about 4 ms of every
# `warmctl up` over the model modules it imports (docs/benchmarks.md).

import hashlib
import json
import re
from datetime import datetime, timezone
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

from warmctl.base.errors import ImageMismatch, SnapshotNotFound
from warmctl.host import FINGERPRINT_FORMAT, HostFingerprint
from warmctl.records.manifest import Manifest

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

    model_config = ConfigDict(defer_build=True)

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


class Rejection(BaseModel):
    """Why candidate ``digest`` does not fit: ``rule`` (short name from :data:`RULES`) and
    ``reason`` (one sentence naming the snapshot's and the host's values)."""

    model_config = ConfigDict(defer_build=True)

    digest: str
    rule: str
    reason: str

    def __str__(self) -> str:
        return f"{self.digest}: {self.reason}"



def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _host_of(c: Any) -> dict[str, Any]:
    return c.host if isinstance(c.host, dict) else dict(c.host)


def _digest_of(c: Any) -> str:
    if isinstance(c, Manifest):
        return c.digest()
    named = getattr(c, "manifest", None)  # a CatalogEntry: the digest of the manifest it names
    if isinstance(named, str):
        return named
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
        from warmctl.base.parallel import parse_cpu_list
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

    ``candidates``: :class:`~warmctl.naming.catalog.CatalogEntry` or :class:`warmctl.records.manifest.Manifest` objects (anything
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
        crit: dict[str, Any] = {
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



def nothing_fits(ref: str, candidates: int, fp: HostFingerprint, rejections: list[Rejection], where: str = "") -> SnapshotNotFound:
    """The error when none of ``candidates`` snapshots of ``ref`` fits host ``fp``: one line per
    rejected candidate with its rule and reason (``where``: the catalog, for messages); an
    :class:`~warmctl.base.errors.ImageMismatch` when every one was made in another container image."""
    lines = "\n".join(f"  - {r.digest} ({r.rule}): {r.reason}" for r in rejections)
    cls = ImageMismatch if rejections and all(r.rule == "image" for r in rejections) else SnapshotNotFound
    return cls(f"none of the {candidates} snapshot(s) of {ref}{' in ' + where if where else ''} "
               f"fits this host ({fp.summary()}):\n{lines}")

