"""The CUDA checkpoint binding and the rank orchestration, against a fake NVIDIA driver.

The binding (``warmctl.checkpoint.cuda``, ``nvml``, ``ranks``) is the real code; the only double
is ``tests/fake_libcuda`` (a C library implementing the driver's checkpoint API and a few NVML
calls, compiled here with ``cc``). Ranks are real child processes.
"""

from __future__ import annotations

import ctypes
import subprocess
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import session_tmp
from warmctl.checkpoint import cuda, nvml, ranks
from warmctl.checkpoint.cuda import ProcessState
from warmctl.base.errors import CheckpointError
from warmctl.base.proc import tree_pids

_spec = importlib.util.spec_from_file_location("fake_libcuda_harness", Path(__file__).parent / "fake_libcuda" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = harness
_spec.loader.exec_module(harness)

GiB = 2**30
GPU0 = "GPU-11111111-2222-3333-4444-555555555500"
GPU1 = "GPU-11111111-2222-3333-4444-555555555501"


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    return harness.build(session_tmp(tmp_path_factory, "fake_libcuda"))


@pytest.fixture
def drv(tmp_path, built, monkeypatch):
    d = harness.FakeDriver(tmp_path / "driver", built)
    monkeypatch.setenv("WARMCTL_FAKE_CUDA_DIR", str(d.root))
    d.add_gpu(GPU0, 80 * GiB)
    d.add_gpu(GPU1, 80 * GiB)
    yield d
    d.close()


@pytest.fixture
def api(built, drv):
    return cuda.DriverAPI(str(built.full))


@pytest.fixture
def cli(built, drv):
    return cuda.CliAPI(str(built.cli), driver_version=13000)


# ------------------------------------------------------------------------------------ ABI


def test_argument_structs_are_64_zeroed_bytes_with_the_documented_layout():
    for s in (cuda.CUcheckpointLockArgs, cuda.CUcheckpointCheckpointArgs, cuda.CUcheckpointRestoreArgs,
              cuda.CUcheckpointUnlockArgs):
        assert ctypes.sizeof(s) == 64
        assert bytes(s()) == b"\0" * 64
    assert cuda.CUcheckpointLockArgs.timeoutMs.offset == 0
    assert cuda.CUcheckpointLockArgs.reserved1.offset == 8
    assert cuda.CUcheckpointRestoreArgs.gpuPairs.offset == 0
    assert cuda.CUcheckpointRestoreArgs.gpuPairsCount.offset == 8
    assert ctypes.sizeof(cuda.CUcheckpointGpuPair) == 32


def test_gpu_uuid_conversion_round_trips_and_rejects_garbage():
    raw = cuda.uuid_bytes(GPU1)
    assert len(raw) == 16 and raw[-1] == 0x01
    assert cuda.uuid_str(raw) == GPU1
    arr = cuda.gpu_pair_array({GPU0: GPU1})
    assert bytes(arr[0].oldUuid.bytes) == cuda.uuid_bytes(GPU0)
    assert bytes(arr[0].newUuid.bytes) == raw
    with pytest.raises(ValueError):
        cuda.uuid_bytes("MIG-not-a-gpu")
    with pytest.raises(ValueError):
        cuda.gpu_pair_array({GPU0: GPU1, GPU1: GPU1})


# ------------------------------------------------------------------------ driver binding


def test_full_cycle_moves_the_process_through_every_state(api, drv):
    pid = drv.spawn_rank(0, 4 * GiB)
    assert api.driver_version == 13000
    assert api.state(pid) is ProcessState.RUNNING
    assert api.restore_thread_id(pid) == pid
    api.lock(pid, timeout_s=5)
    assert api.state(pid) is ProcessState.LOCKED and drv.state(pid) == "LOCKED"
    api.checkpoint(pid)
    assert api.state(pid) is ProcessState.CHECKPOINTED
    # Checkpointed memory is off the GPU: NVML no longer lists the process and the GPU is free.
    assert pid not in nvml.compute_processes(str(drv.built.full))
    assert nvml.free_bytes(str(drv.built.full))[GPU0] == 80 * GiB
    api.restore(pid)
    assert api.state(pid) is ProcessState.LOCKED
    api.unlock(pid)
    assert api.state(pid) is ProcessState.RUNNING
    assert nvml.compute_processes(str(drv.built.full))[pid] == {GPU0: 4 * GiB}


def test_wrong_order_is_an_illegal_state_error_naming_op_and_pid(api, drv):
    pid = drv.spawn_rank(0, GiB)
    with pytest.raises(cuda.IllegalState) as e:
        api.checkpoint(pid)
    assert e.value.code == cuda.CUDA_ERROR_ILLEGAL_STATE and e.value.pid == pid
    assert f"cuda checkpoint of pid {pid} failed: CUDA_ERROR_ILLEGAL_STATE" in str(e.value)
    with pytest.raises(cuda.IllegalState):
        api.unlock(pid)
    assert drv.state(pid) == "RUNNING"


def test_lock_timeout_leaves_the_process_running(api, drv):
    pid = drv.spawn_rank(0, GiB)
    drv.control(f"busy {pid} 3000")
    t0 = time.monotonic()
    with pytest.raises(cuda.LockTimeout) as e:
        api.lock(pid, timeout_s=0.3)
    waited = time.monotonic() - t0
    assert 0.25 <= waited < 2.5
    assert "timed out" in str(e.value) and "keeps running" in str(e.value)
    assert drv.state(pid) == "RUNNING"
    # The timeout reached the driver as milliseconds in the zeroed struct.
    drv.control(f"busy {pid} 200")
    api.lock(pid, timeout_s=1.0)
    assert drv.state(pid) == "LOCKED"


@pytest.mark.parametrize(
    "code,exc,words",
    [
        (801, cuda.NotSupported, "does not support checkpointing"),
        (2, cuda.GpuOutOfMemory, "out of GPU memory"),
        (401, cuda.IllegalState, "not in a state"),
        (909, cuda.LockTimeout, "timed out"),
        (35, cuda.DriverTooOld, "older than"),
        (1, cuda.CudaCheckpointError, "invalid argument"),
        (999, cuda.CudaCheckpointError, "CUDA_ERROR_UNKNOWN"),
    ],
)
@pytest.mark.parametrize("impl", ["driver", "cli"])
def test_every_driver_error_becomes_a_clear_exception(request, drv, code, exc, words, impl):
    binding = request.getfixturevalue("api" if impl == "driver" else "cli")
    pid = drv.spawn_rank(0, GiB)
    drv.control(f"fail checkpoint {pid} {code}")
    binding.lock(pid)
    with pytest.raises(exc) as e:
        binding.checkpoint(pid)
    assert type(e.value) is exc
    assert isinstance(e.value, CheckpointError)
    assert words in str(e.value) and str(pid) in str(e.value)
    assert e.value.code == code


def test_a_dead_pid_is_an_invalid_value(api, drv):
    p = drv.spawn()
    drv.register(p.pid, 0, GiB)
    p.kill()
    p.wait()
    with pytest.raises(cuda.CudaCheckpointError) as e:
        api.lock(p.pid)
    assert e.value.code == cuda.CUDA_ERROR_INVALID_VALUE


def test_restore_remaps_gpus_on_driver_580(api, drv):
    pid = drv.spawn_rank(0, GiB)
    api.lock(pid)
    api.checkpoint(pid)
    api.restore(pid, {GPU0: GPU1})
    assert drv.proc(pid)["gpu"] == 1
    api.unlock(pid)
    assert nvml.compute_processes(str(drv.built.full))[pid] == {GPU1: GiB}


def test_a_map_missing_the_checkpointed_gpu_is_refused(api, drv):
    pid = drv.spawn_rank(0, GiB)
    api.lock(pid)
    api.checkpoint(pid)
    with pytest.raises(cuda.CudaCheckpointError) as e:
        api.restore(pid, {GPU1: GPU0})
    assert e.value.code == cuda.CUDA_ERROR_INVALID_VALUE
    assert drv.state(pid) == "CHECKPOINTED"


def test_remap_on_a_570_driver_is_refused_before_calling_it(built, drv):
    drv.control("driver_version 12080")
    api = cuda.DriverAPI(str(built.full))
    pid = drv.spawn_rank(0, GiB)
    api.lock(pid)
    api.checkpoint(pid)
    with pytest.raises(cuda.DriverTooOld) as e:
        api.restore(pid, {GPU0: GPU1})
    assert "580" in str(e.value) and "12.8" in str(e.value)
    assert drv.events("restore") == []
    api.restore(pid)  # in place still works
    assert drv.state(pid) == "LOCKED"


def test_out_of_memory_restore_poisons_the_process_for_good(api, drv):
    """Why ranks.restore_ranks checks free memory first (NVIDIA/cuda-checkpoint#44)."""
    pid = drv.spawn_rank(0, 50 * GiB)
    api.lock(pid)
    api.checkpoint(pid)
    hog = drv.spawn_rank(0, 40 * GiB)
    with pytest.raises(cuda.GpuOutOfMemory) as e:
        api.restore(pid)
    assert "cannot be restored again" in str(e.value)
    os.kill(hog, 9)
    (drv.root / "procs" / str(hog)).unlink()
    with pytest.raises(cuda.CudaCheckpointError) as e:
        api.restore(pid)
    assert e.value.code == cuda.CUDA_ERROR_OPERATING_SYSTEM
    with pytest.raises(cuda.IllegalState):
        api.unlock(pid)


def test_restore_without_a_visible_gpu_says_so(built, drv):
    api = cuda.DriverAPI(str(built.full))
    pid = drv.spawn_rank(0, GiB)
    api.lock(pid)
    api.checkpoint(pid)
    (drv.root / "gpus").write_text("")
    with pytest.raises(cuda.CudaUnavailable) as e:
        api.restore(pid)
    assert "CUDA_VISIBLE_DEVICES" in str(e.value)
    assert drv.state(pid) == "CHECKPOINTED"


def test_no_driver_library_is_cuda_unavailable(tmp_path):
    with pytest.raises(cuda.CudaUnavailable) as e:
        cuda.DriverAPI(str(tmp_path / "libcuda.so.1"))
    assert "NVIDIA driver" in str(e.value)
    assert nvml.available(str(tmp_path / "libnvidia-ml.so.1")) is False
    assert nvml.compute_processes(str(tmp_path / "libnvidia-ml.so.1")) == {}


def test_old_driver_without_symbols_falls_back_to_the_utility(built, drv, monkeypatch):
    with pytest.raises(cuda.DriverTooOld) as e:
        cuda.DriverAPI(str(built.old))
    assert "570" in str(e.value)
    monkeypatch.delenv("WARMCTL_CUDA_CHECKPOINT", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(cuda.DriverTooOld) as e:
        cuda.load(str(built.old))
    assert "cuda-checkpoint" in str(e.value)
    api = cuda.load(str(built.old), cli=str(built.cli))
    assert api.kind == "cli"
    pid = drv.spawn_rank(0, GiB)
    assert api.restore_thread_id(pid) == pid
    api.lock(pid, timeout_s=2)
    api.checkpoint(pid)
    assert api.state(pid) is ProcessState.CHECKPOINTED
    api.restore(pid, {GPU0: GPU1})
    api.unlock(pid)
    assert drv.proc(pid) == {"state": "RUNNING", "gpu": 1, "bytes": GiB, "poisoned": False}


def test_utility_lock_timeout(cli, drv):
    pid = drv.spawn_rank(0, GiB)
    drv.control(f"busy {pid} 3000")
    with pytest.raises(cuda.LockTimeout):
        cli.lock(pid, timeout_s=0.3)
    assert drv.state(pid) == "RUNNING"


# ------------------------------------------------------------------------------- ranks


def test_gpu_rank_pids_finds_exactly_the_gpu_processes_of_a_tree(drv, built, tmp_path):
    # A real tree: a root that starts three children; two of them "hold a GPU".
    code = (
        "import subprocess, sys, time\n"
        f"rank = {harness.RANK_CODE!r}\n"
        "kids = [subprocess.Popen([sys.executable, '-c', rank] + a, stdout=subprocess.PIPE, text=True)\n"
        f"        for a in ([{str(drv.root / 'dev' / 'nvidia0')!r}], [], [])]\n"
        "for k in kids: k.stdout.readline()\n"
        "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
        "time.sleep(600)\n"
    )
    (drv.root / "dev" / "nvidia0").write_bytes(b"\0" * 4096)
    import subprocess
    import sys

    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    drv.children.append(root)
    mapped, nvml_only, plain = map(int, root.stdout.readline().split())
    try:
        drv.register(nvml_only, 1, GiB)  # NVML lists it; it maps nothing
        prefix = str(drv.root / "dev" / "nvidia")
        found = ranks.gpu_rank_pids(root.pid, device_prefix=prefix, nvml_path=str(built.full))
        assert found == sorted([mapped, nvml_only])
        assert set(tree_pids(root.pid)) == {root.pid, mapped, nvml_only, plain}
        # No driver and no device files: nothing.
        assert ranks.gpu_rank_pids(root.pid, nvml_path=str(tmp_path / "none.so")) == []
    finally:
        for p in (mapped, nvml_only, plain):
            os.kill(p, 9)


def _ordered(drv, first: str, then: str, pids: list[int]) -> None:
    """Every ``first`` call ended before any ``then`` call began, and each pid had both."""
    ends = [t for t, w, _, p, rc in drv.events(first) if w == "end" and rc == 0 and p in pids]
    begins = [t for t, w, _, p, _ in drv.events(then) if w == "begin" and p in pids]
    assert len(ends) == len(pids) and len(begins) == len(pids)
    assert max(ends) < min(begins)


def test_checkpoint_ranks_locks_all_before_checkpointing_any_then_resumes(api, drv, built):
    pids = [drv.spawn_rank(i % 2, (i + 1) * GiB) for i in range(4)]
    drv.control(*(f"busy {p} {50 * (4 - i)}" for i, p in enumerate(pids)))  # locks finish out of order
    with ranks.checkpoint_ranks(pids, lock_timeout_s=5, api=api, nvml_path=str(built.full)) as report:
        assert [drv.state(p) for p in pids] == ["CHECKPOINTED"] * 4
    _ordered(drv, "lock", "checkpoint", pids)
    assert [drv.state(p) for p in pids] == ["RUNNING"] * 4
    assert report.resumed == pids
    assert report.gpu_bytes == {GPU0: 4 * GiB, GPU1: 6 * GiB}
    assert report.nspids == {p: p for p in pids}  # no PID namespace in this test
    assert set(report.phases) == {"lock", "checkpoint", "resume"}
    assert report.phases["lock"] >= 0.15  # the slowest lock (200 ms) bounds the phase
    assert report.timeouts["lock"] == 5
    assert set(report.per_rank["checkpoint"]) == set(pids)
    assert report.to_dict()["per_rank"]["lock"].keys() == {str(p) for p in pids}


def test_a_lock_timeout_on_one_rank_unlocks_the_others_and_checkpoints_none(api, drv, built):
    pids = [drv.spawn_rank(0, GiB) for _ in range(3)]
    drv.control(f"busy {pids[1]} 5000")
    with pytest.raises(ranks.RankCheckpointError) as e:
        with ranks.checkpoint_ranks(pids, lock_timeout_s=0.3, api=api, nvml_path=str(built.full)):
            pytest.fail("body must not run")
    assert "timed out" in str(e.value) and "keeps serving" in str(e.value)
    assert list(e.value.failures) == [pids[1]]
    assert e.value.rolled_back and e.value.report.rollback == "complete"
    assert isinstance(e.value.__cause__, cuda.LockTimeout)
    assert [drv.state(p) for p in pids] == ["RUNNING"] * 3
    assert drv.events("checkpoint") == []


def test_a_checkpoint_failure_restores_and_unlocks_every_rank(api, drv, built):
    pids = [drv.spawn_rank(0, GiB) for _ in range(3)]
    drv.control(f"fail checkpoint {pids[2]} 801")
    with pytest.raises(ranks.RankCheckpointError) as e:
        with ranks.checkpoint_ranks(pids, api=api, nvml_path=str(built.full)):
            pytest.fail("body must not run")
    assert isinstance(e.value.__cause__, cuda.NotSupported)
    assert [drv.state(p) for p in pids] == ["RUNNING"] * 3
    restored = {p for _, w, _, p, rc in drv.events("restore") if w == "end" and rc == 0}
    assert restored == set(pids[:2])


def test_a_failing_dump_inside_rolls_back_and_reraises_it(api, drv, built):
    pids = [drv.spawn_rank(0, GiB) for _ in range(2)]
    with pytest.raises(CheckpointError) as e:
        with ranks.checkpoint_ranks(pids, api=api, nvml_path=str(built.full)):
            raise CheckpointError("criu dump failed (simulated)")
    assert str(e.value) == "criu dump failed (simulated)"
    assert any("rollback (restore + unlock) complete" in n for n in e.value.__notes__)
    assert [drv.state(p) for p in pids] == ["RUNNING"] * 2


def test_ranks_killed_by_the_dump_are_not_resumed(api, drv, built):
    pids = [drv.spawn_rank(0, GiB) for _ in range(2)]
    with ranks.checkpoint_ranks(pids, api=api, nvml_path=str(built.full)) as report:
        for p in pids:
            os.kill(p, 9)
            assert harness.wait_dead(p)
    assert report.resumed == []
    assert [drv.state(p) for p in pids] == ["CHECKPOINTED"] * 2


def test_host_ram_smaller_than_the_gpu_footprint_refuses_before_locking(api, drv, built):
    huge = drv.add_gpu("GPU-11111111-2222-3333-4444-5555555555ff", 2**52)
    pid = drv.spawn_rank(2, 2**51)
    with pytest.raises(ranks.InsufficientHostMemory) as e:
        with ranks.checkpoint_ranks([pid], api=api, nvml_path=str(built.full)):
            pytest.fail("body must not run")
    assert "host RAM" in str(e.value) and e.value.report.gpu_bytes == {huge: 2**51}
    assert drv.events("lock") == []


def _checkpointed(api, drv, built, sizes, gpu=0):
    pids = [drv.spawn_rank(gpu, s) for s in sizes]
    # The fake GPUs hold tens of GiB that this small test machine could not stage: the host RAM
    # check is tested on its own above.
    with ranks.checkpoint_ranks(pids, api=api, nvml_path=str(built.full), resume=False,
                                check_host_ram=False) as report:
        pass
    assert [drv.state(p) for p in pids] == ["CHECKPOINTED"] * len(pids)
    return pids, report


def test_restore_ranks_restores_all_before_unlocking_any(api, drv, built):
    pids, snap = _checkpointed(api, drv, built, [10 * GiB, 20 * GiB, 30 * GiB])
    report = ranks.restore_ranks(pids, required_free_bytes=snap.gpu_bytes, api=api, nvml_path=str(built.full))
    _ordered(drv, "restore", "unlock", pids)
    assert [drv.state(p) for p in pids] == ["RUNNING"] * 3
    assert set(report.phases) == {"precheck", "restore", "unlock"}
    assert report.free_bytes[GPU0] == 80 * GiB and report.gpu_bytes == {GPU0: 60 * GiB}


def test_too_little_free_gpu_memory_is_caught_before_any_restore(api, drv, built):
    pids, snap = _checkpointed(api, drv, built, [30 * GiB, 30 * GiB])
    drv.spawn_rank(0, 30 * GiB)  # another tenant took the GPU meanwhile
    with pytest.raises(ranks.InsufficientGpuMemory) as e:
        ranks.restore_ranks(pids, required_free_bytes=snap.gpu_bytes, api=api, nvml_path=str(built.full))
    assert "50.00 GiB free, 60.00 GiB needed" in str(e.value) and "killed" in str(e.value)
    assert drv.events("restore") == []
    assert all(not drv.proc(p)["poisoned"] for p in pids)
    assert all(harness.wait_dead(p) for p in pids)


def test_restore_ranks_with_a_gpu_map_checks_and_uses_the_new_gpu(api, drv, built):
    pids, snap = _checkpointed(api, drv, built, [30 * GiB, 30 * GiB])
    drv.spawn_rank(0, 70 * GiB)  # GPU0 is busy now; GPU1 is free
    pairs = ranks.default_gpu_pairs([GPU0], [GPU0, GPU1])
    assert pairs is None  # GPU0 still exists here: default is in place...
    pairs = {GPU0: GPU1, GPU1: GPU0}  # ...so move explicitly
    report = ranks.restore_ranks(pids, pairs, snap.gpu_bytes, api=api, nvml_path=str(built.full))
    assert [drv.proc(p)["gpu"] for p in pids] == [1, 1]
    assert report.free_bytes[GPU1] == 80 * GiB


def test_a_failed_restore_kills_every_rank(api, drv, built):
    pids, snap = _checkpointed(api, drv, built, [GiB, GiB, GiB])
    drv.control(f"fail restore {pids[1]} 999")
    with pytest.raises(ranks.RankCheckpointError) as e:
        ranks.restore_ranks(pids, required_free_bytes=snap.gpu_bytes, api=api, nvml_path=str(built.full))
    assert list(e.value.failures) == [pids[1]] and e.value.report.rollback == "killed"
    assert drv.events("unlock") == []
    assert all(harness.wait_dead(p) for p in pids)


def test_a_restore_slower_than_its_bound_is_reported_and_killed(api, drv, built):
    pids, snap = _checkpointed(api, drv, built, [GiB, GiB])
    drv.control(f"slow {pids[0]} 1500")
    t0 = time.monotonic()
    with pytest.raises(ranks.RankCheckpointError) as e:
        ranks.restore_ranks(pids, restore_timeout_s=0.3, api=api, nvml_path=str(built.full))
    assert time.monotonic() - t0 < 1.4
    assert "did not return within 0.3 s" in str(e.value)
    assert e.value.report.timeouts["restore"] == 0.3
    assert all(harness.wait_dead(p) for p in pids)


def test_restored_ranks_maps_namespace_pids_back_to_host_pids(drv):
    p = drv.spawn()
    assert ranks.nspid(p.pid) == p.pid
    assert ranks.restored_ranks(os.getpid(), {p.pid: p.pid}) == [p.pid]
    with pytest.raises(CheckpointError):
        ranks.restored_ranks(p.pid, [999999])


def test_default_gpu_pairs():
    assert ranks.default_gpu_pairs([GPU0], [GPU0, GPU1]) is None
    other = "GPU-aaaaaaaa-2222-3333-4444-555555555500"
    assert ranks.default_gpu_pairs([GPU0, GPU1], [other, GPU0]) == {GPU0: other, GPU1: GPU0}
    with pytest.raises(CheckpointError):
        ranks.default_gpu_pairs([GPU0, GPU1], [other])


def test_no_ranks_is_a_no_op():
    with ranks.checkpoint_ranks([]) as report:
        assert report.pids == []
    assert ranks.restore_ranks([]).phases == {}


# ------------------------------------------------------- fixes before the GPU run


def test_a_rank_left_failed_makes_the_rollback_incomplete(api, drv, built):
    """The driver can leave a process FAILED (CUprocessState 3); restore + unlock cannot bring
    it back, and the rollback must not say the engine keeps serving."""
    pids = [drv.spawn_rank(0, GiB) for _ in range(2)]
    drv.control(f"fail checkpoint {pids[1]} 999 3")  # the checkpoint fails and leaves it FAILED
    with pytest.raises(ranks.RankCheckpointError) as e:
        with ranks.checkpoint_ranks(pids, api=api, nvml_path=str(built.full)):
            pytest.fail("body must not run")
    assert drv.state(pids[1]) == "FAILED"
    assert not e.value.rolled_back
    assert e.value.report.rollback.startswith("incomplete") and "FAILED" in e.value.report.rollback
    assert "ROLLBACK FAILED" in str(e.value) and "keeps serving" not in str(e.value)
    assert drv.state(pids[0]) == "RUNNING"  # the other rank was brought back


def test_a_rank_still_mapping_the_gpu_after_its_checkpoint_is_refused_before_the_dump(api, drv, built):
    """CRIU fails on /dev/nvidia* mappings ("Can't handle non-regular mapping"); checkpoint_ranks
    checks that the ranks released them before the body (the dump) runs. The fake driver does
    not unmap the rank's fake device file at checkpoint, as a driver that failed to release it."""
    pids = [drv.spawn_rank(0, GiB, map_device=True), drv.spawn_rank(0, GiB)]
    prefix = str(drv.root / "dev" / "nvidia")
    with pytest.raises(ranks.RankCheckpointError) as e:
        with ranks.checkpoint_ranks(pids, api=api, nvml_path=str(built.full), device_prefix=prefix):
            pytest.fail("body must not run")
    assert list(e.value.failures) == [pids[0]]
    assert "non-regular mapping" in str(e.value) and "keeps serving" in str(e.value)
    assert [drv.state(p) for p in pids] == ["RUNNING"] * 2
    # Without the device mapping the same ranks pass.
    with ranks.checkpoint_ranks(pids[1:], api=api, nvml_path=str(built.full), device_prefix=prefix):
        assert drv.state(pids[1]) == "CHECKPOINTED"


def test_a_process_with_only_the_device_files_open_is_not_a_rank(drv, built):
    """An NVML client (nvmlInit opens /dev/nvidiactl and /dev/nvidia0, maps nothing) holds no
    CUDA context: it must not be locked or checkpointed as a rank."""
    dev = drv.root / "dev" / "nvidia0"
    dev.write_bytes(b"\0" * 4096)
    code = (f"f = open({str(dev)!r}, 'rb')\nprint('ready', flush=True)\nimport time; time.sleep(600)\n")
    opener = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    drv.children.append(opener)
    assert opener.stdout.readline().strip() == "ready"
    mapper = drv.spawn(map_device=True)
    prefix = str(drv.root / "dev" / "nvidia")
    assert ranks.opens_gpu_device(opener.pid, prefix) and not ranks.maps_gpu_device(opener.pid, prefix)
    assert ranks.maps_gpu_device(mapper.pid, prefix)
    found = ranks.gpu_rank_pids(os.getpid(), device_prefix=prefix, nvml_path=str(built.full))
    assert mapper.pid in found and opener.pid not in found


def test_the_gpu_map_names_only_the_checkpointed_gpus(api, drv, built):
    other0 = "GPU-aaaaaaaa-2222-3333-4444-555555555500"
    # The source host had GPU0 and GPU1; the ranks used only GPU1; the target host has one GPU.
    assert ranks.default_gpu_pairs([GPU0, GPU1], [other0], checkpointed=[GPU1]) == {GPU1: other0}
    assert ranks.default_gpu_pairs([GPU0, GPU1], [GPU1], checkpointed=[GPU1]) is None
    with pytest.raises(CheckpointError):
        ranks.default_gpu_pairs([GPU0, GPU1], [other0])  # the old behaviour: both GPUs asked for
    # restore_ranks cuts a wider map down to the checkpointed GPUs before it reaches the driver.
    pids, snap = _checkpointed(api, drv, built, [GiB])
    assert set(snap.gpu_bytes) == {GPU0}
    passed = []
    real_restore = api.restore
    api.restore = lambda pid, pairs=None: (passed.append(pairs), real_restore(pid, pairs))[1]
    ranks.restore_ranks(pids, {GPU0: GPU1, GPU1: GPU0}, snap.gpu_bytes, api=api, nvml_path=str(built.full))
    assert passed == [{GPU0: GPU1}]
    assert drv.proc(pids[0])["gpu"] == 1 and drv.state(pids[0]) == "RUNNING"
    # A map that lacks a checkpointed GPU is refused before any restore.
    pids, snap = _checkpointed(api, drv, built, [GiB])
    with pytest.raises(ranks.RankCheckpointError) as e:
        ranks.restore_ranks(pids, {GPU1: GPU0}, snap.gpu_bytes, api=api, nvml_path=str(built.full))
    assert "lacks checkpointed GPUs" in str(e.value)
    assert [x for x in drv.events("restore") if x[3] in pids] == []
