"""AMD Instinct (ROCm) hosts: KFD host facts, the catalog's AMD rules, the MI355X profiles and
the AMD checkpoint plan.

No AMD GPU exists here. The GPU driver boundary is replaced by test doubles: a fake sysfs tree
with the files the amdgpu/KFD driver writes (:mod:`fake_kfd`, formats from the kernel's
``kfd_topology.c``) and a fake ``amdsmi`` package (``tests/fake_amdsmi``, return shapes from AMD
SMI's ``amdsmi_interface.py``). Everything above them (parsing, fingerprint, CLI, rules, plan,
CRIU's plugin directory with real CRIU) is the real code.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from fake_kfd import GIB, FakeGpu, gpu_ids, make_tree, set_process_vram

from tests.test_criu import _tree, marker_plugins
from warmctl.naming.catalog import AMDGPU_PLUGIN, KNOWN_BAD, RULES, check, compat_key, select
from warmctl.checkpoint import criu, kfd
from warmctl.engine.plan import CheckpointPlan
from warmctl.engine.vllm import vllm_command
from warmctl.base.errors import CheckpointError, HostError
from warmctl.host import GpuInfo, HostFingerprint, fingerprint, read_amd_gpus
from warmctl.records.manifest import GpuRestore, RestoreInfo
from warmctl.records.profile import PROFILES_DIR, Profile, ProfileError, load_profile, load_profile_file
from warmctl.records.progress import Reporter
from warmctl.base.proc import ProcessId, kill_tree

TESTS = Path(__file__).resolve().parent
FAKE_AMDSMI = TESTS / "fake_amdsmi"
SEED_LAUNCH = TESTS / "data" / "seed002_mi355x_launch.txt"


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Path:
    """An 8-GPU fake sysfs tree, named by $WARMCTL_SYSFS_ROOT; amdsmi not importable."""
    root = make_tree(tmp_path / "sys")
    monkeypatch.setenv(kfd.SYSFS_ENV, str(root))
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # `import amdsmi` raises ImportError
    return root


@pytest.fixture
def fake_amdsmi(tree, tmp_path, monkeypatch) -> Path:
    """The fake amdsmi package importable, answering for the fake tree's 8 GPUs."""
    state = tmp_path / "amdsmi.json"
    state.write_text(json.dumps({"gpus": [
        {"kfd_id": gid, "node_id": i + 1, "market_name": "AMD Instinct MI355X", "device_id": "0x75a3",
         "uuid": f"9cff75a3-0000-1000-80ee-00000000000{i}", "driver_version": "6.14.14"}
        for i, gid in enumerate(gpu_ids(tree))]}))
    monkeypatch.setenv("FAKE_AMDSMI_JSON", str(state))
    monkeypatch.delitem(sys.modules, "amdsmi")
    monkeypatch.syspath_prepend(str(FAKE_AMDSMI))
    return state


# --------------------------------------------------------------------------- host facts


def test_kfd_facts_from_sysfs_alone(tree):
    gpus, driver, source, reason = read_amd_gpus()
    assert reason is None and source == "kfd" and driver == "6.14.14"
    assert len(gpus) == 8 and [g.index for g in gpus] == list(range(8))
    g = gpus[0]
    assert g.vendor == "amd" and g.name == "AMD gfx950"
    assert (g.kfd_node, g.kfd_gpu_id) == (1, gpu_ids(tree)[0])
    assert (g.gfx_target_version, g.device_id, g.simd_count, g.num_xcc) == (90500, 0x75A3, 1024, 8)
    assert (g.fw_version, g.sdma_fw_version, g.drm_render_minor) == (177, 24, 128)
    assert g.memory_bytes == 288 * GIB
    assert g.uuid == f"KFD-{0xC0FFEE000000:016x}"
    assert g.model_key() == "AMD gfx950 (device 0x75a3, 1024 SIMDs)"


def test_amdsmi_names_the_gpus_when_importable(fake_amdsmi):
    gpus, driver, source, reason = read_amd_gpus()
    assert reason is None and source == "amdsmi+kfd" and driver == "6.14.14"
    assert {g.name for g in gpus} == {"AMD Instinct MI355X"}
    assert gpus[3].uuid == "9cff75a3-0000-1000-80ee-000000000003"
    # The numbers the catalog compares still come from KFD (what CRIU's plugin compares).
    assert gpus[3].fw_version == 177 and gpus[3].model_key() == "AMD gfx950 (device 0x75a3, 1024 SIMDs)"


