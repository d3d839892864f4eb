"""Effective configuration: where warmctl keeps its data, which store and catalog it uses,
which keys it trusts, default ports.

Values come from, in rising priority: built-in defaults, the config file
(``/etc/warmctl/config.toml``, or ``$WARMCTL_CONFIG``, or the ``config_file`` argument),
environment variables (:data:`ENV_VARS`: ``WARMCTL_HOME``, ``WARMCTL_STORE``, ...), and
command-line flags (``overrides``). ``Settings.sources`` records where each effective value came
from (``default``, ``file:PATH``, ``env:VAR``, ``flag``); ``warmctl config show`` prints them.
An annotated example is ``docs/config.example.toml``.

The file is flat TOML whose keys are the :class:`Settings` field names. Relative paths in the
file are relative to the file's directory; relative paths from the environment or flags are
relative to the working directory. ``profile_dirs`` from the environment is a ``:``-separated
list.
"""

# No `from __future__ import annotations` here: pydantic would then evaluate each field's
# annotation from its string when the class is made (compiling it), about 4 ms of every
# `warmctl up` over the model modules it imports (docs/benchmarks.md).

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from warmctl.base.errors import WarmctlError

DEFAULT_CONFIG_FILE = Path("/etc/warmctl/config.toml")
DEFAULT_HOME = Path("/var/lib/warmctl")

#: field -> environment variable
ENV_VARS = {
    "home": "WARMCTL_HOME",
    "store": "WARMCTL_STORE",
    "remote_store": "WARMCTL_REMOTE_STORE",
    "catalog": "WARMCTL_CATALOG",
    "keys_dir": "WARMCTL_KEYS_DIR",
    "signing_key": "WARMCTL_SIGNING_KEY",
    "profile_dirs": "WARMCTL_PROFILE_DIRS",
    "gate_host": "WARMCTL_GATE_HOST",
    "gate_port": "WARMCTL_GATE_PORT",
    "gate_api_key_file": "WARMCTL_GATE_API_KEY_FILE",
    "gate_tls_cert": "WARMCTL_GATE_TLS_CERT",
    "gate_tls_key": "WARMCTL_GATE_TLS_KEY",
    "gate_drain_s": "WARMCTL_GATE_DRAIN_S",
    "agent_url": "WARMCTL_AGENT_URL",
    "agent_token_file": "WARMCTL_AGENT_TOKEN_FILE",
    "agent_host": "WARMCTL_AGENT_HOST",
    "agent_port": "WARMCTL_AGENT_PORT",
    "agent_header_timeout_s": "WARMCTL_AGENT_HEADER_TIMEOUT_S",
    "agent_keep_alive_s": "WARMCTL_AGENT_KEEP_ALIVE_S",
    "criu": "WARMCTL_CRIU",
    "match_driver": "WARMCTL_MATCH_DRIVER",
    "s3_outage_s": "WARMCTL_S3_OUTAGE_S",
    "s3_read_timeout_s": "WARMCTL_S3_READ_TIMEOUT_S",
    "cold_start": "WARMCTL_COLD_START",
    "restore_pages": "WARMCTL_RESTORE_PAGES",
    "restore_stream": "WARMCTL_RESTORE_STREAM",
    "seal_key": "WARMCTL_SEAL_KEY",
    "image_cache_bytes": "WARMCTL_IMAGE_CACHE_BYTES",
    "s3_endpoint": "WARMCTL_S3_ENDPOINT",
    "oci_pack_bytes": "WARMCTL_OCI_PACK_BYTES",
    "oci_read_deadline_s": "WARMCTL_OCI_READ_DEADLINE_S",
    "remote_deadline_floor_s": "WARMCTL_REMOTE_DEADLINE_FLOOR_S",
    "remote_min_rate_bytes_s": "WARMCTL_REMOTE_MIN_RATE_BYTES_S",
    "rank_silence_s": "WARMCTL_RANK_SILENCE_S",
    "dump_timeout_s": "WARMCTL_DUMP_TIMEOUT_S",
    "zero_pages": "WARMCTL_ZERO_PAGES",
    "oci_ca_bundle": "WARMCTL_OCI_CA_BUNDLE",
    "oci_certs_d": "WARMCTL_OCI_CERTS_D",
    "oci_insecure": "WARMCTL_OCI_INSECURE",
    "lock_stale_s": "WARMCTL_LOCK_STALE_S",
    "criu_lock": "WARMCTL_CRIU_LOCK",
    "xtile_perm_lib": "WARMCTL_XTILE_PERM_LIB",
    "libnvml": "WARMCTL_LIBNVML",
    "libcuda": "WARMCTL_LIBCUDA",
    "cuda_checkpoint": "WARMCTL_CUDA_CHECKPOINT",
    "kube_config": "WARMCTL_KUBECONFIG",
    "pod_name": "WARMCTL_POD_NAME",
    "pod_namespace": "WARMCTL_POD_NAMESPACE",
    "node_name": "WARMCTL_NODE_NAME",
    "prewarm_interval_s": "WARMCTL_PREWARM_INTERVAL_S",
    "termination_message_path": "WARMCTL_TERMINATION_MESSAGE_PATH",
    "image_digest": "WARMCTL_IMAGE_DIGEST",
}

