"""Profiles: what engine to start, how to warm it and how to prove a restore is faithful.

A profile is a TOML file (``NAME.toml``) validated by :class:`Profile`. Errors are raised as
:class:`ProfileError`, whose message names the file, the field (dotted path) and what was
expected, e.g. ``profiles/tiny.toml: warmup.prompt_tokens.0: Input should be greater than 0``;
a misspelled key also gets the closest real one (``warmup.concurency: Extra inputs are not
permitted; did you mean 'concurrency'?``).

A NAME is looked up in :func:`search_dirs` order: the configured ``profile_dirs``
(``$WARMCTL_PROFILE_DIRS``, the config file), then :data:`SYSTEM_PROFILES_DIR`
(``/etc/warmctl/profiles``, a host install's own), then :data:`PROFILES_DIR`, the profiles
shipped inside the package (the repository's top-level ``profiles/``; ``warmctl/profiles`` links
to it, so the wheel carries them as package data). The first file found wins.
"""

# No `from __future__ import annotations` here: pydantic would then evaluate each field's
# annotation from its string when the class is made (compiling it), about 4 ms of every
# `warmctl up` over the model modules it imports (docs/benchmarks.md).

import difflib
import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, field_validator,
                      model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from warmctl.base.errors import WarmctlError
from warmctl.base.names import NAME_PATTERN

#: The profiles shipped with warmctl: package data (``warmctl/profiles``, in the repository a
#: link to the top-level ``profiles/``), so an installed wheel has them too.
PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"

#: A host install's own profiles, searched after the configured ``profile_dirs`` and before
#: the shipped ones.
SYSTEM_PROFILES_DIR = Path("/etc/warmctl/profiles")


#: The validation error type of a credential in a profile: its message names each field itself,
#: and the input (which holds the secret) is never shown.
CREDENTIAL_ERROR = "credential"
#: The validation error type of a profile the CPU build of vLLM cannot run (expert parallel):
#: its message is the whole sentence, naming the field, as a credential's is.
CPU_BUILD_ERROR = "cpu_build"


class ProfileError(WarmctlError):
    """A profile file is missing, is not TOML, or does not validate."""


class CredentialInProfile(ProfileError):
    """A profile carries a credential (by name or inside a value,
    :func:`warmctl.records.credentials.profile_problems`): refused by every command that finds it,
    ``up`` included (which otherwise treats an unusable profile as none)."""


class _Strict(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)


class EngineSpec(_Strict):
    """How to launch the engine.

    ``model`` is a path, or ``builtin:tiny`` for the small Llama that warmctl builds itself
    (``builtin:tiny-moe``: the same as a mixture of experts)
    (see :mod:`warmctl.models.tinymodel`). ``args`` are extra ``vllm serve`` flags, passed as given.
    ``port`` is the engine's internal port on loopback; clients never see it. Neither ``args``
    nor ``env`` may carry a credential (a profile is published with every snapshot): a flag
    such as ``--api-key`` or a variable whose name says token, key, secret, password or
    credential, and any value with a credential's shape (a URL's ``user:password@``, a bearer
    token, a PEM private key, a cloud, hub or registry token) is refused, naming the field,
    the rule and where it belongs instead (:func:`warmctl.records.credentials.profile_problems`).
    """

    kind: Literal["vllm"] = "vllm"
    model: str
    served_model_name: str
    args: list[str] = []
    env: dict[str, str] = {}
    port: int = Field(18000, ge=1, le=65535)
    startup_timeout_s: float = Field(900.0, gt=0, description="seconds to wait for /health")
    max_model_len: int | None = Field(None, gt=0, description="tokens")

    @model_validator(mode="after")
    def _no_credentials(self) -> "EngineSpec":
        from warmctl.records.credentials import profile_problems

        problems = profile_problems(self.args, self.env)
        if problems:  # a custom type: the error never shows the input (it holds the secret)
            raise PydanticCustomError(CREDENTIAL_ERROR, "{detail}",
                                      {"detail": "\n".join(f"{f}: {m}" for f, m in problems)})
        return self

    @field_validator("args")
    @classmethod
    def _parallel_sizes_ok(cls, v: list[str]) -> list[str]:
        from warmctl.base.parallel import sizes_of  # the ranks' layout (TP, PP, DP, EP) must parse

        sizes_of(v)
        return v


