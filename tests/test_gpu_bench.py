"""The GPU throughput benchmark (scripts/gpu_bench.py, run by ``scripts/gpu-check.sh --bench``),
proven on the CPU machine as far as it can be: it imports, parses its arguments and runs its
holder in a venv holding only what the GPU machine has (torch, httpx, psutil and what they
require); its plan and figures are what the docs say; it runs end to end with real CRIU on
holders of host memory (``--device cpu``: no CUDA phase); and a SIGTERM in the middle of a CUDA
checkpoint (the fake driver, tests/fake_libcuda) unlocks the holder, kills its PID namespace and
removes its directory."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmctl.base.proc import pid_alive
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "scripts" / "gpu_bench.py"
HOLDER = ROOT / "scripts" / "gpu_bench_holder.py"
GiB = 2**30
MiB = 2**20
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU and unshare --pid need root")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load(BENCH, "gpu_bench_under_test")
harness = _load(ROOT / "tests" / "fake_libcuda" / "harness.py", "fake_libcuda_harness_gb")


# ------------------------------------------------------- a venv with only torch, httpx, psutil

def _closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The distributions ``names`` need, transitively (requirements without extras, whose
    markers hold here)."""
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if key in seen:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


@pytest.fixture(scope="module")
def gpu_machine_python(tmp_path_factory) -> str:
    """A fresh venv whose site-packages holds torch, httpx, psutil and their requirements, and
    nothing else: each distribution's installed files (its RECORD's top-level entries) linked
    from this venv, the same files the offline wheels installed here (pip-installing the 190 MB
    torch wheel again would take ~25 s). warmctl itself comes from the working tree, as on the
    GPU machine."""
    venv = tmp_path_factory.mktemp("gpu-machine") / "venv"
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    names = set()
    for dist in _closure(["torch", "httpx", "psutil"]):
        for f in dist.files or []:
            top = f.parts[0]
            if top != ".." and top not in names:
                names.add(top)
                src = Path(dist.locate_file(top))
                if src.exists():
                    (site / top).symlink_to(src)
    assert any(n.startswith("torch-") for n in names) and "httpx" in names and "psutil" in names
    return str(venv / "bin" / "python")