def test_amdsmi_that_fails_to_init_falls_back_to_sysfs(fake_amdsmi):
    fake_amdsmi.write_text(json.dumps({"fail_init": True, "gpus": []}))
    gpus, _, source, reason = read_amd_gpus()
    assert reason is None and source == "kfd" and gpus[0].name == "AMD gfx950"


def test_amdsmi_whose_library_fails_to_load_falls_back_to_sysfs(tree, tmp_path, monkeypatch):
    pkg = tmp_path / "broken" / "amdsmi"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise OSError('libamd_smi.so: cannot open shared object file')\n")
    monkeypatch.delitem(sys.modules, "amdsmi")
    monkeypatch.syspath_prepend(str(tmp_path / "broken"))
    gpus, _, source, reason = read_amd_gpus()
    assert reason is None and source == "kfd" and len(gpus) == 8


def test_in_kernel_driver_is_named_by_the_kernel(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "sys", amdgpu_version=None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    _, driver, _, _ = read_amd_gpus(root)
    assert driver == f"{os.uname().release} (in-kernel)"


def test_no_topology_and_a_malformed_one(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    gpus, _, _, reason = read_amd_gpus(tmp_path / "empty")
    assert gpus == [] and "no AMD GPU in the KFD topology" in reason
    root = make_tree(tmp_path / "sys")
    props = root / "class/kfd/kfd/topology/nodes/3/properties"
    props.write_text(props.read_text() + "fw_version 17x\n")
    gpus, _, _, reason = read_amd_gpus(root)
    assert gpus == [] and "nodes/3/properties" in reason and "fw_version 17x" in reason


def test_gfx_names():
    assert [kfd.gfx_name(v) for v in (90500, 90402, 90010, 110000)] == ["gfx950", "gfx942", "gfx90a", "gfx1100"]


def test_fingerprint_on_the_fake_tree(fake_amdsmi, tmp_path, monkeypatch):
    plugins = tmp_path / "criu-plugins"
    plugins.mkdir()
    (plugins / AMDGPU_PLUGIN).write_bytes(b"\x7fELF")
    monkeypatch.setenv("CRIU_LIBS_DIR", str(plugins))
    fp = fingerprint()
    if fp.gpu_vendor == "nvidia":
        pytest.skip("an NVIDIA GPU answers first on this host")
    assert fp.gpu_count == 8 and fp.gpu_vendor == "amd" and fp.gpu_reason is None
    assert fp.driver_version == "6.14.14" and fp.cuda_driver_version is None
    assert fp.gpu_source == "amdsmi+kfd" and fp.criu_plugin_dir == str(plugins) and fp.criu_plugins == [AMDGPU_PLUGIN]
    assert "8 x AMD gfx950" in fp.summary() and "amdgpu 6.14.14" in fp.summary()
    doc = fp.model_dump(mode="json")
    assert doc["gpus"][0]["fw_version"] == 177 and doc["gpus"][0]["vendor"] == "amd"
    assert HostFingerprint.model_validate(doc) == fp  # what a manifest records reads back


def test_nvidia_and_cpu_fingerprints_keep_their_json():
    g = GpuInfo(index=0, name="NVIDIA H200", memory_bytes=1, uuid="GPU-1", compute_capability="9.0")
    assert set(g.model_dump(mode="json")) == {"index", "name", "memory_bytes", "uuid", "persistence_mode",
                                              "compute_capability"}
    fp = _fp([g], driver="580.65.06")
    assert not {"gpu_source", "criu_plugin_dir", "criu_plugins"} & set(fp.model_dump(mode="json"))


def test_warmctl_host_shows_the_amd_facts(tree, fake_amdsmi, tmp_path):
    plugins = tmp_path / "criu-plugins"
    plugins.mkdir()
    (plugins / AMDGPU_PLUGIN).write_bytes(b"\x7fELF")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_AMDSMI), str(TESTS.parent)]),
               CRIU_LIBS_DIR=str(plugins), WARMCTL_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-m", "warmctl", "host"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    if "NVIDIA" in r.stdout:
        pytest.skip("an NVIDIA GPU answers first on this host")
    assert "8 x AMD, amdgpu driver 6.14.14 (from amdsmi+kfd)" in r.stdout
    assert "AMD Instinct MI355X" in r.stdout and "fw 177 sdma fw 24" in r.stdout and "renderD135" in r.stdout
    assert f"{plugins}: {AMDGPU_PLUGIN}" in r.stdout
    j = subprocess.run([sys.executable, "-m", "warmctl", "host", "--json"], capture_output=True, text=True, env=env,
                       timeout=120)
    doc = json.loads(j.stdout)
    assert doc["gpus"][7]["kfd_gpu_id"] == gpu_ids(tree)[7] and doc["criu_plugins"] == [AMDGPU_PLUGIN]