class GateSpec(_Strict):
    """The public port, opened only after the canary passed."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)


class WarmupSpec(_Strict):
    """The warm-up grid: every (prompt tokens x output tokens x concurrency) cell is run once.

    Seed 000 (section 04): a long prefill belongs in the grid, or the first long request after
    a restore pays the JIT compile itself.
    """

    prompt_tokens: list[int] = Field([16, 128], min_length=1)
    output_tokens: list[int] = Field([1, 8], min_length=1)
    concurrency: list[int] = Field([1, 2], min_length=1)

    @field_validator("prompt_tokens", "output_tokens", "concurrency")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(x <= 0 for x in v):
            raise ValueError("every value must be a positive integer")
        return v

    def cells(self) -> list[tuple[int, int, int]]:
        """All grid cells as (prompt_tokens, output_tokens, concurrency)."""
        return [(p, o, c) for p in self.prompt_tokens for o in self.output_tokens for c in self.concurrency]


class CanarySpec(_Strict):
    """Canary policy: greedy completions recorded at snapshot time, replayed after restore.

    ``match = "tokens+logprobs"`` compares token ids and the float logprobs bit for bit;
    ``"tokens"`` compares token ids only (for engines whose logprobs are not reproducible).
    """

    prompts: list[str] = Field(min_length=1)
    max_tokens: int = Field(16, gt=0, description="tokens per prompt")
    logprobs: int = Field(5, ge=0, le=20, description="top-k logprobs recorded per position")
    match: Literal["tokens+logprobs", "tokens"] = "tokens+logprobs"


#: GPU makers a profile can name in ``hardware.vendor``.
GpuVendor = Literal["nvidia", "amd"]


class HardwareSpec(_Strict):
    """What the host must have. ``gpu_count = 0`` means a CPU engine.

    ``vendor``: who makes the GPUs, ``"nvidia"`` (the default; CUDA, NVML) or ``"amd"``
    (ROCm: the kernel's KFD driver, CRIU's amdgpu plugin, see docs/gpu.md "AMD Instinct").
    ``gpu_model``: the model as the host reports it (NVML's name, e.g. ``NVIDIA B200``; for AMD
    amdsmi's market name, e.g. ``AMD Instinct MI355X``). ``min_driver``: the vendor's kernel
    driver (NVIDIA: ``580``; AMD: the amdgpu module version). ``min_gpu_memory_gib``: GiB per
    GPU. A default ``vendor`` is left out of the profile's JSON, so profiles written before the
    field existed keep their digest.
    """

    vendor: GpuVendor = "nvidia"
    gpu_model: str | None = None
    gpu_count: int = Field(0, ge=0)
    min_driver: str | None = None
    min_gpu_memory_gib: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> "HardwareSpec":
        if self.gpu_count and not self.gpu_model:
            raise ValueError("gpu_model is required when gpu_count > 0")
        if self.vendor != "nvidia" and not self.gpu_count:
            raise ValueError(f"vendor = {self.vendor!r} names a GPU maker, but gpu_count is 0 (a CPU engine)")
        return self

    @model_serializer(mode="wrap")
    def _default_vendor_unwritten(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("vendor") == "nvidia":
            del data["vendor"]
        return data


class CheckpointSpec(_Strict):
    """How the engine is frozen.

    ``cuda``: checkpoint GPU state with the CUDA driver's checkpoint API before CRIU.
    ``sleep_level``: vLLM sleep mode before checkpointing (1 = weights offloaded, KV cache
    dropped; 2 = both dropped); 0 = keep everything in the image.
    ``weights_outside_image``: store each rank's weights, as the engine laid them out, as
    separate ``weights`` files (deduplicated across snapshots of one model) and copy them back
    in place after restore (seed 000: 546 GiB in 18 s). With sleep mode this needs level 2
    (level 1 would keep a host copy of the weights in the image); without sleep mode (CPU)
    warmctl frees the weights itself (:mod:`warmctl.engine.worker_ext`).
    """

    cuda: bool = False
    sleep_level: Literal[0, 1, 2] = 0
    weights_outside_image: bool = False
    lock_timeout_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _weights_need_level_2(self) -> "CheckpointSpec":
        if self.weights_outside_image and self.sleep_level == 1:
            raise ValueError("weights_outside_image needs sleep_level = 2 or 0: level 1 offloads the "
                             "weights to host RAM, which would put them into the process image anyway")
        return self


class Profile(_Strict):
    """A validated profile. ``source`` is the file it came from (not part of the digest).

    Beyond each field's own rules: a CPU profile (``hardware.gpu_count = 0``) with expert
    parallel (``--enable-expert-parallel`` in ``engine.args``) is refused, naming the flag, the
    crash of the CPU build's ranks and the alternative (tensor parallel without it;
    :func:`warmctl.base.parallel.cpu_build_problems`), so no command starts such an engine.
    """

    name: str = Field(pattern=NAME_PATTERN)  # the one name rule (warmctl.base.names)
    description: str = ""
    engine: EngineSpec
    gate: GateSpec = GateSpec()
    warmup: WarmupSpec = WarmupSpec()
    canary: CanarySpec
    hardware: HardwareSpec = HardwareSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()

    @model_validator(mode="after")
    def _cpu_build_runs_it(self) -> "Profile":
        from warmctl.base.parallel import cpu_build_problems

        problems = cpu_build_problems(list(self.engine.args), self.hardware.gpu_count)
        if problems:
            raise PydanticCustomError(CPU_BUILD_ERROR, "{detail}", {"detail": "\n".join(problems)})
        return self

    @model_validator(mode="after")
    def _checkpoint_fits_vendor(self) -> "Profile":
        if self.checkpoint.cuda and self.hardware.vendor != "nvidia":
            raise ValueError(f"checkpoint.cuda = true needs NVIDIA GPUs, but hardware.vendor = {self.hardware.vendor!r}: "
                             "AMD GPU state is saved by CRIU's amdgpu plugin, with no separate GPU step (docs/gpu.md)")
        return self

    def digest(self) -> str:
        """``sha256:<hex>`` of the canonical JSON of the profile's content.

        Two files that validate to the same profile have the same digest; comments and key
        order do not matter.
        """
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def _fields_at(loc: tuple) -> list[str]:
    """The field names of the model that holds the key at ``loc`` (a dotted location of a
    validation error), or [] when that place is not a model (a list, a free-form table)."""
    model: type[BaseModel] = Profile
    for part in loc[:-1]:
        f = model.model_fields.get(str(part))
        ann = f.annotation if f else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _format_validation(path: Path, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        if e["type"] in (CREDENTIAL_ERROR, CPU_BUILD_ERROR):
            lines += [f"{path}: {ln}" for ln in e["msg"].splitlines()]
            continue
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = e.get("input")
        got_s = "" if isinstance(got, dict) else f" (got {got!r})"
        hint = ""
        if e["type"] == "extra_forbidden" and e["loc"]:
            close = difflib.get_close_matches(str(e["loc"][-1]), _fields_at(e["loc"]), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
        lines.append(f"{path}: {loc}: {e['msg']}{hint}{got_s}")
    return "\n".join(lines)


def load_profile_file(path: Path) -> Profile:
    """Read and validate one profile file.

    Raises :class:`ProfileError` if the file is missing, is not valid TOML (with line and
    column), or fails validation (one line per bad field: file, dotted field path, message);
    :class:`CredentialInProfile` (a ProfileError) when a field carries a credential.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile file") from None
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: not valid TOML: {e}") from None
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        cls = CredentialInProfile if any(x["type"] == CREDENTIAL_ERROR for x in e.errors()) else ProfileError
        raise cls(_format_validation(path, e)) from None


