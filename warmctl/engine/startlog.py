"""What a vLLM engine's start-up log says about where its start-up went
(:func:`startup_breakdown`, :func:`parse_startup_phases`; the display names in
:data:`PHASE_NAMES`): read after a cold start (:mod:`warmctl.engine.cold`, ``warmctl snapshot``,
``warmctl bench startup``), never by a restore, so apart from :mod:`warmctl.engine.vllm`, which
``up`` imports.
"""

from __future__ import annotations

import re

# Two kinds of evidence in vLLM 0.32's log (messages read from its source, e.g.
# ``vllm/v1/engine/core.py``, ``vllm/v1/worker/cpu_model_runner.py``,
# ``vllm/model_executor/warmup/*.py``):
#
# - *milestones*: lines that mark where a stage of the start-up begins. The time from one
#   milestone to the next (whole-second log timestamps) is that stage's duration.
# - *measurements*: lines that state a duration themselves (``Loading weights took 0.03
#   seconds``), or a tqdm bar's elapsed time (``DeepGEMM warmup: 100%|...| 2883/2883
#   [06:37<00:00, ...]``). A measurement is carved out of the milestone stage it was printed in.

#: (phase, what starts it). Only the first match of each counts; stages follow log order.
_MILESTONES: list[tuple[str, re.Pattern[str]]] = [
    # the API server's first log line: arguments parsed; before it, interpreter + vllm imports
    ("model_config", re.compile(r"non-default args:|\bversion \d+\.\d+")),
    # model config resolved (HF config read, platform detected); the engine core starts now
    ("engine_core_start", re.compile(r"Resolved architecture: ")),
    # the engine core process is up; it starts the worker process(es)
    ("worker_start", re.compile(r"Initializing a V1 LLM engine")),
    ("model_load", re.compile(r"Starting to load model ")),
    ("torch_compile", re.compile(r"Warming up model for the compilation|Starting torch\.compile")),
    # CPU: compile done, the worker sizes and allocates the KV cache; GPU: profiling done
    ("kv_cache", re.compile(r"Explicitly set \(.*GiB for KV cache|Available KV cache memory: "
                            r"|(?:CPU|GPU|XPU|TPU) KV cache size: ")),
    # engine core ready; the API server connects, loads the tokenizer/chat template, binds
    ("api_server_start", re.compile(r"init engine \(profile, create kv cache, warmup model\) took")),
    ("serve", re.compile(r"Starting vLLM (?:API )?server on ")),
]
#: A stage ends where the next starts, or at one of these lines, which starts the stage named
#: with it: after the compile, vLLM's profiling run (the memory profile on GPUs).
_STAGE_ENDS: dict[str, tuple[re.Pattern[str], str]] = {
    "torch_compile": (re.compile(r"saved AOT compiled function|Warming up done\.|torch\.compile (?:took|takes)"),
                      "profile_run"),
}

#: Measurements stated in seconds: (phase, pattern with the seconds as group 1).
_MEASURED: list[tuple[str, re.Pattern[str]]] = [
    ("weights", re.compile(r"Loading weights took ([\d.]+) s")),
    ("jit_warmup", re.compile(r"JIT kernel warmup finished in ([\d.]+) ?s")),
    ("graph_capture", re.compile(r"Graph capturing finished in ([\d.]+) secs")),
]
#: ``[tag] torch.compile took X s in total`` (``takes`` before vLLM 0.1x; the "and initial
#: profiling/warmup run together" form when compile and profiling are timed as one).
_COMPILE_TOTAL = re.compile(r"(?:\[([\w.-]+)\] )?torch\.compile (?:and initial profiling/warmup run together )?"
                            r"(?:took|takes) ([\d.]+) s in total")