# --------------------------------------------------------------------------- catalog rules


def _fp(gpus: list[GpuInfo], *, driver="6.14.14", criu="4.3.0", plugins=(AMDGPU_PLUGIN,)) -> HostFingerprint:
    amd = bool(gpus) and gpus[0].vendor == "amd"
    return HostFingerprint(
        arch="x86_64", kernel="6.8.0", cpu={"model": "AMD EPYC", "flags": ["avx2"]}, gpus=gpus,
        driver_version=driver, criu_version=criu, engine_version="0.32.0", env_digest="sha256:" + "0" * 64,
        criu_plugin_dir="/usr/lib/criu" if amd else None, criu_plugins=list(plugins) if amd else None,
        cuda_driver_version=None if amd else "13.0",
    )


def _amd(n=8, **kw) -> list[GpuInfo]:
    base = dict(vendor="amd", name="AMD Instinct MI355X", memory_bytes=288 * GIB, gfx_target_version=90500,
                device_id=0x75A3, simd_count=1024, num_xcc=8, fw_version=177, sdma_fw_version=24)
    return [GpuInfo(index=i, uuid=f"KFD-{i}", kfd_node=i + 1, kfd_gpu_id=100 + i, drm_render_minor=128 + i,
                    **{**base, **kw}) for i in range(n)]


def test_rules_list_the_amd_rules():
    names = [r.split(":")[0] for r in RULES]
    for r in ("gpu memory (AMD)", "gpu firmware (AMD)", "criu plugin (AMD)", "known bad"):
        assert r in names


def test_same_amd_host_fits_and_newer_firmware_fits():
    assert check(_fp(_amd()), _fp(_amd())) is None
    assert check(_fp(_amd()), _fp(_amd(fw_version=180, sdma_fw_version=25))) is None
    # the market name is not compared: another amdsmi version may spell it otherwise
    assert check(_fp(_amd()), _fp(_amd(name="AMD Instinct MI355X OAM"))) is None


@pytest.mark.parametrize("host, rule, words", [
    (_fp(_amd(n=4)), "gpu count", ["GPU count 8", "host 4"]),
    (_fp(_amd(device_id=0x74A1, gfx_target_version=90402)), "gpu model", ["gfx950", "gfx942", "0x74a1"]),
    (_fp(_amd(simd_count=128)), "gpu model", ["1024 SIMDs", "128 SIMDs"]),  # a compute-partitioned GPU
    (_fp(_amd(), driver="6.12.12"), "driver", ["amdgpu driver 6.14.14 != host 6.12.12"]),
    (_fp(_amd(memory_bytes=72 * GIB)), "gpu memory", ["288.0", "72.0"]),
    (_fp(_amd(fw_version=176)), "gpu firmware", ["MEC firmware (fw_version) at snapshot [177], host [176]"]),
    (_fp(_amd(sdma_fw_version=20)), "gpu firmware", ["SDMA firmware", "[24]", "[20]"]),
    (_fp(_amd(), plugins=()), "criu plugin", [AMDGPU_PLUGIN, "/usr/lib/criu", "found: nothing"]),
    (_fp(_amd(), criu="4.2.1"), "known bad", ["criu 4.2.1", "criu#2812", "parallel"]),
    (_fp([]), "gpu", ["host has no GPU"]),
    (_fp([GpuInfo(index=i, name="NVIDIA B200", memory_bytes=1, uuid=f"GPU-{i}") for i in range(8)], driver="580"),
     "gpu model", ["AMD gfx950", "NVIDIA B200"]),
])  # fmt: skip
def test_amd_rejections_explain_themselves(host, rule, words):
    failed = check(_fp(_amd(), criu="4.2.0"), host)
    assert failed is not None and failed[0] == rule, failed
    for w in words:
        assert w in failed[1], (w, failed[1])


