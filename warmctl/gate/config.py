"""What a gate enforces: :class:`GateConfig` (keys, TLS, routes, drain, client limits).

``up`` builds one from the settings (:meth:`GateConfig.from_settings`) and checks it
(:meth:`GateConfig.check`: files readable and private, paths well formed) before it restores;
:mod:`warmctl.gate.process` hands it to the gate process as command-line options
(:meth:`GateConfig.to_argv`), and the gate (:mod:`warmctl.gate.__main__`) parses them back
into the same type (:meth:`GateConfig.add_arguments`, :meth:`GateConfig.from_args`). Both
directions live here, so they cannot drift apart. Only file paths cross the command line:
a key never does. Light to import (no asyncio, no pydantic): ``up`` and the gate load it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from warmctl.gate.routes import DEFAULT_PUBLIC_PATHS

if TYPE_CHECKING:  # the gate's process parses its arguments; `up` only writes them
    import argparse


@dataclass(frozen=True)
class Limits:
    """How long a client may take (seconds; ``body_min_rate``: bytes/s). A body of n bytes
    may take ``body_timeout_s + n / body_min_rate`` seconds from the end of its head."""

    head_timeout_s: float = 20.0
    body_timeout_s: float = 20.0
    body_min_rate: float = 1024.0
    keep_alive_s: float = 75.0


@dataclass(frozen=True)
class GateConfig:
    """A gate's policy and limits.

    ``api_key_file``: API keys, one per line (None: no key needed); ``tls_cert``/``tls_key``:
    PEM files, both or neither; ``allow_paths``: served beside the default allow list
    (:data:`warmctl.gate.routes.DEFAULT_ALLOW_PATHS`); ``public_paths``: answered without a
    key (None: :data:`DEFAULT_PUBLIC_PATHS`, empty: every path needs one); ``deny_paths``:
    refused (403); ``drain_s``: seconds open connections get after SIGTERM; ``limits``:
    :class:`Limits` (a dict of its fields is taken too). Sequences are kept as tuples."""

    api_key_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    allow_paths: tuple[str, ...] = ()
    public_paths: tuple[str, ...] | None = None
    deny_paths: tuple[str, ...] = ()
    drain_s: float = 30.0
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        for name in ("api_key_file", "tls_cert", "tls_key"):
            if getattr(self, name) is not None:
                set_(self, name, Path(getattr(self, name)))
        for name in ("allow_paths", "deny_paths"):
            set_(self, name, tuple(getattr(self, name) or ()))
        if self.public_paths is not None:
            set_(self, "public_paths", tuple(self.public_paths))
        if isinstance(self.limits, dict):
            set_(self, "limits", Limits(**self.limits))
        set_(self, "drain_s", float(self.drain_s))

    @classmethod
    def from_settings(cls, settings) -> "GateConfig":
        """The gate of a :class:`warmctl.records.config.Settings` (its ``gate_*`` fields); unchecked."""
        return cls(api_key_file=settings.gate_api_key_file, tls_cert=settings.gate_tls_cert,
                   tls_key=settings.gate_tls_key, allow_paths=tuple(settings.gate_allow_paths),
                   public_paths=tuple(settings.gate_public_paths), deny_paths=tuple(settings.gate_deny_paths),
                   drain_s=settings.gate_drain_s)

    @property
    def public(self) -> tuple[str, ...]:
        """The paths answered without a key (``public_paths``, or the default)."""
        return DEFAULT_PUBLIC_PATHS if self.public_paths is None else self.public_paths

    @property
    def enforces(self) -> dict[str, bool]:
        """What this gate enforces, as :class:`warmctl.records.state.EngineState` fields:
        ``gate_api_key``, ``gate_tls``."""
        return {"gate_api_key": self.api_key_file is not None, "gate_tls": self.tls_cert is not None}

    def check(self) -> "GateConfig":
        """This config with absolute file paths, once its files and paths were checked.

        Raises :class:`warmctl.gate.files.GateConfigError` naming the file if the key file or
        the certificate pair cannot be loaded (or is open to others), or naming the path if an
        allowed, public or denied path is malformed, so ``up`` fails before it restores."""
        from warmctl.gate.files import GateConfigError, read_keys, tls_context
        from warmctl.gate.routes import check_route_path

        for what, paths in (("gate_allow_paths", self.allow_paths), ("gate_public_paths", self.public_paths),
                            ("gate_deny_paths", self.deny_paths)):
            for p in paths or ():
                try:
                    check_route_path(p, what)
                except ValueError as e:
                    raise GateConfigError(str(e)) from None
        if self.api_key_file is not None:
            read_keys(self.api_key_file)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise GateConfigError("TLS needs both a certificate file and a private-key file (gate_tls_cert, gate_tls_key)")
        if self.tls_cert is not None:
            tls_context(self.tls_cert, self.tls_key)  # type: ignore[arg-type]
        return replace(self, **{k: getattr(self, k).absolute() for k in ("api_key_file", "tls_cert", "tls_key")
                                if getattr(self, k) is not None})

    # -- the command line: both directions ----------------------------------------------------

    def to_argv(self) -> list[str]:
        """The gate's command-line options for this config (:meth:`from_args` reads them back
        into an equal config); limits only where they differ from :class:`Limits`' defaults."""
        args: list[str] = []
        if self.api_key_file is not None:
            args += ["--api-key-file", str(self.api_key_file)]
        if self.tls_cert is not None:
            args += ["--tls-cert", str(self.tls_cert)]
        if self.tls_key is not None:
            args += ["--tls-key", str(self.tls_key)]
        for p in self.allow_paths:
            args += ["--allow-path", p]
        if self.public_paths is not None:
            for p in self.public_paths:
                args += ["--public-path", p]
            if not self.public_paths:
                args += ["--no-public-paths"]
        for p in self.deny_paths:
            args += ["--deny-path", p]
        args += ["--drain-s", repr(self.drain_s)]
        default = Limits()
        for f in fields(Limits):
            v = getattr(self.limits, f.name)
            if v != getattr(default, f.name):
                args += [f"--{f.name.replace('_', '-')}", repr(float(v))]
        return args

    @staticmethod
    def add_arguments(ap: argparse.ArgumentParser) -> None:
        """Add the options :meth:`to_argv` writes to ``ap``."""
        ap.add_argument("--api-key-file", type=Path, default=None, help="API keys, one per line (none: no key needed)")
        ap.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain (TLS on the public port)")
        ap.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
        ap.add_argument("--allow-path", action="append", default=[],
                        help="serve this path too, beside the inference API (repeatable; '{name}' matches one segment)")
        ap.add_argument("--public-path", action="append", default=None,
                        help=f"path answered without a key (repeatable; default {' '.join(DEFAULT_PUBLIC_PATHS)})")
        ap.add_argument("--no-public-paths", action="store_true", help="every path needs a key")
        ap.add_argument("--deny-path", action="append", default=[], help="refuse this path too, 403 (repeatable)")
        ap.add_argument("--drain-s", type=float, default=GateConfig.drain_s,
                        help="on SIGTERM: seconds open connections may take to finish (a second SIGTERM: none)")
        d = Limits()
        ap.add_argument("--head-timeout-s", type=float, default=d.head_timeout_s,
                        help="a request head must arrive within")
        ap.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s,
                        help="a request body may take this long plus its size over --body-min-rate")
        ap.add_argument("--body-min-rate", type=float, default=d.body_min_rate,
                        help="bytes/s a request body must average")
        ap.add_argument("--keep-alive-s", type=float, default=d.keep_alive_s, help="an idle connection closes after")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "GateConfig":
        """The config the options of :meth:`add_arguments` parsed into ``a`` describe."""
        public = () if a.no_public_paths else (tuple(a.public_path) if a.public_path is not None else None)
        limits = Limits(**{f.name: getattr(a, f.name) for f in fields(Limits)})
        return cls(api_key_file=a.api_key_file, tls_cert=a.tls_cert, tls_key=a.tls_key,
                   allow_paths=tuple(a.allow_path), public_paths=public, deny_paths=tuple(a.deny_path),
                   drain_s=a.drain_s, limits=limits)
