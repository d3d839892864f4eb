"""The node pre-warm controller: keep the snapshots that ``WarmSnapshot`` objects name pulled on
this node, and say so on the Node and in each object's status.

A ``WarmSnapshot`` (``warmsnapshots.warmctl.io``, cluster-scoped; deploy/kubernetes/) has
``spec.ref`` (``NAME[:TAG]`` or ``NAME@sha256:...``), ``spec.remote`` (a store URL: a directory,
``s3://bucket/prefix`` or ``oci://HOST/REPO``; unset: the ``remote_store`` setting) and
``spec.nodeSelector`` (labels a Node must all have; empty or unset: every node). For this node
(``settings.node_name``), each pass:

1. reads the Node's labels and lists every ``WarmSnapshot``;
2. for each one whose selector matches, pulls ``ref`` from ``remote`` into the node's store
   exactly as ``warmctl pull`` does (:func:`warmctl.naming.fleet.pull`: the entry this host would
   restore, signed by a trusted key, no rollback, every chunk verified on the way; a second
   pass copies nothing), then, as ``warmctl pull`` also does, hashes the files the snapshot's
   processes map into the node's digest cache (:func:`warmctl.pipelines.materialize.prehash`),
   so that an engine pod's ``up`` checks them with a ``stat`` each instead of reading them
   (``tiny`` in the project's image: 128 files, 0.4 s). Success:
   the Node gets the label ``snapshot.warmctl.io/<NAME>`` =
   ``sha256-<first 40 hex digits of the manifest digest>`` (:func:`label_key`,
   :func:`label_value`), then this node's entry in ``status.nodes`` says ``digest`` and
   ``cachedAt`` (RFC 3339, when this node first held that digest). Failure: the entry holds the
   ``error`` (one line) and no digest, and the label is removed: no label ever claims a
   snapshot the node does not hold;
3. removes the labels of ``WarmSnapshot`` objects that are gone or no longer select this node,
   and this node's status entry from those that no longer select it. The snapshot stays in the
   store: the store's own ``gc`` and image-cache budget decide when it goes.

Every node writes the same objects' status: each write is a read-modify-write of the whole
``status`` through the status subresource with the object's ``resourceVersion`` (the API server
answers 409 Conflict to a stale one: read again, retry), keeping every other node's entry.

:class:`Prewarmer` runs passes in a loop (:meth:`Prewarmer.run`): every
``settings.prewarm_interval_s`` seconds, and at once when a watch on ``WarmSnapshot`` objects
sees one created, deleted or its spec changed (status writes do not wake it). ``warmctl prewarm``
runs it in the foreground (``--once``: one pass), ``warmctl agent --prewarm`` in a thread beside
the REST API (the node DaemonSet). The service account needs get/list/watch on
``warmsnapshots``, update on ``warmsnapshots/status`` and get/patch on ``nodes``
(deploy/kubernetes/rbac.yaml).
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from warmctl.base.errors import WarmctlError
from warmctl.kube.client import KubeError, connect

if TYPE_CHECKING:
    import lightkube

    from warmctl.records.config import Settings

log = logging.getLogger(__name__)

#: The custom resource, as deploy/kubernetes/ serves it.
GROUP, VERSION, KIND, PLURAL = "warmctl.io", "v1alpha1", "WarmSnapshot", "warmsnapshots"
#: Prefix of the Node labels this controller owns: ``snapshot.warmctl.io/<NAME>``.
LABEL_PREFIX = "snapshot.warmctl.io/"
#: Attempts at one status write when other nodes keep writing the same object (409 Conflict).
CONFLICT_RETRIES = 20
#: Longest error message kept in a status entry (characters; the rest is cut with "...").
ERROR_CHARS = 480

# A label key's name part (Kubernetes "Labels and Selectors"): at most 63 characters,
# alphanumerics at both ends, '-', '_' and '.' between.
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


def warm_snapshot_resource() -> Any:
    """The lightkube class of ``WarmSnapshot`` (a generic global resource; ``.Status`` is its
    status subresource)."""
    from lightkube.generic_resource import create_global_resource

    return create_global_resource(GROUP, VERSION, KIND, PLURAL)


def label_key(name: str) -> str:
    """The Node label key for the ``WarmSnapshot`` named ``name``: ``snapshot.warmctl.io/<name>``.
    An object name is a DNS subdomain (lowercase alphanumerics, '-', '.'; up to 253
    characters); one of at most 63 characters is a valid label name part as it is. A longer one
    (or anything else that is not a valid name part) maps to its first 52 valid characters,
    '-', and the first 10 hex digits of the SHA-256 of the whole name (63 characters): stable,
    distinct for distinct names in practice; the object's status names the node either way."""
    if len(name) <= 63 and _NAME_PART.fullmatch(name):
        return LABEL_PREFIX + name
    h = hashlib.sha256(name.encode()).hexdigest()[:10]
    head = re.sub(r"[^-A-Za-z0-9_.]", "-", name)[:52].strip("-_.")
    return LABEL_PREFIX + (f"{head}-{h}" if head else h)