def test_one_firmware_per_gpu_is_matched_in_any_order():
    snap = _amd()
    snap[0] = snap[0].model_copy(update={"fw_version": 180})
    host = _amd()
    host[5] = host[5].model_copy(update={"fw_version": 181})  # the newer GPU sits elsewhere: still fits
    assert check(_fp(snap), _fp(host)) is None
    assert check(_fp(snap), _fp(_amd()))[0] == "gpu firmware"  # no host GPU has 180 or newer


def test_known_bad_is_only_criu_4_2_with_amd():
    assert [(b.vendor, b.criu_prefix) for b in KNOWN_BAD] == [("amd", (4, 2))]
    assert check(_fp(_amd()), _fp(_amd(), criu="4.3.0")) is None
    nv = [GpuInfo(index=0, name="NVIDIA B200", memory_bytes=1, uuid="GPU-0")]
    assert check(_fp(nv, driver="580", criu="4.2.1"), _fp(nv, driver="580", criu="4.2.1")) is None


def test_select_gives_each_amd_candidate_one_reason():
    class C:  # anything with .host, .digest and .created is a candidate
        def __init__(self, digest, fp):
            self.digest, self.host, self.created = digest, fp.model_dump(mode="json"), "2026-11-30T00:00:00Z"

    host = _fp(_amd(fw_version=177))
    cands = [C("sha256:" + "1" * 64, _fp(_amd(fw_version=200))), C("sha256:" + "2" * 64, _fp(_amd())),
             C("sha256:" + "3" * 64, _fp(_amd(n=2)))]
    chosen, rej = select(cands, host)
    assert chosen is cands[1]
    assert [(r.digest[-1], r.rule) for r in rej] == [("1", "gpu firmware"), ("3", "gpu count")]


def test_compat_key_separates_amd_firmware_and_keeps_nvidia_keys():
    a, b = _fp(_amd()), _fp(_amd(fw_version=180))
    assert compat_key(a.model_dump(mode="json")) != compat_key(b.model_dump(mode="json"))
    assert compat_key(a.model_dump(mode="json")) == compat_key(_fp(_amd()).model_dump(mode="json"))
    nv = _fp([GpuInfo(index=0, name="NVIDIA B200", memory_bytes=1, uuid="GPU-0")], driver="580")
    doc = nv.model_dump(mode="json")
    # the criteria of an NVIDIA host are exactly those compared before AMD support
    import hashlib

    from warmctl.naming.catalog import _version_tuple, compatible_flags

    old = {"arch": nv.arch, "gpus": ["NVIDIA B200"], "driver": "580", "cpu": sorted(compatible_flags(nv.cpu.flags)),
           "criu": _version_tuple(nv.criu_version)[:1], "engine": nv.engine_version, "env": nv.env_digest}
    assert compat_key(doc) == "sha256:" + hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- profiles


def _seed_command() -> tuple[dict[str, str], str, list[str]]:
    """Seed 002's MI355X launch command: (environment, model, flags)."""
    words = shlex.split(SEED_LAUNCH.read_text().replace("\\\n", " "))
    env = {}
    while "=" in words[0]:
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    assert words[:2] == ["vllm", "serve"]
    return env, words[2], words[3:]


#: Flags a MI355X profile adds to the seed's command (what a restore needs; docs/gpu.md).
RESTORE_FLAGS = ["--disable-custom-all-reduce", "--enable-sleep-mode"]
MTP = ["--speculative-config", '{"method":"mtp","num_speculative_tokens":3}']


def test_seed_file_copy_matches_the_seed_when_present():
    seeds = Path(os.environ.get("WARMCTL_SEEDS_DIR", "/work/shared/seeds"))
    found = sorted(seeds.glob("002_*.txt")) if seeds.is_dir() else []
    if not found:
        pytest.skip(f"seed 002 not in {seeds}")
    text = found[0].read_text()
    assert SEED_LAUNCH.read_text().strip() in text  # the test's copy is the seed's command, verbatim