#: tqdm bars: (phase, pattern); groups: done, total, [hours], minutes, seconds of elapsed time.
_TQDM = r":\s+\d+%\|[^|]*\|\s*(\d+)/(\d+) \[(?:(\d+):)?(\d+):(\d+)<"
_BARS: list[tuple[str, re.Pattern[str]]] = [
    ("deepgemm_warmup", re.compile(r"DeepGEMM warmup" + _TQDM)),
    ("jit_warmup", re.compile(r"JIT kernel warmup \((\d+) compile keys\)" + _TQDM)),
]
#: FlashInfer's autotuner logs its own start and end (its own timestamp format, so only the
#: difference of the two is used).
_FI_START = re.compile(r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)[,.](\d+).*\[Autotuner\]:? Autotuning process starts")
_FI_END = re.compile(r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)[,.](\d+).*\[Autotuner\]:? Autotuning process ends")

_ENDED_BY = {v[1] for v in _STAGE_ENDS.values()}

_TS = re.compile(r"(?:INFO|WARNING|DEBUG|ERROR) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)")

#: Display names of the phases (``warmctl bench startup``, ``warmctl snapshot``).
PHASE_NAMES = {
    "imports": "process start, Python imports",
    "model_config": "model config, platform",
    "engine_core_start": "engine core process start",
    "worker_start": "worker process start",
    "model_load": "model init (excl. weights)",
    "weights": "load weights",
    "torch_compile": "torch.compile",
    "profile_run": "profiling run",
    "kv_cache": "KV cache allocation",
    "jit_warmup": "Triton JIT warm-up",
    "deepgemm_warmup": "DeepGEMM warm-up",
    "flashinfer_autotune": "FlashInfer autotuning",
    "graph_capture": "CUDA graph capture",
    "api_server_start": "API server start, engine handshake",
    "serve": "server bind to /health",
}


def _ts_seconds(line: str) -> float | None:
    m = _TS.search(line)
    if not m:
        return None
    mo, d, h, mi, s = (int(x) for x in m.groups())
    return (((mo * 31 + d) * 24 + h) * 60 + mi) * 60 + s


def _wall(m: re.Match) -> float:
    y, mo, d, h, mi, s, frac = m.groups()
    return ((((int(mo) * 31 + int(d)) * 24 + int(h)) * 60 + int(mi)) * 60 + int(s)) + float("0." + frac)


def _bar_seconds(h: str | None, mi: str, s: str) -> float:
    return int(h or 0) * 3600 + int(mi) * 60 + int(s)


def _measurements(lines: list[str]) -> tuple[list[tuple[str, float, int]], dict[str, int]]:
    """(phase, seconds, line index) of every measurement, and the counts the log gives."""
    out: list[tuple[str, float, int]] = []
    counts: dict[str, int] = {}
    compile_by_tag: dict[str, tuple[float, int]] = {}
    bars: dict[str, tuple[float, int]] = {}
    fi_start: float | None = None
    fi_total, fi_last, fi_runs = 0.0, -1, 0
    for i, line in enumerate(lines):
        for name, pat in _MEASURED:
            for v in pat.findall(line):
                out.append((name, float(v), i))
        for tag, v in _COMPILE_TOTAL.findall(line):  # per rank: the slowest rank counts once per tag
            if float(v) >= compile_by_tag.get(tag, (0.0, 0))[0]:
                compile_by_tag[tag] = (float(v), i)
        for name, pat in _BARS:
            for m in pat.finditer(line):  # tqdm redraws: the last drawing has the final numbers
                g = m.groups()
                if name == "jit_warmup":
                    counts["jit_warmup_compile_keys"] = int(g[0])
                    g = g[1:]
                counts[name + "_kernels"] = int(g[1])
                bars[name] = (_bar_seconds(g[2], g[3], g[4]), i)
        if (m := _FI_START.search(line)) and fi_start is None:
            fi_start = _wall(m)
        elif (m := _FI_END.search(line)) and fi_start is not None:
            fi_total, fi_last, fi_runs = fi_total + max(0.0, _wall(m) - fi_start), i, fi_runs + 1
            fi_start = None
    # the same phase both measured and drawn as a bar (JIT warm-up): keep the measurement
    measured = {n for n, _, _ in out}
    out += [(n, v, i) for n, (v, i) in bars.items() if n not in measured]
    out += [("torch_compile", v, i) for v, i in compile_by_tag.values()]
    if fi_runs:
        out.append(("flashinfer_autotune", fi_total, fi_last))
        counts["flashinfer_autotune_runs"] = fi_runs
    # several ranks print the same measurement: one value per phase and line kind (the max)
    best: dict[str, tuple[float, int]] = {}
    for n, v, i in out:
        if n == "torch_compile":
            continue
        if v >= best.get(n, (0.0, 0))[0]:
            best[n] = (v, i)
    final = [(n, v, i) for n, (v, i) in best.items()] + [x for x in out if x[0] == "torch_compile"]
    return final, counts