def label_value(digest: str) -> str:
    """The label value for manifest ``digest`` (``sha256:<64 hex>``): ``sha256-<first 40 hex>``
    (47 characters: a label value holds at most 63, and no ':'). Raises :class:`ValueError`
    for anything but a sha256 digest."""
    m = _DIGEST.fullmatch(digest)
    if not m:
        raise ValueError(f"not a manifest digest: {digest!r}")
    return "sha256-" + m.group(1)[:40]


def selector_matches(selector: dict[str, str] | None, labels: dict[str, str] | None) -> bool:
    """True when the Node's ``labels`` hold every ``key: value`` of ``selector`` (a
    ``nodeSelector``, as in a pod spec); an empty or missing selector matches every node."""
    labels = labels or {}
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def rfc3339(t: datetime | None = None) -> str:
    """``t`` (default: now) in UTC as RFC 3339 with seconds: ``2026-12-03T06:40:00Z``."""
    return (t or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def one_line(e: BaseException) -> str:
    """``e`` as one status line: its message's first line (a warmctl error), else the exception's
    class name and first line; at most :data:`ERROR_CHARS` characters."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if not isinstance(e, WarmctlError):
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 3] + "..."


@dataclass
class Outcome:
    """What one pass did for one ``WarmSnapshot`` on this node.

    ``action``: ``"cached"`` (pulled and verified, or already whole: ``chunks_copied`` 0),
    ``"failed"`` (``error`` says why; no label), ``"unselected"`` (the selector does not match
    this node: label and status entry removed). ``digest``: the manifest digest held;
    ``bytes_copied``: stored bytes fetched from the remote; ``seconds``: wall time of the whole
    pull (opening the stores, this host's fingerprint, resolving and checking the entry, the
    copy); ``copy_seconds``: the copy alone (what ``warmctl pull --json`` reports as
    ``seconds``); ``files_hashed``: required files whose digests this pass put in the node's
    digest cache (0 when they were there), ``hash_seconds``: that check
    (:func:`warmctl.pipelines.materialize.prehash`), not counted in ``seconds``."""

    name: str
    ref: str
    remote: str | None
    action: str
    digest: str | None = None
    label: str | None = None
    error: str | None = None
    chunks_total: int = 0
    chunks_copied: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    copy_seconds: float = 0.0
    files_hashed: int = 0
    hash_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The outcome as ``warmctl prewarm --once --json`` prints it (docs/cli-json.md)."""
        return asdict(self)


class Prewarmer:
    """The controller for one node (see the module doc). ``client``: a ``lightkube.Client``
    (default: :func:`warmctl.kube.client.connect` from ``settings``). Raises :class:`KubeError`
    when ``settings.node_name`` is unset."""

    def __init__(self, settings: Settings, client: lightkube.Client | None = None):
        if not settings.node_name:
            raise KubeError("the pre-warm controller needs this node's name: set node_name (WARMCTL_NODE_NAME; "
                            "the DaemonSet sets it from spec.nodeName)")
        self.settings = settings
        self.node: str = settings.node_name
        self.client = client if client is not None else connect(settings)
        self.ws = warm_snapshot_resource()
        self._stop = threading.Event()
        self._wake = threading.Event()
        #: name -> metadata.generation of every WarmSnapshot the last pass listed (the watch
        #: wakes the loop only for what differs from it)
        self._seen: dict[str, Any] = {}
        self._thread: threading.Thread | None = None

    # --- one pass ------------------------------------------------------------------------------

    def pass_once(self) -> list[Outcome]:
        """One pass over every ``WarmSnapshot`` (the module doc's steps). Returns one
        :class:`Outcome` per object that selects this node or whose label or entry it removed.
        A failed pull is an outcome, not an exception. Raises :class:`KubeError` when the API
        server cannot be reached or refuses (the Node does not exist, RBAC)."""
        labels = self._node_labels()
        objects = self._call("list WarmSnapshot objects", lambda: list(self.client.list(self.ws)))
        self._seen = {str((o.get("metadata") or {}).get("name")): (o.get("metadata") or {}).get("generation") for o in objects}
        out: list[Outcome] = []
        held: set[str] = set()
        for obj in objects:
            meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
            name = meta["name"]
            key = label_key(name)
            if not selector_matches(spec.get("nodeSelector"), labels):
                mine = any(e.get("node") == self.node for e in ((obj.get("status") or {}).get("nodes") or []))
                if key in labels or mine:
                    self._set_label(labels, key, None)
                    self._write_entry(name, None)
                    log.info("prewarm %s: no longer selects node %s; label and status entry removed "
                             "(the snapshot stays in the store)", name, self.node)
                    out.append(Outcome(name, str(spec.get("ref")), spec.get("remote"), "unselected"))
                continue
            held.add(key)
            o = self._prewarm(name, spec)
            self._set_label(labels, key, o.label)
            entry: dict[str, Any] = {"node": self.node}
            if o.digest is not None:
                entry.update(digest=o.digest, cachedAt=rfc3339())
            else:
                entry["error"] = o.error
            self._write_entry(name, entry, generation=meta.get("generation"))
            out.append(o)
        for key in [k for k in labels if k.startswith(LABEL_PREFIX) and k not in held]:
            self._set_label(labels, key, None)
            log.info("prewarm: label %s removed from node %s (its WarmSnapshot is gone; the snapshot stays "
                     "in the store)", key, self.node)
        return out

    def _prewarm(self, name: str, spec: dict[str, Any]) -> Outcome:
        """Pull one object's ``ref`` from its remote; failures become the outcome's ``error``."""
        from warmctl.naming import fleet
        from warmctl.naming.catalog import Ref
        from warmctl.pipelines.materialize import prehash
        from warmctl.store import open_store

        ref, remote = str(spec.get("ref") or ""), spec.get("remote") or self.settings.remote_store
        o = Outcome(name, ref, remote, "failed")
        t0 = time.monotonic()
        src = dst = None
        try:
            if not ref:
                raise WarmctlError("spec.ref is empty: want NAME[:TAG] or NAME@sha256:<hex>")
            if not remote:
                raise WarmctlError("no remote: set spec.remote (a directory, s3://bucket/prefix or oci://HOST/REPO) "
                                   "or the node's remote_store")
            r = Ref.parse(ref)
            try:
                src = open_store(remote, settings=self.settings)
            except ValueError as e:
                raise WarmctlError(f"spec.remote {remote!r}: {e}") from None
            dst = open_store(self.settings.store_dir, settings=self.settings)
            notes: list[str] = []
            [copied] = fleet.pull(self.settings, src, dst, r, notes=notes)
            for line in notes:
                log.info("prewarm %s: %s", name, line)
            rep = copied.report
            o.action, o.digest, o.label = "cached", rep.digest, label_value(rep.digest)
            o.chunks_total, o.chunks_copied, o.bytes_copied = rep.chunks_total, rep.chunks_copied, rep.bytes_copied
            o.seconds, o.copy_seconds = time.monotonic() - t0, rep.seconds
            log.info("prewarm %s: %s from %s cached on node %s as %s: %d/%d chunks copied, %d bytes, %.1f s",
                     name, ref, remote, self.node, rep.digest, rep.chunks_copied, rep.chunks_total,
                     rep.bytes_copied, o.seconds)
            try:
                pre = prehash(dst.get_manifest(rep.digest), self.settings)
                o.files_hashed, o.hash_seconds = pre.files_hashed, pre.seconds
                if pre.problems:
                    log.warning("prewarm %s: %d file(s) the snapshot's processes map are missing or differ in this "
                                "image; an engine pod of it would refuse the snapshot: %s", name, len(pre.problems),
                                "; ".join(pre.problems[:3]))
                if pre.files_hashed:
                    log.info("prewarm %s: %d required file(s) hashed into the node's digest cache in %.1f s",
                             name, pre.files_hashed, pre.seconds)
            except Exception as e:  # noqa: BLE001 - the snapshot is held: the pods hash for themselves
                log.warning("prewarm %s: the snapshot's mapped files were not hashed ahead: %s", name, one_line(e))
        except Exception as e:  # noqa: BLE001 - any failure of one snapshot is its status entry, never the loop's end
            o.error, o.seconds = one_line(e), time.monotonic() - t0
            log.error("prewarm %s: %s from %s on node %s failed: %s", name, ref, remote, self.node, o.error)
        finally:
            for s in (src, dst):
                if s is not None:
                    s.close()
        return o

    # --- the API server ------------------------------------------------------------------------

    def _call(self, what: str, fn: Any) -> Any:
        """``fn()``, with the client's errors (refused, unreachable) raised as :class:`KubeError`."""
        import httpx
        from lightkube import ApiError

        try:
            return fn()
        except ApiError as e:
            raise KubeError(f"{what}: the API server answered {e.status.code}: {e.status.message}") from None
        except httpx.HTTPError as e:
            raise KubeError(f"{what}: {type(e).__name__}: {e}") from None

    def _node_labels(self) -> dict[str, str]:
        from lightkube.resources.core_v1 import Node

        node = self._call(f"read node {self.node}", lambda: self.client.get(Node, self.node))
        return dict(node.metadata.labels or {})

    def _set_label(self, labels: dict[str, str], key: str, value: str | None) -> None:
        """Set (``value``) or remove (None) one label on this Node, when it differs from
        ``labels`` (updated in place)."""
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType

        if labels.get(key) == value:
            return
        self._call(f"label node {self.node}", lambda: self.client.patch(
            Node, self.node, {"metadata": {"labels": {key: value}}}, patch_type=PatchType.MERGE))
        if value is None:
            labels.pop(key, None)
        else:
            labels[key] = value

    def _write_entry(self, name: str, entry: dict[str, Any] | None, *, generation: int | None = None) -> None:
        """Put this node's ``entry`` into ``status.nodes`` of ``WarmSnapshot`` ``name`` (None:
        remove it), keeping every other node's entry; ``cachedAt`` stays as it was while the
        digest is the same. Nothing is written when nothing changes. Read-modify-write with the
        object's ``resourceVersion``: a 409 Conflict (another node wrote first) reads again and
        retries, up to :data:`CONFLICT_RETRIES` times. An object deleted meanwhile is left."""
        from lightkube import ApiError

        for attempt in range(CONFLICT_RETRIES):
            try:
                obj = self.client.get(self.ws, name)
            except ApiError as e:
                if e.status.code == 404:
                    return
                raise KubeError(f"read WarmSnapshot {name}: the API server answered {e.status.code}: "
                                f"{e.status.message}") from None
            status = dict(obj.get("status") or {})
            others = [e for e in status.get("nodes") or [] if e.get("node") != self.node]
            old = next((e for e in status.get("nodes") or [] if e.get("node") == self.node), None)
            if entry is not None and old is not None and old.get("digest") == entry.get("digest") and old.get("cachedAt"):
                entry = {**entry, "cachedAt": old["cachedAt"]}
            gen = generation if generation is not None else (obj.get("metadata") or {}).get("generation")
            if old == entry and (entry is None or status.get("observedGeneration") == gen):
                return
            status["nodes"] = sorted(others + ([entry] if entry is not None else []), key=lambda e: str(e.get("node")))
            if entry is not None and gen is not None:
                status["observedGeneration"] = gen
            body = self.ws.Status({**obj, "status": status})
            try:
                self.client.replace(body, name)
                return
            except ApiError as e:
                if e.status.code == 404:
                    return
                if e.status.code != 409:
                    raise KubeError(f"write the status of WarmSnapshot {name}: the API server answered "
                                    f"{e.status.code}: {e.status.message}") from None
            time.sleep(random.uniform(0.01, 0.05) * (attempt + 1))  # another node wrote first: read again
        raise KubeError(f"write the status of WarmSnapshot {name}: still conflicting after {CONFLICT_RETRIES} tries")

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Run passes until :meth:`stop`: one at once, then one every
        ``settings.prewarm_interval_s`` seconds, or sooner when the watch sees a
        ``WarmSnapshot`` created, deleted or its spec changed. A pass that fails (the API
        server unreachable) is logged and the loop goes on."""
        watcher = threading.Thread(target=self._watch, name="warmctl-prewarm-watch", daemon=True)
        watcher.start()
        log.info("prewarm: node %s, a pass every %.0f s and on every WarmSnapshot change",
                 self.node, self.settings.prewarm_interval_s)
        while not self._stop.is_set():
            self._wake.clear()
            try:
                done = self.pass_once()
                log.info("prewarm: pass done on node %s: %d cached, %d failed, %d unselected", self.node,
                         *(sum(o.action == a for o in done) for a in ("cached", "failed", "unselected")))
            except KubeError as e:
                log.error("prewarm: pass failed on node %s: %s", self.node, e)
            except Exception:  # noqa: BLE001 - the loop outlives any one pass
                log.exception("prewarm: pass failed on node %s", self.node)
            self._wake.wait(self.settings.prewarm_interval_s)

    def _watch(self) -> None:
        """Wake the loop when a ``WarmSnapshot`` appears, goes, or its ``generation`` (its spec)
        differs from what the last pass listed; reconnect after an error, 5 s later. Status
        writes (every node's) and the watch's opening burst of objects already seen wake
        nothing."""
        while not self._stop.is_set():
            try:
                for kind, obj in self.client.watch(self.ws, server_timeout=300):
                    if self._stop.is_set():
                        return
                    meta = obj.get("metadata") or {}
                    name, gen, seen = str(meta.get("name")), meta.get("generation"), self._seen
                    if (name not in seen) if kind == "DELETED" else (seen.get(name, object()) == gen):
                        continue
                    self._wake.set()
            except Exception as e:  # noqa: BLE001 - a dropped watch is reopened; the period still runs passes
                log.warning("prewarm: watch of WarmSnapshot objects ended (%s); reopening in 5 s", one_line(e))
                self._stop.wait(5.0)

    def start(self) -> threading.Thread:
        """Run :meth:`run` in a daemon thread (``warmctl agent --prewarm``); returns it."""
        self._thread = threading.Thread(target=self.run, name="warmctl-prewarm", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout_s: float | None = None) -> None:
        """Ask the loop to end after its current pass; wait up to ``timeout_s`` for the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