@pytest.mark.parametrize("name, extra", [("ling31-flash-mi355x", []), ("ling31-flash-mi355x-mtp", MTP)])
def test_mi355x_profile_command_line_is_seed_002(name, extra):
    p = load_profile_file(PROFILES_DIR / f"{name}.toml")
    env, model, flags = _seed_command()
    assert p.name == name and p.engine.model == model == "inclusionAI/Ling-3.1-flash"
    for k, v in env.items():
        assert p.engine.env[k] == v  # VLLM_ROCM_USE_AITER=1
    cmd = vllm_command(p, p.engine.model)
    assert Path(cmd[0]).name == "vllm" and cmd[1:3] == ["serve", model]
    rest = cmd[3:]
    # warmctl's own plumbing: the served name, loopback host and port, its worker extension
    for flag, value in (("--served-model-name", name), ("--host", "127.0.0.1"), ("--port", str(p.engine.port)),
                        ("--worker-extension-cls", "warmctl.engine.worker_ext.WeightsExtension")):
        i = rest.index(flag)
        assert rest[i + 1] == value
        del rest[i : i + 2]
    assert rest == flags + RESTORE_FLAGS + extra


def test_mi355x_profile_describes_an_amd_host():
    p = load_profile("ling31-flash-mi355x")
    h = p.hardware
    assert (h.vendor, h.gpu_model, h.gpu_count) == ("amd", "AMD Instinct MI355X", 8)
    assert p.checkpoint.cuda is False and p.checkpoint.sleep_level == 2 and p.checkpoint.weights_outside_image
    assert p.engine.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert max(p.warmup.prompt_tokens) + max(p.warmup.output_tokens) <= 262144  # the model's context (seed 002)
    assert "vendor" in p.model_dump(mode="json")["hardware"]


def test_vendor_defaults_to_nvidia_and_keeps_old_digests():
    p = load_profile("ling31-flash")
    assert p.hardware.vendor == "nvidia" and "vendor" not in p.model_dump(mode="json")["hardware"]
    again = Profile.model_validate(p.model_dump(mode="json"))
    assert again.digest() == p.digest()


def test_amd_profile_refuses_the_cuda_checkpoint(tmp_path):
    text = (PROFILES_DIR / "ling31-flash-mi355x.toml").read_text().replace("cuda = false", "cuda = true")
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ProfileError, match="checkpoint.cuda = true needs NVIDIA GPUs"):
        load_profile_file(tmp_path / "bad.toml")
    (tmp_path / "cpu.toml").write_text('name = "c"\n[engine]\nmodel = "m"\nserved_model_name = "m"\n'
                                       '[canary]\nprompts = ["x"]\n[hardware]\nvendor = "amd"\n')
    with pytest.raises(ProfileError, match="hardware: .*vendor = 'amd'.*gpu_count is 0"):
        load_profile_file(tmp_path / "cpu.toml")


# --------------------------------------------------------------------------- the plan


def test_amd_plan_has_no_cuda_steps():
    amd = CheckpointPlan.of(load_profile("ling31-flash-mi355x"))
    steps = amd.steps()
    assert amd.criu_plugins == (AMDGPU_PLUGIN,)
    assert not [s for s in steps if "cuda" in s or s == "checkpoint_prepare"], steps
    assert steps == ["weights_save", "sleep(2)", f"criu_dump[{AMDGPU_PLUGIN}]", "vram_preflight",
                     f"criu_restore[{AMDGPU_PLUGIN}]", "wake+weights_load"]
    nv = CheckpointPlan.of(load_profile("ling31-flash")).steps()
    assert "cuda_lock" in nv and "criu_dump" in nv and "vram_preflight" not in nv  # the control
    assert CheckpointPlan.of(load_profile("tiny")).criu_plugins == ()


def _restore(gpu_bytes: dict[str, int]) -> RestoreInfo:
    return RestoreInfo(gpu=GpuRestore(nspids=[], gpu_bytes=gpu_bytes))