#: The environment variable naming the config file (its value is :attr:`Settings.config_file`).
CONFIG_ENV = "WARMCTL_CONFIG"

#: Default ``image_cache_bytes``: half the size of the filesystem holding ``<home>/cache``.
DEFAULT_IMAGE_CACHE = "50%"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(v: Any) -> int | float:
    """An ``image_cache_bytes`` value as bytes (``int``) or as a fraction of the filesystem
    (``float`` in [0, 1]): a non-negative integer is bytes; a float in [0, 1] or a string
    ``"N%"`` is a fraction; a string ``"N UNIT"`` is bytes (``K/M/G/T`` and ``KB..TB`` are
    powers of 1000, ``KiB..TiB`` of 1024). Raises :class:`ValueError` for anything else."""
    if isinstance(v, bool):
        raise ValueError("a number of bytes, a fraction in [0, 1] or a string like '40%' or '200 GiB'")
    if isinstance(v, int):
        if v < 0:
            raise ValueError("bytes must be >= 0")
        return v
    if isinstance(v, float):
        if not 0.0 <= v <= 1.0:
            raise ValueError("a fraction of the filesystem must be in [0, 1] (bytes are an integer)")
        return v
    if isinstance(v, str):
        t = v.strip().replace("_", "").lower()
        m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*(%|[a-z]*)", t)
        if m and m.group(2) == "%":
            pct = float(m.group(1))
            if pct > 100:
                raise ValueError(f"{v!r}: more than 100% of the filesystem")
            return pct / 100.0
        if m and m.group(2) == "" and "." in m.group(1):  # "0.5" (the environment's form of 0.5)
            return parse_budget(float(m.group(1)))
        if m and m.group(2) in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2)])
    raise ValueError(f"{v!r}: a number of bytes, a fraction in [0, 1] or a string like '40%' or '200 GiB'")

#: Path-valued fields (made absolute by :func:`load_settings`).
PATH_FIELDS = ("home", "store", "keys_dir", "signing_key", "agent_token_file", "gate_api_key_file",
               "gate_tls_cert", "gate_tls_key", "seal_key", "oci_ca_bundle", "oci_certs_d", "criu_lock",
               "xtile_perm_lib")


class ConfigError(WarmctlError):
    """The config file is unreadable or has a bad value."""


