"""The snapshot manifest: the one document that names everything a restore needs.

A manifest is stored as canonical JSON (sorted keys, no whitespace, UTF-8) and addressed by
the digest of those bytes (``sha256:<64 hex>``). It lists every file of the snapshot as a
sequence of chunks (each addressed by its own digest), plus what the restore checks: the
profile digest, the host fingerprint, the canary record and the phase timings of the cold
start. The store format is specified in ``docs/store-format.md``.
"""

# No `from __future__ import annotations` here: pydantic would then evaluate each field's
# annotation from its string when the class is made (compiling it), about 4 ms of every
# `warmctl up` over the model modules it imports (docs/benchmarks.md).

import hashlib
import json
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

#: Version of the manifest schema; readers refuse versions they do not know.
MANIFEST_FORMAT = 1


def sha256_digest(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_relative_path(path: str) -> str:
    """``path`` if it is a relative POSIX path that stays below the directory it is joined to:
    not empty, no NUL, no leading ``/``, no empty, ``.`` or ``..`` component. Raises ValueError
    naming what is wrong. Every manifest path is checked with it when a manifest is parsed,
    whatever its signature says (a signature vouches for the publisher, not for its mistakes)."""
    if not path:
        raise ValueError("empty path")
    if "\0" in path:
        raise ValueError(f"path {path!r} contains a NUL byte")
    if path.startswith("/"):
        raise ValueError(f"path {path!r} is absolute; manifest paths are relative to where their role puts them")
    bad = [c for c in path.split("/") if c in ("", ".", "..")]
    if bad:
        raise ValueError(f"path {path!r} has a {bad[0] or 'empty'!r} component; manifest paths may not leave their directory")
    return path


def check_absolute_path(path: str) -> str:
    """``path`` if it is an absolute POSIX path with no NUL and no ``.``/``..`` component.
    Raises ValueError naming what is wrong."""
    if "\0" in path:
        raise ValueError(f"path {path!r} contains a NUL byte")
    if not path.startswith("/"):
        raise ValueError(f"path {path!r} is not absolute")
    if any(c in (".", "..") for c in path.split("/")):
        raise ValueError(f"path {path!r} has a '.' or '..' component")
    return path


class _M(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid")


class ChunkRef(_M):
    """One chunk of a file: ``digest`` of the uncompressed bytes, ``size`` in bytes."""

    digest: str
    size: int = Field(ge=0)


class FileEntry(_M):
    """A file of the snapshot, relative to the snapshot root (POSIX path, no ``..``).

    ``role`` says where it goes at restore: ``image`` (CRIU image directory), ``shm``
    (``/dev/shm``), ``file`` (an absolute path the process tree needs: ``path`` is then the
    absolute path with the leading slash removed), ``weights`` (``weights/rank-<r>.safetensors``:
    a rank's weights as the engine laid them out, kept outside the process image and loaded
    back in place after restore, :mod:`warmctl.engine.worker_ext`). ``hardlink_to``: this entry is a hard link to another entry's path (same
    role), with no chunks of its own (CRIU's ``link_remap`` files need this).
    """

    path: str
    role: Literal["image", "shm", "file", "weights"] = "image"
    size: int = Field(ge=0, description="bytes")
    mode: int = 0o644
    chunks: list[ChunkRef] = []
    hardlink_to: str | None = None

    @field_validator("path")
    @classmethod
    def _path_ok(cls, v: str) -> str:
        return check_relative_path(v)

    @field_validator("hardlink_to")
    @classmethod
    def _link_ok(cls, v: str | None) -> str | None:
        return None if v is None else check_relative_path(v)


class CanaryCompletion(_M):
    """The greedy completion of one canary prompt, as the engine produced it."""

    prompt: str
    token_ids: list[int]
    #: Logprob of each chosen token (float64 as JSON number; ``repr`` round-trips exactly).
    logprobs: list[float]
    #: Top-k alternatives per position: list of {token_id: logprob}.
    top_logprobs: list[dict[str, float]] = []
    text: str = ""


class CanaryRecord(_M):
    """What ``up`` compares bit for bit before opening the port."""

    match: Literal["tokens+logprobs", "tokens"]
    max_tokens: int
    logprobs: int
    completions: list[CanaryCompletion]


class Phase(_M):
    """One timed phase: name and seconds (wall clock)."""

    name: str
    seconds: float


class _Recorded(_M):
    """A record whose JSON holds exactly the keys it was given: a key left unset is omitted
    (not written as its default or ``null``), so a manifest read back serializes to the same
    bytes, hence the same digest, as the one a writer stored (older writers omitted keys)."""

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if k in self.model_fields_set}


class GpuRestore(_Recorded):
    """``restore.gpu`` (profiles with ``checkpoint.cuda``): what the CUDA restore of the ranks
    needs. ``nspids``: each GPU rank's PID inside the engine's PID namespace (the ranks are found
    again by it after a CRIU restore); ``gpu_bytes``: ``{snapshot GPU UUID: bytes}`` the ranks
    held (checked against free memory before any restore); ``ranks``: the checkpoint report of
    :class:`warmctl.checkpoint.ranks.RankReport` (``to_dict()``; informational)."""

    nspids: list[int]
    gpu_bytes: dict[str, int] = {}
    ranks: dict[str, Any] = {}


class RankWeights(_Recorded):
    """One rank's weights file: ``rank`` number, ``file`` (the manifest path of its ``weights``
    entry, ``weights/rank-<r>.safetensors``) and its size in ``bytes``."""

    rank: int
    file: str
    bytes: int = Field(ge=0)

    @field_validator("file")
    @classmethod
    def _file_ok(cls, v: str) -> str:
        return check_relative_path(v)


class WeightsRestore(_Recorded):
    """``restore.weights`` (profiles with ``checkpoint.weights_outside_image``): the weights kept
    outside the image: ``bytes`` and ``tensors`` over all ranks, ``save_s`` (seconds the slowest
    rank took to write them) and one :class:`RankWeights` per rank."""

    bytes: int = Field(ge=0)
    tensors: int = Field(ge=0)
    save_s: float = 0.0
    ranks: list[RankWeights] = []


class RankRecord(_Recorded):
    """One rank of the engine (:mod:`warmctl.checkpoint.layout`): ``rank`` (vLLM's order: DP,
    PP, TP), ``role`` (its process title without ``VLLM::``: ``Worker_TP0``, or ``EngineCore``
    for a one-rank engine), ``nspid`` (its PID inside the engine's PID namespace, which CRIU
    restores), ``cpus`` (CPU list, kernel syntax, of its bound threads; absent when none was
    bound) and ``gpu`` (UUID of the GPU it held; GPU hosts only)."""

    rank: int = Field(ge=0)
    role: str
    nspid: int = Field(ge=1)
    cpus: str = ""
    gpu: str | None = None

    @field_validator("cpus")
    @classmethod
    def _cpus_ok(cls, v: str) -> str:
        from warmctl.base.parallel import parse_cpu_list

        if v:
            parse_cpu_list(v)
        return v


class ParallelLayout(_Recorded):
    """``restore.layout``: how the engine was split and where each rank ran. ``tp``, ``pp``,
    ``dp``: the parallel sizes; ``ep``: ranks the experts are split over (1: no expert
    parallel); ``world_size``: TP x PP x DP; ``ranks``: one :class:`RankRecord` each, in rank
    order; ``cpu_bind``: the ``VLLM_CPU_OMP_THREADS_BIND`` the engine ran with and
    ``cpu_bind_source`` (``profile`` or ``default``: warmctl's split of the CPUs it could use);
    ``network_lock``: CRIU's network-lock method of the dump (``nftables``/``iptables``);
    ``listen``: ``"address:port"`` of every TCP socket the tree listened on (restored bound to
    the same port: checked free before a restore). Absent from manifests written before
    warmctl recorded it."""

    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    world_size: int = Field(ge=1)
    ranks: list[RankRecord] = []
    cpu_bind: str | None = None
    cpu_bind_source: Literal["profile", "default"] | None = None
    network_lock: str | None = None
    listen: list[str] = []

    def sizes(self) -> str:
        """``"TP2"``, ``"TP2 x PP2"``, ``"TP2, EP2"``; ``"TP1"`` for one rank."""
        from warmctl.base.parallel import describe_sizes

        return describe_sizes(self.tp, self.pp, self.dp, self.ep)

    def describe(self) -> str:
        """``"TP2 (Worker_TP0 ns-pid 12 CPU 0, Worker_TP1 ns-pid 13 CPU 1)"``-style one line."""
        head = self.sizes()
        ranks = ", ".join(f"{r.role} ns-pid {r.nspid}" + (f" CPU {r.cpus}" if r.cpus else "")
                          + (f" GPU {r.gpu}" if r.gpu else "") for r in self.ranks)
        return f"{head} ({ranks})" if ranks else head


class RestoreInfo(_Recorded):
    """``restore``: facts a restore needs that the images do not hold.

    ``log_path`` and ``cwd``: absolute paths of the engine's log and working directory on the
    snapshot host (CRIU reopens them at the same paths); ``internal_port``: the engine's
    loopback TCP port; ``required_files``: ``{absolute path: size in bytes}`` of files the tree
    maps from the interpreter and system directories (checked before anything is written,
    :func:`warmctl.checkpoint.capture.missing_or_changed`); ``required_digests``:
    ``{absolute path: "<algorithm>:<hex>"}``, the content digest of each of those files
    (:mod:`warmctl.checkpoint.filedigest`; absent in manifests written before it, whose files
    are then checked by size only); ``images_bytes``: size of the CRIU
    image files; ``cpu_affinity``: ``{CPU list: [thread IDs in the engine's PID namespace]}``
    of the threads bound to fewer CPUs than the snapshotting warmctl could use (CRIU does not
    restore affinity; ``up`` puts it back, :mod:`warmctl.checkpoint.affinity`; absent when no
    thread was bound); ``tmp_dir``: the engine's scratch directory on the snapshot host
    (``VLLM_RPC_BASE_PATH``, where its ZMQ IPC sockets are bound; CRIU binds them again there, so a
    restore creates it; absent in manifests written before engines had one, whose sockets are in
    the temp directory); ``gpu`` / ``weights``: present only for those checkpoint flavours;
    ``engine_env``: the engine's environment at the cold start by name only, ``{variable:
    source}`` with source ``base``, ``passthrough``, ``warmctl`` or ``profile``
    (:class:`warmctl.engine.vllm.EngineEnv`; never a value: the profile's own values are in
    ``profile``); ``layout``: the parallel layout and every rank (:class:`ParallelLayout`).
    Every key is optional in the format (a manifest written without one reads with its
    default).
    """

    log_path: str | None = None
    cwd: str | None = None
    tmp_dir: str | None = None
    internal_port: int | None = None
    required_files: dict[str, int] = {}
    required_digests: dict[str, str] = {}
    images_bytes: int = Field(0, ge=0)
    cpu_affinity: dict[str, list[int]] = {}
    gpu: GpuRestore | None = None
    weights: WeightsRestore | None = None
    engine_env: dict[str, Literal["base", "passthrough", "warmctl", "profile"]] = {}
    layout: ParallelLayout | None = None

    @field_validator("log_path", "cwd", "tmp_dir")
    @classmethod
    def _abs_ok(cls, v: str | None) -> str | None:
        return None if v is None else check_absolute_path(v)

    @model_validator(mode="after")
    def _tmp_dir_ok(self) -> "RestoreInfo":
        # up creates this directory (0700) and removes sockets from it: only the two shapes
        # warmctl.engine.run.socket_dir makes, never any path a manifest names
        t = self.tmp_dir
        if t is not None:
            name, parent = t.rstrip("/").rsplit("/", 1)[1], t.rstrip("/").rsplit("/", 1)[0]
            if not ((name == "tmp" and self.cwd is not None and parent == self.cwd.rstrip("/"))
                    or (len(name) == 24 and name.startswith("warmctl-")
                        and all(c in "0123456789abcdef" for c in name[8:]))):
                raise ValueError(f"tmp_dir {t!r} is neither <cwd>/tmp nor a warmctl-<16 hex> directory")
        return self

    @field_validator("cpu_affinity")
    @classmethod
    def _affinity_ok(cls, v: dict[str, list[int]]) -> dict[str, list[int]]:
        from warmctl.base.parallel import parse_cpu_list

        for cpus in v:
            parse_cpu_list(cpus)
        return v

    @field_validator("required_files")
    @classmethod
    def _required_ok(cls, v: dict[str, int]) -> dict[str, int]:
        for p in v:
            check_absolute_path(p)
        return v


def _problems(e: ValidationError) -> str:
    """A ValidationError as one line per problem: ``where: what`` (at most 5)."""
    errs = e.errors()
    out = []
    for err in errs[:5]:
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        out.append(f"{'.'.join(str(x) for x in err.get('loc', ()))}: {msg}")
    more = f" (+{len(errs) - 5} more)" if len(errs) > 5 else ""
    return "; ".join(out) + more


class Manifest(_M):
    """A snapshot manifest (see module docstring). Sizes are bytes, times are seconds."""

    format: int = MANIFEST_FORMAT
    kind: Literal["snapshot"] = "snapshot"
    name: str
    created: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    profile_digest: str
    #: The profile itself (validated JSON), so a restore host needs no profile file.
    profile: dict[str, Any]
    #: Host fingerprint at snapshot time (see :mod:`warmctl.host`).
    host: dict[str, Any]
    canary: CanaryRecord
    #: Cold-start phases parsed from the engine's log (weights, torch.compile, ...) and
    #: snapshot phases (warm-up, canary, dump, store).
    phases: list[Phase] = []
    #: Facts the restore needs beyond the images (paths, port, required files, GPU, weights).
    restore: RestoreInfo = Field(default_factory=RestoreInfo)
    files: list[FileEntry]

    def to_bytes(self) -> bytes:
        """Canonical JSON bytes; their sha256 is the manifest's digest."""
        data = self.model_dump(mode="json")
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> str:
        """``sha256:<hex>`` of :meth:`to_bytes`."""
        return sha256_digest(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        """Parse and validate manifest bytes, every path included (:func:`check_relative_path`,
        :func:`check_absolute_path`). Raises ValueError naming each problem and where it is
        (e.g. ``files.3.path: path '../x' has a '..' component``) for an unknown ``format``,
        bad JSON, a missing field or a bad path."""
        try:
            obj = json.loads(data)
        except RecursionError:
            raise ValueError("the manifest's JSON is nested too deeply") from None
        if not isinstance(obj, dict):
            raise ValueError("a manifest is a JSON object")
        if obj.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"unsupported manifest format {obj.get('format')!r} (this warmctl reads {MANIFEST_FORMAT})")
        try:
            return cls.model_validate(obj)
        except ValidationError as e:
            raise ValueError(_problems(e)) from None

    def total_size(self) -> int:
        """Sum of file sizes in bytes (hard links counted once)."""
        return sum(f.size for f in self.files if f.hardlink_to is None)

    def chunk_digests(self) -> set[str]:
        """Every chunk digest this manifest references (what gc must keep)."""
        return {c.digest for f in self.files for c in f.chunks}