def test_vram_preflight_before_restore(tmp_path):
    plan = CheckpointPlan.of(load_profile("ling31-flash-mi355x"))
    gpus = [FakeGpu(vram_used=(250 if i == 6 else 10) * GIB) for i in range(8)]
    root = make_tree(tmp_path / "sys", gpus)
    reporter = Reporter()
    need = {f"KFD-{i}": 20 * GIB for i in range(8)}
    plan.before_restore(_restore(need), reporter, sysfs=root)  # 8 GPUs with >= 38 GiB free: fits
    assert [p.name for p in reporter.phases] == ["vram_preflight"]
    need["KFD-0"] = 100 * GIB  # one GPU needs 100 GiB: 7 have 278 GiB free, so it still fits
    plan.before_restore(_restore(need), reporter, sysfs=root)
    need = {f"KFD-{i}": 100 * GIB for i in range(8)}  # all 8 need 100 GiB; node 7 has 38 GiB free
    with pytest.raises(CheckpointError, match=r"not enough free VRAM .*node 7: 38\.0 GiB"):
        plan.before_restore(_restore(need), reporter, sysfs=root)
    (root / "class/drm/renderD130/device/mem_info_vram_used").unlink()
    with pytest.raises(CheckpointError, match="cannot read the free VRAM of AMD GPU node 3"):
        plan.before_restore(_restore(need), reporter, sysfs=root)
    CheckpointPlan.of(load_profile("tiny")).before_restore(_restore(need), reporter, sysfs=root)  # not AMD: nothing


def test_process_vram_from_kfd_proc(tmp_path):
    root = make_tree(tmp_path / "sys")
    ids = gpu_ids(root)
    set_process_vram(root, 101, {ids[0]: 5 * GIB, ids[1]: GIB})
    set_process_vram(root, 102, {ids[0]: GIB})
    assert kfd.process_vram([101, 102, 103], root) == {ids[0]: 6 * GIB, ids[1]: GIB}


# --------------------------------------------------------------------------- CRIU's plugin directory

def test_plugin_libdir_links_only_the_named_plugin(tmp_path, monkeypatch):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for n in (AMDGPU_PLUGIN, "cuda_plugin.so"):
        (plugins / n).write_bytes(b"\x7fELF")
    monkeypatch.setenv("CRIU_LIBS_DIR", str(plugins))
    with criu._plugin_libdir((AMDGPU_PLUGIN,)) as opts:
        d = Path(opts[1])
        assert opts[0] == "--libdir" and os.listdir(d) == [AMDGPU_PLUGIN]
        assert os.readlink(d / AMDGPU_PLUGIN) == str(plugins / AMDGPU_PLUGIN)
    assert not d.exists()
    with criu._plugin_libdir() as opts:
        assert os.listdir(opts[1]) == []
    (plugins / AMDGPU_PLUGIN).unlink()
    with pytest.raises(HostError, match=f"CRIU plugin {AMDGPU_PLUGIN} not found in {plugins}"):
        with criu._plugin_libdir((AMDGPU_PLUGIN,)):
            pass


@pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")
def test_real_criu_loads_only_the_amdgpu_plugin(tmp_path, monkeypatch):
    """With real CRIU: an AMD plan's dump and restore load amdgpu_plugin.so from CRIU's plugin
    directory and not the cuda_plugin.so beside it (marker plugins stand in for both)."""
    marker_plugins(tmp_path, monkeypatch, {"amdgpu": AMDGPU_PLUGIN, "cuda": "cuda_plugin.so"})
    plan = CheckpointPlan.of(load_profile("ling31-flash-mi355x"))
    launcher, root = _tree(tmp_path)
    new_root = None
    try:
        criu.dump(root, tmp_path / "img", plugins=plan.criu_plugins)
        launcher.wait(10)
        dumped = sorted(p.name for p in tmp_path.glob("loaded.*"))
        assert dumped and all(n.startswith("loaded.amdgpu.") for n in dumped), dumped
        for p in tmp_path.glob("loaded.*"):
            p.unlink()
        new_root, _ = criu.restore(tmp_path / "img", tmp_path / "pid", plugins=plan.criu_plugins)
        assert psutil.Process(new_root).is_running()
        restored = sorted(p.name for p in tmp_path.glob("loaded.*"))
        assert restored and all(n.startswith("loaded.amdgpu.") for n in restored), restored
    finally:
        if new_root:
            kill_tree(ProcessId.of(new_root))
        if launcher.poll() is None:
            if root:
                kill_tree(ProcessId.of(root))
            launcher.kill()
            launcher.wait()