class Settings(BaseModel):
    """Effective settings. Paths are absolute after :func:`load_settings`.

    - ``home``: data directory (runtime state, models, local store, cache).
    - ``store``: local content-addressed store (directory); default ``home/store``.
    - ``remote_store``: optional remote store URL (``s3://bucket/prefix``, ``oci://HOST/REPO`` or a directory)
      shared by a fleet: ``up`` restores from it (streaming chunks into the local store, its
      cache) and ``snapshot`` publishes to it after the local store (``--no-push`` to skip).
    - ``catalog``: store URL whose catalog ``up`` reads and ``snapshot`` publishes to; default
      ``remote_store`` when set, else the local store (see :attr:`catalog_url`).
    - ``keys_dir``: trusted ed25519 public keys (``*.pub``); default ``/etc/warmctl/keys``.
    - ``signing_key``: private key used to sign manifests on publish (optional; unsigned
      snapshots are refused by ``up`` unless its insecure flag is given).
    - ``profile_dirs``: directories searched for ``NAME.toml`` first; then
      ``/etc/warmctl/profiles``, then the profiles shipped in the package
      (:func:`warmctl.records.profile.search_dirs`).
    - ``gate_host``/``gate_port``: override the profile's public address when set.
    - ``gate_api_key_file``: API keys the public port requires (``Authorization: Bearer KEY``),
      one per line; re-read on change and on SIGHUP to the gate. Unset: no key is required.
      Must be private (mode 0600 or tighter, owned by root or this user), else ``up`` refuses it.
    - ``gate_tls_cert``/``gate_tls_key``: PEM certificate chain and private key; when set the
      public port speaks TLS only (both re-read on change). The key must be private too.
    - ``gate_allow_paths``: paths the public port serves beside vLLM's inference API
      (:data:`warmctl.gate.routes.DEFAULT_ALLOW_PATHS`), e.g. ``["/metrics"]``; ``{name}``
      matches one path segment. Every other path is refused without reaching the engine.
    - ``gate_public_paths``: decoded paths answered without a key (default ``["/health"]``;
      served even if not in the allow list).
    - ``gate_deny_paths``: paths refused (403) on the public port, with everything below them,
      even if allowed; vLLM's control routes (:data:`warmctl.gate.routes.CONTROL_PATHS`) always are.
    - ``gate_drain_s``: seconds ``down`` lets in-flight requests finish after the public
      listener closed (default 30; ``down --now``: none).
    - ``agent_url``/``agent_token_file``: when set, the CLI talks to that agent.
    - ``agent_host``/``agent_port``: where ``warmctl agent`` listens by default.
    - ``agent_header_timeout_s``: seconds a connection to the agent may take to send a
      request's line and headers (default 10); then the agent closes it (a slow-header client).
    - ``agent_keep_alive_s``: seconds an idle keep-alive connection to the agent stays open
      (whole seconds, default 5; uvicorn's ``timeout_keep_alive``).
    - ``criu``: the CRIU binary (name looked up in ``$PATH``, or a path).
    - ``match_driver``: ``exact`` (default) or ``major``: how a snapshot's NVIDIA driver version
      must match the host's (see ``catalog/README.md``).
    - ``s3_outage_s``: seconds an S3 store that stopped answering (connection refused, DNS,
      timeouts, 5xx, throttling, cut-off bodies) is retried before the command fails with one
      line naming the endpoint and object (default 60; 0 = fail at the first error).
    - ``s3_read_timeout_s``: seconds one S3 request waits for the next bytes of its answer
      (default 20): what ends a request to an endpoint that accepted the connection and then
      said nothing, or an upload taken into the socket buffers whose answer never comes;
      the attempt is then retried for ``s3_outage_s``.
    - ``cold_start``: what ``up`` does when no snapshot fits this host: ``fallback`` (default:
      say why, then cold-start from the profile) or ``never`` (fail, naming every candidate
      and why it was rejected: a fleet node should not silently spend a 14-minute cold start).
    - ``restore_pages``: how ``up`` restores a snapshot's memory: ``lazy`` (``criu restore
      --lazy-pages``: pages copied from the image on first touch and the rest in the background
      by a ``criu lazy-pages`` daemon the gate watches; the engine answers before the whole
      image is read), ``eager`` (default: every page copied before the engine runs), or
      ``auto`` (lazy when ``criu check --feature uffd-noncoop`` passes on this host, cached
      per CRIU binary and kernel; eager otherwise). Eager is the default because ``up``'s
      canary must pass before the port opens, and with lazy pages it faults in what it touches
      while the daemon's background copy competes for the CPU: on the 2-vCPU development VM
      lazy ``up`` took 2.50 s to the first correct token against eager's 2.05 s
      (``benchmarks/up_vs_raw.py``, docs/benchmarks.md). A profile whose checkpoint plan loads CRIU
      plugins (AMD) always restores eagerly: lazy pages with plugins are not verified.
    - ``restore_stream``: ``auto``: when ``up`` must write the image first (a fresh node, or an
      image not kept on this host) and restores eagerly without CRIU plugins, CRIU restores
      from the image while it is being fetched, verified and written (``criu restore
      --stream``, :mod:`warmctl.checkpoint.stream`: only verified bytes reach CRIU, and a bad
      chunk fails the restore); ``never`` (default): the whole image is written first, then
      restored. Not the default because on the 2-vCPU development VM it was faster for a 2.7
      GiB snapshot (fresh node from a directory remote 1.35x) but not for a 9.8 GiB one (0.90x
      from a directory, 0.44x from an RGW on the same host under memory pressure, one run
      each; docs/benchmarks.md): where the fetch's and CRIU's CPU share too few cores the overlap
      gains nothing, and the restored engine's memory meets the image's dirty pages at once.
    - ``engine_env_passthrough``: variables of warmctl's environment the engine gets too
      (exact names, or prefixes ending in ``*``: ``["HTTPS_PROXY", "NCCL_*"]``), for a site's
      proxy, CA bundle or interconnect settings. The engine's environment is otherwise
      declared: :data:`warmctl.engine.vllm.BASE_ENV` (locale, paths, BLAS/OpenMP and the
      accelerator runtime's device lists), what warmctl sets, and the profile's
      ``[engine.env]``; nothing else of warmctl's environment reaches it (``warmctl profile
      command`` shows it; the manifest records it by name). A credential passed through
      reaches the engine's memory, and ``snapshot`` then refuses to publish (docs/operations.md,
      "Credentials and snapshots").
    - ``seal_key``: the fleet key file (32 bytes of base64, mode 0600) with which this host
      reads and writes sealed stores (those holding ``sealed.json``, made by ``warmctl seal
      URL``): every object encrypted and authenticated (AES-256-GCM) before it leaves
      the host (docs/store-format.md, "Sealed stores"). Unset: a sealed store is refused,
      naming its key ids.
    - ``image_cache_bytes``: how much disk the verified images kept for fast ``up``\\ s
      (``<home>/cache/images``, :mod:`warmctl.checkpoint.imagecache`) may take: bytes
      (``200000000000``, ``"200 GiB"``) or a fraction of the filesystem holding the cache
      (``"50%"``, ``0.5``; the default is ``"50%"``: the store's chunks of a snapshot take about
      as much as its kept image, so half for images leaves the other half for the store that
      holds them). Least recently used images go first; an image in use by a running engine
      never goes; an image larger than the budget is restored from and not kept; ``0`` keeps
      none (every ``up`` writes the image into its run directory and removes it afterwards).
    - ``s3_endpoint``: the S3 endpoint URL of ``s3://`` stores (e.g. a Ceph RGW or MinIO);
      unset: ``$AWS_ENDPOINT_URL``, else AWS. Credentials come from boto3's usual chain.
    - ``oci_pack_bytes``: largest pack (bytes) of chunks uploaded to an ``oci://`` store
      (default 1 GiB; docs/store-format.md, section 8).
    - ``oci_read_deadline_s``: seconds one metadata read from a registry may take in all
      (default 120; the ``remote_*`` bound below applies too, the smaller wins).
    - ``remote_deadline_floor_s``/``remote_min_rate_bytes_s``: the total deadline of every
      read and write of an object on an S3 or OCI remote: ``remote_deadline_floor_s`` (default
      30) + the object's size / ``remote_min_rate_bytes_s`` (default 1048576, 1 MiB/s) seconds;
      past it the transfer ends in :class:`warmctl.store.RemoteTooSlow` naming the object, the
      remote, the bytes moved and the seconds waited (a server trickling a byte every 19 s never
      trips the 20 s read timeout). On S3 it covers the whole request, the answer's head
      included (a server that answers nothing, or trickles its headers). A directory remote on
      a network filesystem is not bounded.
    - ``rank_silence_s``: seconds a rank of the engine may use no CPU time at all while a
      warm-up or canary-record request is in flight before it is declared silent
      (:class:`warmctl.checkpoint.layout.RankError` naming it) instead of waiting out the
      request's 600 s timeout (default 30; 0 = not watched).
    - ``dump_timeout_s``: seconds ``criu dump`` may run before warmctl kills it, removes what it
      wrote and fails naming the phase (:class:`warmctl.checkpoint.criu.DumpTimeout`); unset
      (the default): derived from the tree's resident memory,
      :func:`warmctl.checkpoint.criu.dump_timeout` (120 s + 32 MiB/s).
    - ``zero_pages``: what ``snapshot`` does with the CRIU image's all-zero pages of private
      anonymous memory: ``drop`` (default: left out of the image, :mod:`warmctl.checkpoint.zeropages`;
      a restore neither reads nor writes them, and the engine finds them zero) or ``keep``
      (the image as CRIU wrote it). On the 2-vCPU development VM, ``drop`` left out 1.0 of
      ``tiny``'s 2.3 GiB, and a raw restore to the first token took 0.88 s against 4.44 s for a
      freshly written copy and 0.87 s against 1.76 s for a repeat (medians,
      ``benchmarks/zero_pages.py``, docs/benchmarks.md). Snapshots made either way restore alike.
    - ``oci_ca_bundle``: PEM CA bundle a registry's certificate is verified against; unset:
      ``<oci_certs_d>/HOST[:PORT]/ca.crt`` when that file exists, else the system's.
    - ``oci_certs_d``: Docker's per-registry certificate directory (default ``/etc/docker/certs.d``).
    - ``oci_insecure``: registries (``host:port``) spoken to in plain HTTP; every other is HTTPS,
      verified. In the environment a comma-separated list.
    - ``lock_stale_s``: seconds a store lock lives without a refresh before another writer may
      break it (default 120; docs/store-format.md, "Locks").
    - ``criu_lock``: the host-wide lock file serializing CRIU dumps and restores (default
      ``/run/lock/warmctl-criu.lock``).
    - ``xtile_perm_lib``: ``criu-xtile-perm.so``, preloaded into ``criu restore`` on AMX hosts
      (default ``/usr/local/lib/warmctl/criu-xtile-perm.so``, built by ``scripts/install.sh``).
    - ``libnvml``/``libcuda``: the NVIDIA libraries loaded for GPU memory and the CUDA checkpoint
      API (defaults ``libnvidia-ml.so.1``, ``libcuda.so.1``: found by the dynamic loader).
    - ``cuda_checkpoint``: the ``cuda-checkpoint`` utility used on drivers without the
      checkpoint API (< 570); unset: ``cuda-checkpoint`` on ``PATH``.
    - ``kube_config``: a kubeconfig file for the Kubernetes API server (unset: the pod's service
      account when in a pod; :mod:`warmctl.kube.client`).
    - ``pod_name``/``pod_namespace``: the pod this process runs in, from the downward API
      (deploy/kubernetes/); set, ``up --foreground`` keeps the pod's ``warmctl.io/Restored``
      condition. ``node_name``: the node it runs on (``spec.nodeName``), for the node agent.
    - ``prewarm_interval_s``: seconds between two full passes of the node pre-warm controller
      (``warmctl prewarm``, ``warmctl agent --prewarm``; default 60); a ``WarmSnapshot``
      created, changed or deleted starts a pass at once (a watch), a node's labels are read
      each pass.
    - ``termination_message_path``: where a failing ``up --foreground`` writes its one-line
      error for ``kubectl describe pod`` (unset: ``/dev/termination-log`` when ``pod_name`` is
      set, else nowhere).
    - ``image_digest``: the digest (``sha256:<hex>``) of the container image this process runs
      in (the manifests under deploy/kubernetes/ set it). Set, it is part of the host's
      fingerprint: a snapshot made in this image records it, and one is restored only where
      the same digest is set (:mod:`warmctl.host`; unset outside a cluster, where nothing
      changes).
    - ``config_file``: the config file these settings were read from (``--config``, else
      ``$WARMCTL_CONFIG``, else ``/etc/warmctl/config.toml``); not a key of the file itself.
    """

    model_config = ConfigDict(defer_build=True, extra="forbid")

    home: Path = DEFAULT_HOME
    store: Path | None = None
    remote_store: str | None = None
    catalog: str | None = None
    keys_dir: Path = Path("/etc/warmctl/keys")
    signing_key: Path | None = None
    profile_dirs: list[Path] = []
    gate_host: str | None = None
    gate_port: int | None = Field(None, ge=1, le=65535)
    gate_api_key_file: Path | None = None
    gate_tls_cert: Path | None = None
    gate_tls_key: Path | None = None
    gate_allow_paths: list[str] = []
    gate_public_paths: list[str] = ["/health"]
    gate_deny_paths: list[str] = []
    gate_drain_s: float = Field(30.0, ge=0)
    agent_url: str | None = None
    agent_token_file: Path | None = None
    agent_host: str = "127.0.0.1"
    agent_port: int = Field(7420, ge=1, le=65535)
    agent_header_timeout_s: float = Field(10.0, gt=0)
    agent_keep_alive_s: int = Field(5, ge=1)
    criu: str = "criu"
    match_driver: Literal["exact", "major"] = "exact"
    s3_outage_s: float = Field(60.0, ge=0)
    s3_read_timeout_s: float = Field(20.0, gt=0)
    cold_start: Literal["fallback", "never"] = "fallback"
    restore_pages: Literal["auto", "lazy", "eager"] = "eager"
    restore_stream: Literal["auto", "never"] = "never"
    engine_env_passthrough: list[str] = []
    seal_key: Path | None = None
    image_cache_bytes: int | float | str = DEFAULT_IMAGE_CACHE
    s3_endpoint: str | None = None
    oci_pack_bytes: int = Field(1 << 30, ge=1)
    oci_read_deadline_s: float = Field(120.0, gt=0)
    remote_deadline_floor_s: float = Field(30.0, gt=0)
    remote_min_rate_bytes_s: int = Field(1 << 20, ge=1)
    rank_silence_s: float = Field(30.0, ge=0)
    dump_timeout_s: float | None = Field(None, gt=0)
    zero_pages: Literal["drop", "keep"] = "drop"
    oci_ca_bundle: Path | None = None
    oci_certs_d: Path = Path("/etc/docker/certs.d")
    oci_insecure: list[str] = []
    lock_stale_s: float = Field(120.0, gt=0)
    criu_lock: Path = Path("/run/lock/warmctl-criu.lock")
    xtile_perm_lib: Path = Path("/usr/local/lib/warmctl/criu-xtile-perm.so")
    libnvml: str = "libnvidia-ml.so.1"
    libcuda: str = "libcuda.so.1"
    cuda_checkpoint: str | None = None
    kube_config: Path | None = None
    pod_name: str | None = None
    pod_namespace: str | None = None
    node_name: str | None = None
    prewarm_interval_s: float = Field(60.0, gt=0)
    termination_message_path: Path | None = None
    image_digest: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$")
    config_file: Path = DEFAULT_CONFIG_FILE
    #: field -> "default" | "file:PATH" | "env:VAR" | "flag"
    sources: dict[str, str] = {}

    @field_validator("engine_env_passthrough")
    @classmethod
    def _env_names(cls, v: list[str]) -> list[str]:
        bad = [n for n in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\*?", n)]
        if bad:
            raise ValueError("not an environment variable name, or a prefix of one ending in '*' "
                             f"(a bare '*' would pass the whole environment): {', '.join(map(repr, bad))}")
        return v

    @field_validator("image_cache_bytes")
    @classmethod
    def _budget(cls, v: Any) -> Any:
        parse_budget(v)
        return v

    def image_cache_budget(self) -> int:
        """``image_cache_bytes`` in bytes: a fraction is of the size of the filesystem holding
        ``<home>/cache`` (its nearest existing parent), rounded down."""
        v = parse_budget(self.image_cache_bytes)
        if isinstance(v, int):
            return v
        p = self.cache_dir
        while not p.exists() and p != p.parent:
            p = p.parent
        st = os.statvfs(p)
        return int(v * st.f_blocks * st.f_frsize)

    @property
    def store_dir(self) -> Path:
        return self.store or self.home / "store"

    @property
    def run_dir(self) -> Path:
        """Per-engine runtime state: ``run/NAME/`` (state.json, logs, materialized image)."""
        return self.home / "run"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    @property
    def catalog_url(self) -> str:
        """Where the catalog is read and published: ``catalog``, else ``remote_store``, else
        the local store directory."""
        return self.catalog or self.remote_store or str(self.store_dir)

    def effective(self) -> list[tuple[str, Any, str]]:
        """``(field, value, source)`` for every setting, in declaration order, with the derived
        defaults filled in (``store`` -> ``home/store``, ``catalog`` -> its fallback); values are
        JSON-friendly (paths as strings)."""
        rows: list[tuple[str, Any, str]] = []
        for f in Settings.model_fields:
            if f == "sources":
                continue
            v = getattr(self, f)
            src = self.sources.get(f, "default")
            if f == "store" and v is None:
                v, src = self.store_dir, "default (home/store)"
            elif f == "catalog" and v is None:
                v = self.catalog_url
                src = "default (remote_store)" if self.remote_store else "default (local store)"
            if isinstance(v, Path):
                v = str(v)
            elif isinstance(v, list):
                v = [str(x) for x in v]
            rows.append((f, v, src))
        return rows


def _from_env(field: str, raw: str) -> Any:
    if field == "profile_dirs":
        return [p for p in raw.split(os.pathsep) if p]
    if field == "oci_insecure":
        return [h.strip() for h in raw.split(",") if h.strip()]
    return raw


def load_settings(config_file: Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Merge defaults, the config file, environment and ``overrides`` (flags; ``None`` values
    are ignored, so unset CLI options can be passed straight through).

    Raises :class:`ConfigError` naming the source (file path, environment variable or flag) and
    field when the file is not valid TOML, a key is unknown, or a value has the wrong type. A
    missing default config file is not an error; a missing file given explicitly (argument or
    ``$WARMCTL_CONFIG``) is.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    explicit = config_file or os.environ.get(CONFIG_ENV)
    path = Path(explicit) if explicit else DEFAULT_CONFIG_FILE
    values["config_file"] = str(path)
    sources["config_file"] = "flag" if config_file else f"env:{CONFIG_ENV}" if explicit else "default"
    if path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
        base = path.absolute().parent
        if "config_file" in data:
            raise ConfigError(f"{path}: config_file: not a key of the config file (it is the file: "
                              f"--config or ${CONFIG_ENV} names it)")
        for k, v in data.items():
            if isinstance(v, str) and k in PATH_FIELDS and not Path(v).is_absolute():
                v = str(base / v)
            elif k == "profile_dirs" and isinstance(v, list):
                v = [str(base / p) if isinstance(p, str) and not Path(p).is_absolute() else p for p in v]
            values[k] = v
            sources[k] = f"file:{path}"
    elif explicit:
        raise ConfigError(f"{path}: config file not found")
    for field, var in ENV_VARS.items():
        if os.environ.get(var):
            values[field] = _from_env(field, os.environ[var])
            sources[field] = f"env:{var}"
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k] = v
            sources[k] = "flag"
    sources.pop("sources", None)
    values.pop("sources", None)
    try:
        s = Settings.model_validate(values)
    except ValidationError as e:
        msgs = []
        for x in e.errors():
            field = str(x["loc"][0]) if x["loc"] else ""
            src = sources.get(field, f"file:{path}")
            where = {"file": src[5:], "env": f"${src[4:]}", "flag": "command-line flag"}.get(src.split(":")[0], src)
            msgs.append(f"{where}: {'.'.join(map(str, x['loc']))}: {x['msg']}")
        raise ConfigError("\n".join(msgs)) from None
    for f in (*PATH_FIELDS, "config_file"):
        v = getattr(s, f)
        if v is not None:
            setattr(s, f, v.absolute())
    s.profile_dirs = [p.absolute() for p in s.profile_dirs]
    for f in Settings.model_fields:
        sources.setdefault(f, "default")
    sources.pop("sources", None)
    s.sources = sources
    return s