def search_dirs(search: list[Path] | None = None) -> list[Path]:
    """Where a profile NAME is looked up, in order: ``search`` (the configured
    ``profile_dirs``), :data:`SYSTEM_PROFILES_DIR`, :data:`PROFILES_DIR` (duplicates dropped)."""
    out: list[Path] = []
    for d in [*(search or []), SYSTEM_PROFILES_DIR, PROFILES_DIR]:
        if Path(d) not in out:
            out.append(Path(d))
    return out


def list_profiles(search: list[Path] | None = None) -> list[tuple[str, Path, list[Path]]]:
    """Every profile NAME findable in :func:`search_dirs`, sorted by name: ``(name, the file a
    lookup of NAME finds, the files of the same name it hides)``. Files are not validated."""
    found: dict[str, list[Path]] = {}
    for d in search_dirs(search):
        for f in sorted(d.glob("*.toml")) if d.is_dir() else []:
            found.setdefault(f.stem, []).append(f)
    return [(n, fs[0], fs[1:]) for n, fs in sorted(found.items())]


def find_profile(name_or_path: str, search: list[Path] | None = None) -> Path:
    """Resolve a profile argument: an existing file path, or a NAME looked up as
    ``NAME.toml`` in :func:`search_dirs` (``search``: the configured profile dirs).

    Raises :class:`ProfileError` naming every place looked in.
    """
    p = Path(name_or_path)
    if p.suffix == ".toml" or "/" in name_or_path:
        if p.is_file():
            return p
        raise ProfileError(f"{p}: no such profile file")
    dirs = search_dirs(search)
    for d in dirs:
        cand = Path(d) / f"{name_or_path}.toml"
        if cand.is_file():
            return cand
    raise ProfileError(
        f"no profile named {name_or_path!r}; looked in: " + ", ".join(str(d) for d in dirs)
    )