def _timeline(lines: list[str]) -> list[tuple[str, int, float]]:
    """(phase, line index, start) of each milestone found, in log order, stage ends
    (:data:`_STAGE_ENDS`) included."""
    found: list[tuple[str, int, float]] = []
    seen: set[str] = set()
    open_stage = None
    for i, line in enumerate(lines):
        t = _ts_seconds(line)
        if t is None:
            continue
        if open_stage and (end := _STAGE_ENDS.get(open_stage)) and end[0].search(line):
            found.append((end[1], i, t))
            open_stage = end[1]
        for name, pat in _MILESTONES:
            if name not in seen and pat.search(line):
                seen.add(name)
                found.append((name, i, t))
                open_stage = name
                break
    return found


def startup_breakdown(log_text: str, total_s: float | None = None) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds per start-up phase and the counts the log gives, read from vLLM's own log.

    Phases (keys of :data:`PHASE_NAMES`, only those the log shows, plus ``weights``,
    ``torch_compile`` and ``graph_capture`` always): the stages between milestone lines
    (see :data:`_MILESTONES`; whole-second timestamps), with what vLLM measures itself
    (weights, torch.compile, JIT warm-up, DeepGEMM warm-up, FlashInfer autotuning, CUDA graph
    capture) carved out of the stage it was printed in. With ``total_s`` (launch to healthy,
    measured by the caller): ``imports`` = time before the first log line (the log's last
    timestamp is taken as the moment it became healthy), ``other`` = ``total_s`` minus every
    phase (never negative), ``total`` = ``total_s``. Counts: ``deepgemm_warmup_kernels``,
    ``jit_warmup_kernels``, ``jit_warmup_compile_keys``, ``flashinfer_autotune_runs``.
    """
    lines = log_text.splitlines()
    phases: dict[str, float] = {}
    marks = _timeline(lines)
    stamps = [t for t in map(_ts_seconds, lines) if t is not None]
    end = stamps[-1] if stamps else None
    for k, (name, i, t) in enumerate(marks):
        nxt = marks[k + 1][2] if k + 1 < len(marks) else end
        phases[name] = phases.get(name, 0.0) + max(0.0, float(nxt - t))
    if marks and total_s is not None and end is not None:
        phases = {"imports": max(0.0, total_s - float(end - marks[0][2])), **phases}
    measured, counts = _measurements(lines)
    replaced: set[str] = set()
    for name, secs, line_no in measured:
        # the stage that was open when the measurement was printed gives its time up; a
        # stage that measures itself (torch.compile) takes the measurement instead of its span
        host = None
        for mname, i, _ in marks:
            if i > line_no or (i == line_no and mname in _ENDED_BY):  # a line that ends a stage is in it
                break
            host = mname
        if host == name and name not in replaced:
            phases[name] = 0.0
            replaced.add(name)
        elif host and host != name:
            phases[host] = max(0.0, phases.get(host, 0.0) - secs)
        phases[name] = phases.get(name, 0.0) + secs
    for k in ("weights", "torch_compile", "graph_capture"):
        phases.setdefault(k, 0.0)
    if total_s is not None:
        phases["other"] = max(0.0, total_s - sum(phases.values()))
        phases["total"] = total_s
    return phases, counts


def parse_startup_phases(log_text: str, total_s: float | None = None) -> dict[str, float]:
    """Seconds per start-up phase (see :func:`startup_breakdown`, which also gives counts)."""
    return startup_breakdown(log_text, total_s)[0]