def _run(python: str, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WARMCTL_", "PYTHON"))}
    return subprocess.run([python, *args], cwd=ROOT, env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


# Run inside the GPU machine's venv: each script's main() on argument lists, as `python SCRIPT
# ARGS` would (its own directory first on sys.path); prints [exit code, stdout, stderr] per list.
MAINS = r"""
import contextlib, importlib.util, io, json, sys
path, cases = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, path.rsplit("/", 1)[0])
spec = importlib.util.spec_from_file_location("script", path)
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
for args in cases:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = m.main(args)
        except SystemExit as e:
            rc = e.code
    print(json.dumps([rc, out.getvalue(), err.getvalue()]))
"""


def _mains(python: str, script: Path, cases: list[list[str]]) -> list[tuple[int, str, str]]:
    r = _run(python, "-c", MAINS, str(script), json.dumps(cases))
    assert r.returncode == 0, r.stderr[-3000:]
    return [tuple(json.loads(line)) for line in r.stdout.splitlines()]


def test_the_benchmark_imports_parses_and_runs_its_holder_with_only_torch_httpx_psutil(gpu_machine_python, tmp_path):
    py = gpu_machine_python
    # The venv really lacks what the GPU machine lacks (else this test proves nothing).
    probe = _run(py, "-c", "import importlib.util as u; print([n for n in ('pydantic', 'numpy', 'vllm', 'typer', "
                           "'safetensors', 'boto3') if u.find_spec(n)])")
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr

    w = ["--work", str(tmp_path)]
    ok, helped, *bad = _mains(py, BENCH, [["--imports-only"], ["--help"], ["--sizes", "8,x", *w], ["--sizes", "0", *w],
                                          ["--limit", "30", *w], ["--device", "tpu", *w], []])
    assert ok[0] == 0 and "imports ok" in ok[1], ok
    assert helped[0] == 0 and "--sizes" in helped[1] and "8,32,64" in helped[1]
    for (rc, _, err), named in zip(bad, ("--sizes", "--sizes", "--limit", "--device", "--work")):
        assert rc == 2 and named in err, (named, err)
    # The holder runs torch there: the floor of a host->host copy (no GPU here); CUDA is refused.
    cuda, floor = _mains(py, HOLDER, [["floor", str(MiB)], ["floor", str(8 * MiB), "--device", "cpu"]])
    assert cuda[0] == 2 and "torch.cuda.is_available() is False" in cuda[2]
    got = json.loads(floor[1].splitlines()[-1])
    assert floor[0] == 0 and got["bytes"] == 8 * MiB and got["h2d_gb_per_s"] > 0 and got["d2h_gb_per_s"] > 0
    assert not got["pinned"]


# ------------------------------------------------------------------ plan, estimate and figures

SHM, DISK = Path("/dev/shm"), Path("/var/tmp")


def test_each_size_is_planned_from_host_ram_and_image_space():
    plan = bench.plan_size
    # The device: 128 GiB RAM, a 64 GiB tmpfs and 40 GiB of disk.
    dirs = [(SHM, 64 * GiB, True), (DISK, 40 * GiB, False)]
    assert plan(8 * GiB, 4 * GiB, 120 * GiB, dirs) == ("full", SHM, "")
    assert plan(32 * GiB, 16 * GiB, 120 * GiB, dirs) == ("full", SHM, "")  # 32 staged + 32 image + 8 < 120
    mode, where, why = plan(64 * GiB, 16 * GiB, 120 * GiB, dirs)
    assert (mode, where) == ("cuda-only", SHM) and "CRIU phases not measured" in why and "120 GiB" in why
    mode, where, why = plan(64 * GiB, 16 * GiB, 60 * GiB, dirs)
    assert (mode, where) == ("skip", None) and "60 GiB available" in why
    # An image in RAM counts twice; on disk it does not: 32 staged + 8 + 32 image > 70.
    assert plan(32 * GiB, 16 * GiB, 70 * GiB, [(SHM, 64 * GiB, True), (DISK, 100 * GiB, False)]) == ("full", DISK, "")
    # A container's 64 MiB /dev/shm is passed over.
    assert plan(8 * GiB, 4 * GiB, 120 * GiB, [(SHM, 64 * MiB, True), (DISK, 40 * GiB, False)])[:2] == ("full", DISK)
    mode, where, why = plan(8 * GiB, 4 * GiB, 120 * GiB, [(SHM, 64 * MiB, True)])
    assert (mode, where) == ("skip", None) and "weights file" in why


def test_the_time_estimate_scales_the_sizes_run_and_leaves_criu_out_of_cuda_only():
    eight = {"bytes": 8 * GiB, "seconds": 30.0, "start_s": 6.0, "mode": "full",
             "phases": {"criu_dump": {"s": 6.0}, "criu_restore": {"s": 4.0}}}
    assert bench.estimate_s([], 8 * GiB, "full") is None
    # 6 s start + 64/8 x (30 - 6 - 10) s without CRIU, + 64/8 x 10 s of CRIU when full.
    assert bench.estimate_s([eight], 64 * GiB, "cuda-only") == pytest.approx(6 + 8 * 14)
    assert bench.estimate_s([eight], 64 * GiB, "full") == pytest.approx(6 + 8 * 24)


def test_each_phase_is_compared_with_the_floor_of_its_direction():
    floor = {"h2d_gb_per_s": 50.0, "d2h_gb_per_s": 25.0}
    secs = {"lock": 0.0, "checkpoint": 2.0, "criu_dump": 4.0, "criu_restore": 8.0, "precheck": 0.5,
            "cuda_restore": 1.0, "unlock": 0.5}
    r = bench.rates(10**10, secs, floor)  # 10 GB
    assert r["checkpoint"] == {"s": 2.0, "gb_per_s": 5.0, "ratio_to_floor": 0.2}  # vs device->host
    assert r["cuda_restore"] == {"s": 1.0, "gb_per_s": 10.0, "ratio_to_floor": 0.2}  # vs host->device
    assert r["lock"]["gb_per_s"] is None and "precheck" not in r
    assert r["snapshot"]["s"] == 6.0 and r["restore"]["s"] == 10.0  # restore includes the free-memory check
    assert list(r) == [*bench.PHASES, "snapshot", "restore"]


# ----------------------------------------------------- end to end with real CRIU, and SIGTERM


def _lines(out: str) -> tuple[dict, str]:
    lines = out.strip().splitlines()
    return json.loads(next(x for x in reversed(lines) if x.startswith("{"))), lines[-1]


@needs_root
def test_the_benchmark_runs_end_to_end_on_holders_of_host_memory(gpu_machine_python, tmp_path):
    r = _run(gpu_machine_python, str(BENCH), "--work", str(tmp_path / "w"), "--device", "cpu", "--sizes", "0.03125",
             "--floor-gib", "0.03125", "--port", str(free_port()), "--limit", "150", "--image-dirs", str(tmp_path / "img"),
             timeout=180)
    res, last = _lines(r.stdout)
    assert r.returncode == 0 and last.startswith("[gpu-bench] PASS: 0.03125 GiB full"), r.stdout[-3000:] + r.stderr[-3000:]
    run = res["runs"][0]
    assert run["intact"] and run["mode"] == "full" and run["ranks"] == []
    assert run["weights_bytes"] == run["kv_bytes"] == 16 * MiB and run["weights_reload"]["bytes"] == 16 * MiB
    assert run["image_bytes"] > 32 * MiB  # the holder's memory went through CRIU
    assert run["phases"]["criu_dump"]["s"] > 0 and run["phases"]["criu_restore"]["gb_per_s"] > 0
    assert run["cleanup"]["left"] == [] and run["cleanup"]["left_paths"] == [] and not Path(run["dir"]).exists()
    assert json.loads((tmp_path / "w" / "bench.json").read_text()) == res
    assert re.search(r"\[gpu-bench\] +0\.03125 GiB full +criu_dump: +[\d.]+ s +[\d.]+ GB/s = [\d.]+ x floor", r.stdout)


def _fake_driver(tmp_path: Path, rule: str) -> tuple[harness.FakeDriver, dict[str, str]]:
    """The fake driver with one 80 GiB GPU and ``rule``, and the environment in which the
    benchmark's holders are CUDA processes of it (tests/fake_libcuda/cuda_process)."""
    built = harness.build(tmp_path / "fake")
    drv = harness.FakeDriver(tmp_path / "driver", built)
    drv.add_gpu("GPU-11111111-2222-3333-4444-555555555500", 80 * GiB)
    drv.control(rule)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")}
    env.update(PYTHONPATH=f"{ROOT / 'tests' / 'fake_libcuda' / 'cuda_process'}:{ROOT}", WARMCTL_FAKE_CUDA_DIR=str(drv.root),
               WARMCTL_LIBCUDA=str(built.full), WARMCTL_LIBNVML=str(built.full),
               WARMCTL_FAKE_CUDA_PROCESS="gpu_bench_holder.py", WARMCTL_FAKE_CUDA_PROCESS_BYTES=str(GiB))
    return drv, env


def _bench_cmd(tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, str(BENCH), "--work", str(tmp_path / "w"), "--device", "cpu", "--sizes", "0.03125",
            "--floor-gib", "0.03125", "--port", str(free_port()), "--limit", "150", "--image-dirs", str(tmp_path / "img"),
            *extra]


@needs_root
def test_cuda_only_times_each_driver_phase_of_the_holder(tmp_path):
    drv, env = _fake_driver(tmp_path, "slow * 300")  # checkpoint and restore take 0.3 s each
    r = subprocess.run(_bench_cmd(tmp_path, "--cuda-only"), env=env, capture_output=True, text=True, timeout=150)
    res, last = _lines(r.stdout)
    assert r.returncode == 0 and last.startswith("[gpu-bench] PASS: 0.03125 GiB cuda-only"), r.stdout[-3000:] + r.stderr[-3000:]
    run = res["runs"][0]
    (holder,) = run["ranks"]
    assert run["gpu_bytes"] == {"GPU-11111111-2222-3333-4444-555555555500": GiB} and "image_bytes" not in run
    ph = run["phases"]
    assert set(ph) == {"lock", "checkpoint", "cuda_restore", "unlock", "snapshot", "restore"}  # no CRIU phase
    for name in ("checkpoint", "cuda_restore"):
        assert 0.3 <= ph[name]["s"] < 5 and ph[name]["gb_per_s"] == pytest.approx(32 * MiB / 1e9 / ph[name]["s"], abs=0.01)
    assert ph["checkpoint"]["ratio_to_floor"] == pytest.approx(ph["checkpoint"]["gb_per_s"] / res["floor"]["d2h_gb_per_s"], abs=0.002)
    assert ph["restore"]["s"] >= ph["cuda_restore"]["s"] + ph["unlock"]["s"]
    # In the driver, in this order, on the holder: lock, checkpoint, restore, unlock; then it was killed.
    ends = [op for _, w, op, q, rc in drv.events() if w == "end" and q == holder and rc == 0 and op != "get_state"]
    assert ends == ["lock", "checkpoint", "restore", "unlock"]
    assert drv.state(holder) == "RUNNING" and harness.wait_dead(holder, 5)
    assert run["cleanup"]["left_paths"] == [] and list((tmp_path / "img").iterdir()) == []


@needs_root
def test_sigterm_during_the_cuda_checkpoint_unlocks_kills_and_removes(tmp_path):
    drv, env = _fake_driver(tmp_path, "slow * 60000")  # a checkpoint that copies for a minute
    p = subprocess.Popen(_bench_cmd(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 90
        holder = None
        while time.monotonic() < end and p.poll() is None:
            procs = [int(f.name) for f in (drv.root / "procs").iterdir() if f.name.isdigit() and pid_alive(int(f.name))]
            holder = next((q for q in procs if drv.state(q) == "LOCKED"), None)
            if holder is not None:
                break
            time.sleep(0.1)
        assert holder is not None, "the holder was never locked"
        assert any((tmp_path / "img").iterdir())  # the size's directory exists before the SIGTERM
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    res, last = _lines(out)
    assert p.returncode == 1 and last.startswith("[gpu-bench] FAIL") and "Terminated" in last, out[-2000:] + err[-2000:]
    run = res["runs"][0]
    assert run["ranks"] == [holder] and run["error"].startswith("Terminated")
    # Back to RUNNING in the driver before the kill; then the namespace was killed, the directory removed.
    assert drv.state(holder) == "RUNNING"
    assert {q for _, w, _, q, rc in drv.events("unlock") if w == "end" and rc == 0} == {holder}
    assert run["cleanup"]["not_running"] == {} and holder in run["cleanup"]["killed"] and run["cleanup"]["left"] == []
    assert harness.wait_dead(holder, 5)
    assert run["cleanup"]["left_paths"] == [] and list((tmp_path / "img").iterdir()) == []


def test_gpu_check_sh_takes_the_benchmark_flags_and_refuses_others():
    sh = lambda *a: subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), *a], capture_output=True,  # noqa: E731
                                   text=True, timeout=60, env={**os.environ, "PATH": "/usr/bin:/bin"})
    bad = sh("--bogus")
    assert bad.returncode == 2 and "usage:" in bad.stderr and "--bench | --bench-only" in bad.stderr
    # No NVIDIA driver here: --bench stops before anything runs, with the reason.
    r = sh("--bench", "/nonexistent-gpu-check")
    assert r.returncode == 1 and ("nvidia-smi not found" in r.stdout or "CRIU needs root" in r.stdout), r.stdout + r.stderr
    assert not Path("/nonexistent-gpu-check").exists()


@needs_root
def test_a_failed_floor_or_size_is_reported_and_the_next_size_still_runs(tmp_path):
    """--device cuda on this machine: the floor and every holder fail (a CPU build of torch); each
    failure is named with its holder log, every size is tried, nothing is left behind."""
    _, env = _fake_driver(tmp_path, "")
    cmd = _bench_cmd(tmp_path, "--device", "cuda", "--sizes", "0.03125,0.0625")  # the last of each option counts
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    res, last = _lines(r.stdout)
    assert r.returncode == 1 and last.startswith("[gpu-bench] FAIL: 0.03125 GiB full, 0.0625 GiB full; floor: "), r.stdout + r.stderr
    assert "\n" not in last and "torch.cuda.is_available() is False" in res["floor"]["error"]
    for run, mib in zip(res["runs"], (32, 64)):
        assert run["error"] == f"SystemExit: server exited with 2 (holder log: {tmp_path / 'w' / f'holder-{mib}M.log'})"
        assert "torch.cuda.is_available() is False" in (tmp_path / "w" / f"holder-{mib}M.log").read_text()
        assert run["cleanup"]["left"] == [] and run["cleanup"]["left_paths"] == []