def load_profile(name_or_path: str, search: list[Path] | None = None) -> Profile:
    """:func:`find_profile` then :func:`load_profile_file`."""
    return load_profile_file(find_profile(name_or_path, search))


def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    if isinstance(d, dict):
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
        return out or {prefix.rstrip("."): {}}
    return {prefix: d}


def diff_profiles(old: dict | Profile, new: dict | Profile) -> list[tuple[str, object, object]]:
    """The fields that differ between two profiles (or their ``model_dump(mode="json")``, as a
    manifest embeds it): ``(dotted field, old value, new value)``, sorted by field; a field
    one side lacks has the value None there. Lists compare whole (``engine.args`` is one field).
    Both sides are validated first when they validate, so defaults left out of a file do not
    count as changes."""
    def norm(p: dict | Profile) -> dict:
        if isinstance(p, Profile):
            return p.model_dump(mode="json")
        try:
            return Profile.model_validate(p).model_dump(mode="json")
        except ValidationError:
            return dict(p)

    a, b = _flatten(norm(old)), _flatten(norm(new))
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def describe_diff(changes: list[tuple[str, object, object]], limit: int = 6) -> str:
    """One line naming the changed fields with old -> new values, e.g.
    ``warmup.concurrency: [1, 2] -> [1, 4]; engine.max_model_len: 512 -> 1024``; values longer
    than 60 characters are cut, and past ``limit`` fields the rest is counted."""
    def short(v: object) -> str:
        s = json.dumps(v)
        return s if len(s) <= 60 else s[:57] + "..."

    parts = [f"{k}: {short(a)} -> {short(b)}" for k, a, b in changes[:limit]]
    if len(changes) > limit:
        parts.append(f"(+{len(changes) - limit} more)")
    return "; ".join(parts)
