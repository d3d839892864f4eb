"""The rank model (warmctl/checkpoint/layout.py): sizes from vLLM's flags, the CPU build's
per-rank binding, the catalog's "ranks" rule, and ranks found in a real process tree before a
real CRIU dump and checked after its restore (a killed rank named, with its log lines)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from warmctl.naming.catalog import check
from warmctl.checkpoint import affinity, criu, layout
from warmctl.checkpoint.layout import RankError, Sizes, check_binding, default_binding, sizes_of
from warmctl.base.errors import HostError
from warmctl.host import CpuInfo, HostFingerprint
from warmctl.records.manifest import ParallelLayout, RestoreInfo
from warmctl.base.proc import ProcessId, kill_tree
from warmctl.records.profile import Profile, ProfileError, load_profile_file

from conftest import REPO
from tests.ports import free_port


def test_sizes_from_vllm_flags_in_every_spelling():
    assert sizes_of(["--seed", "0"]) == Sizes()
    assert sizes_of(["--tensor-parallel-size", "2"]) == Sizes(tp=2)
    assert sizes_of(["-tp", "4", "-pp=2", "--enable-expert-parallel"]) == Sizes(tp=4, pp=2, ep=True)
    assert sizes_of(["--data-parallel-size=2", "-tp", "2", "-ep"]).ep_size == 4
    with pytest.raises(ValueError, match="--tensor-parallel-size 'two'"):
        sizes_of(["--tensor-parallel-size", "two"])
    with pytest.raises(ValueError, match="-pp needs a value"):
        sizes_of(["-pp"])


def test_roles_follow_vllms_process_titles():
    assert Sizes().roles() == ["EngineCore"]
    assert Sizes(tp=2).roles() == ["Worker_TP0", "Worker_TP1"]
    assert Sizes(tp=2, pp=2).roles() == ["Worker_PP0_TP0", "Worker_PP0_TP1", "Worker_PP1_TP0", "Worker_PP1_TP1"]
    assert Sizes(tp=2, ep=True).roles() == ["Worker_TP0_EP0", "Worker_TP1_EP1"]
    assert Sizes(dp=2).roles() == ["EngineCore_DP0", "EngineCore_DP1"]
    assert Sizes(tp=2, ep=True).describe() == "TP2, EP2" and Sizes(tp=2, pp=2).describe() == "TP2 x PP2"


def test_default_binding_splits_the_usable_cpus_and_refuses_too_few():
    assert default_binding(2, {0, 1}) == "0|1"
    assert default_binding(2, {0, 1, 2, 3, 4}) == "0-2|3-4"
    assert default_binding(2, {4, 6}) == "4|6"
    with pytest.raises(HostError, match="2 ranks need a CPU each; warmctl may use only 1 .CPUs 3."):
        default_binding(2, {3})


def test_a_binding_the_host_cannot_satisfy_names_the_ranks_and_cpus():
    tp2 = Sizes(tp=2)
    assert check_binding("0|1", tp2, {0, 1}) == []
    assert check_binding("nobind", tp2, {0}) == []
    [p] = check_binding("0|1|2", tp2, {0, 1, 2})
    assert "3 CPU list(s) for 2 rank(s)" in p and "Worker_TP0, Worker_TP1" in p
    [p] = check_binding("0|5", tp2, {0, 1})
    assert "rank Worker_TP1 is bound to CPU(s) 5" in p and "usable: 0-1" in p
    [p] = check_binding("0-1|1", tp2, {0, 1})
    assert "ranks Worker_TP0 and Worker_TP1 are both bound to CPU 1" in p


def _profile(tmp_path, args: str, env: str = "") -> Profile:
    text = (REPO / "profiles" / "tiny-tp2.toml").read_text()
    text = text.replace('args = ["--seed", "0", "--tensor-parallel-size", "2"]', f"args = {args}")
    text = text.replace('HF_HUB_OFFLINE = "1"', f'HF_HUB_OFFLINE = "1"\n{env}')
    (tmp_path / "p.toml").write_text(text)
    return load_profile_file(tmp_path / "p.toml")


def test_cpu_binding_of_a_profile(tmp_path):
    tp2 = _profile(tmp_path, '["--tensor-parallel-size", "2"]')
    b = layout.cpu_binding(tp2, {0, 1})
    assert (b.value, b.source, b.env()) == ("0|1", "default", {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    with pytest.raises(HostError, match="TP2 on the CPU build: 2 ranks need a CPU each.*Worker_TP0, Worker_TP1"):
        layout.cpu_binding(tp2, {0})
    given = _profile(tmp_path, '["-tp", "2"]', 'VLLM_CPU_OMP_THREADS_BIND = "1|0"')
    assert layout.cpu_binding(given, {0, 1}) == layout.Binding("1|0", "profile")
    assert layout.cpu_binding(given, {0, 1}).env() == {}  # the profile's own reaches the engine by engine.env
    bad = _profile(tmp_path, '["-tp", "2"]', 'VLLM_CPU_OMP_THREADS_BIND = "0|7"')
    with pytest.raises(HostError, match="engine.env.VLLM_CPU_OMP_THREADS_BIND cannot be satisfied.*Worker_TP1.*CPU.s. 7"):
        layout.cpu_binding(bad, {0, 1})
    one = _profile(tmp_path, '["--seed", "0"]')
    assert layout.cpu_binding(one, {0}).source == "none"  # one rank: vLLM's own auto binding


def test_a_bad_parallel_flag_is_a_profile_error_naming_the_field(tmp_path):
    with pytest.raises(ProfileError, match="engine.args.*--tensor-parallel-size '0'"):
        _profile(tmp_path, '["--tensor-parallel-size", "0"]')


def test_profile_check_shows_the_ranks_and_their_binding(tmp_path):
    from conftest import warmctl

    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")}
    env["PYTHONPATH"] = str(REPO)
    r = warmctl("profile", "check", "tiny-tp2", env=env, timeout=60)
    assert "TP2: 2 ranks (Worker_TP0, Worker_TP1)" in r.stdout and "VLLM_CPU_OMP_THREADS_BIND=" in r.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text((REPO / "profiles" / "tiny-tp2.toml").read_text().replace(
        'HF_HUB_OFFLINE = "1"', 'HF_HUB_OFFLINE = "1"\nVLLM_CPU_OMP_THREADS_BIND = "0|4095"'))
    r = warmctl("profile", "check", str(bad), env=env, check=False, timeout=60)
    assert r.returncode == 1 and "rank Worker_TP1 is bound to CPU(s) 4095" in r.stderr


def _fp(**kw) -> HostFingerprint:
    return HostFingerprint(arch="x86_64", kernel="6", cpu=CpuInfo(flags=["avx2"]), **kw)


def test_the_catalog_refuses_a_host_that_cannot_give_every_rank_its_cpus():
    snap = _fp(cpus_allowed="0-1", rank_cpus={"Worker_TP0": "0", "Worker_TP1": "1"})
    assert check(snap, _fp(cpus_allowed="0-3")) is None
    rule, reason = check(snap, _fp(cpus_allowed="0"))
    assert rule == "ranks" and "rank Worker_TP1 ran on CPU(s) 1, this host offers 0" in reason
    assert check(_fp(), _fp(cpus_allowed="0")) is None  # a snapshot without bound ranks: no rule
    assert "rank_cpus" not in _fp().model_dump(mode="json")  # older fingerprints keep their bytes


def test_the_layout_round_trips_in_the_manifest():
    lay = ParallelLayout(tp=2, world_size=2, ranks=[{"rank": 0, "role": "Worker_TP0", "nspid": 23, "cpus": "0"},
                                                    {"rank": 1, "role": "Worker_TP1", "nspid": 24, "cpus": "1"}],
                         cpu_bind="0|1", cpu_bind_source="default", network_lock="nftables")
    r = RestoreInfo(layout=lay)
    back = RestoreInfo.model_validate_json(r.model_dump_json())
    assert back == r and back.layout.describe() == "TP2 (Worker_TP0 ns-pid 23 CPU 0, Worker_TP1 ns-pid 24 CPU 1)"
    assert "gpu" not in back.model_dump(mode="json")["layout"]["ranks"][0]  # only what was recorded
    with pytest.raises(ValueError, match="not a CPU list"):
        ParallelLayout(world_size=1, ranks=[{"rank": 0, "role": "EngineCore", "nspid": 2, "cpus": "x"}])


# --- real processes, real CRIU -----------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")
_RANK = "taskset -c {cpu} bash -c 'echo \"(Worker_TP{i} pid=$$) INFO rank {i} up\"; exec -a VLLM::Worker_TP{i} sleep 1000' &"


def _ranks_tree(tmp_path):
    """A tree in its own PID namespace with two processes titled like vLLM's TP ranks, bound to
    CPUs 0 and 1 (the last allowed CPU when there is one only), logging like vLLM's workers."""
    cpus = sorted(os.sched_getaffinity(0))
    script = " ".join(_RANK.format(i=i, cpu=cpus[min(i, len(cpus) - 1)]) for i in range(2)) + " wait"
    log = open(tmp_path / "engine.log", "ab")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", "bash", "-c", script], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = psutil.Process(p.pid).children()
        if kids and len(layout.live_ranks(kids[0].pid)) == 2:
            return p, kids[0].pid
        time.sleep(0.05)
    raise AssertionError("the rank processes did not start")


@needs_root
def test_ranks_found_before_the_dump_and_checked_after_the_restore(tmp_path):
    launcher, root = _ranks_tree(tmp_path)
    tp2 = Sizes(tp=2)
    live = layout.discover(root, tp2, tmp_path / "engine.log")
    assert [r.role for r in live] == ["Worker_TP0", "Worker_TP1"] and all(r.nspid > 1 for r in live)
    lay = layout.record(live, tp2, layout.Binding("0|1", "default"), "nftables")
    bound = affinity.record(root)
    criu.dump(root, tmp_path / "img")
    launcher.wait(10)
    new_root, _ = criu.restore(tmp_path / "img", tmp_path / "pid")
    try:
        affinity.apply(new_root, bound)  # CRIU restores no affinity; up puts it back first
        back = layout.check_restored(new_root, lay, tmp_path / "engine.log")
        assert set(back) == {"Worker_TP0", "Worker_TP1"} and all(psutil.pid_exists(p) for p in back.values())
        os.kill(back["Worker_TP1"], signal.SIGKILL)  # one rank dies after the restore
        time.sleep(0.3)
        with pytest.raises(RankError) as e:
            layout.check_restored(new_root, lay, tmp_path / "engine.log")
        msg = str(e.value)
        assert e.value.ranks == ["Worker_TP1"] and "rank Worker_TP1" in msg and f"namespace pid {lay.ranks[1].nspid}" in msg
        assert "(Worker_TP1 pid=" in msg and "rank 1 up" in msg  # its own log lines
    finally:
        kill_tree(ProcessId.of(new_root))


@needs_root
def test_a_missing_rank_before_the_dump_is_named_with_its_log_lines(tmp_path):
    launcher, root = _ranks_tree(tmp_path)
    try:
        victim = layout.live_ranks(root)["Worker_TP0"].pid
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.3)
        with pytest.raises(RankError) as e:
            layout.discover(root, Sizes(tp=2), tmp_path / "engine.log")
        assert e.value.ranks == ["Worker_TP0"] and "rank Worker_TP0 is not running" in str(e.value)
        assert "rank 0 up" in str(e.value) and "ranks present: Worker_TP1" in str(e.value)
    finally:
        kill_tree(ProcessId.of(root))
        launcher.wait(10)


def test_a_port_the_snapshot_listened_on_is_checked_free_before_a_restore(tmp_path):
    srv = subprocess.Popen([os.sys.executable, "-c", "import socket,time; s=socket.socket(); s.bind(('127.0.0.1', 0)); "
                            "s.listen(); print(s.getsockname()[1], flush=True); time.sleep(60)"],
                           stdout=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline())
        assert ("127.0.0.1", port) in layout.listening(srv.pid)
        free = free_port()
        lay = ParallelLayout(tp=2, world_size=2, listen=[f"127.0.0.1:{free}", f"127.0.0.1:{port}"])
        with pytest.raises(HostError) as e:  # another process holds what the restore would bind
            layout.require_ports_free(lay, "snapshot tiny-tp2 (TP2)")
        msg = str(e.value)
        assert msg.startswith("snapshot tiny-tp2 (TP2): 1 of the 2 ports its tree listened on is taken here: ")
        assert f"127.0.0.1:{port} is already in use (by pid {srv.pid}" in msg and f"127.0.0.1:{free}" not in msg.split(". A restore")[0]
        assert re.search(rf"sysctl -w net\.ipv4\.ip_local_reserved_ports=\S*\b{min(free, port)},{max(free, port)} ", msg)
    finally:
        srv.kill()
        srv.wait()
    layout.require_ports_free(lay, "snapshot tiny-tp2 (TP2)")  # free again: no error


def test_the_reserve_command_keeps_what_was_reserved_and_no_autobind_gets_its_ports():
    """The command a refused restore gives (:func:`warmctl.base.ports.reserve_command`), run in
    a network namespace of its own (the host's list is left alone) whose ephemeral range is four
    ports: the port reserved before stays reserved, and ``bind`` to port 0 gets only the one
    port left, while an explicit bind (as CRIU's) still gets a reserved one."""
    py = sys.executable
    script = f"""set -e
ip link set lo up
sysctl -qw net.ipv4.ip_local_port_range="40000 40003"
sysctl -qw net.ipv4.ip_local_reserved_ports=40003
sh -c "$({py} -c 'from warmctl.base.ports import reserve_command; print(reserve_command([40001, 40000]))')" >/dev/null
cat /proc/sys/net/ipv4/ip_local_reserved_ports
{py} -c '
import socket
got = set()
for _ in range(20):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); got.add(s.getsockname()[1])
with socket.socket() as s:
    s.bind(("127.0.0.1", 40000))
print(sorted(got))'
"""
    r = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["40000-40001,40003", "[40002]"], r.stdout


def test_cpu_workers_read_their_memory_affinity_from_proc_self_in_the_pid_namespace():
    """vLLM's CPU worker reads /proc/{os.getpid()}/status; in the engine's PID namespace that is
    a namespace PID looked up in the host's /proc (another process, or none: the worker died
    with FileNotFoundError at TP2). The engine's PYTHONPATH leads with warmctl's fix."""
    import sys

    from warmctl.engine.cold import NSPROC_DIR, launch_env

    code = ("import os; os.getpid = lambda: 4000000\n"  # a namespace PID the host's /proc lacks
            "from vllm.utils.cpu_resource_utils import get_visible_memory_node; print(get_visible_memory_node())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # both interpreters side by side (each imports vLLM: seconds)
    bare_p, fixed_p = (subprocess.Popen([sys.executable, "-c", code], env=e, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                       for e in (env, {**env, "PYTHONPATH": str(NSPROC_DIR)}))
    (_, bare_err), (fixed_out, fixed_err) = bare_p.communicate(timeout=120), fixed_p.communicate(timeout=120)
    assert bare_p.returncode != 0 and "No such file or directory: '/proc/4000000/status'" in bare_err
    assert fixed_p.returncode == 0, fixed_err
    assert fixed_out.strip().startswith("[") and fixed_out.strip() != "[]"
    prof = load_profile_file(REPO / "profiles" / "tiny-tp2.toml")
    assert launch_env(prof, {"PYTHONPATH": "/x"})["PYTHONPATH"] == f"{NSPROC_DIR}:/x"


@needs_root
def test_snapshot_on_a_host_without_a_network_lock_stops_before_the_engine_starts(tmp_path):
    """A TP2 snapshot needs CRIU's network lock: with a CRIU whose nftables check fails and no
    iptables-restore on PATH, `warmctl snapshot tiny-tp2` fails in pre-flight (exit 10), in
    seconds, with nothing started."""
    import sys
    import time as t

    from conftest import isolated_env, tp2_env, warmctl

    fake = tmp_path / "bin" / "criu"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "Version: 4.2.1"; exit 0; }\nexit 1\n')
    fake.chmod(0o755)
    env = tp2_env(isolated_env(tmp_path / "w", 18997, 18998), 18997, 18998)
    env.update(WARMCTL_CRIU=str(fake), PATH=f"{fake.parent}:{os.path.dirname(sys.executable)}:/usr/bin:/bin")
    t0 = t.monotonic()
    r = warmctl("snapshot", "tiny-tp2", env=env, check=False, timeout=120)
    assert r.returncode == 10, r.stderr
    assert "profile tiny-tp2 (TP2) holds established TCP connections" in r.stderr and "iptables" in r.stderr
    assert t.monotonic() - t0 < 30 and not (tmp_path / "w" / "home" / "run" / "tiny-tp2" / "engine.log").exists()


def test_builtin_models_have_their_own_directories(tmp_path):
    from warmctl.models import builtinmodels, tinymodel

    llama, moe = (builtinmodels.builtin_dir(m, tmp_path) for m in ("builtin:tiny", "builtin:tiny-moe"))
    assert llama == tinymodel.model_dir(tmp_path) and llama.name.startswith("tiny-llama-")
    assert moe.name.startswith("tiny-moe-") and moe != llama
    assert builtinmodels.builtin_dir("/models/x", tmp_path) is None


@needs_root
def test_a_one_rank_engine_with_a_worker_process_is_found_as_worker(tmp_path):
    """vLLM 0.32's CPU build runs a TP1 engine's rank in a process titled VLLM::Worker."""
    script = "bash -c 'exec -a VLLM::EngineCore sleep 1000' & bash -c 'exec -a VLLM::Worker sleep 1000' & wait"
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", "bash", "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            kids = psutil.Process(p.pid).children()
            if kids and len(layout.live_ranks(kids[0].pid)) == 1 and "Worker" in layout.live_ranks(kids[0].pid):
                break
            time.sleep(0.05)
        [r] = layout.discover(kids[0].pid, Sizes())
        assert r.role == "Worker" and r.nspid > 1
    finally:
        kill_tree(ProcessId.of(kids[0].pid))
        p.wait(10)


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until the kernel shows it stopped (delivery takes a moment)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while not layout.stopped(pid) and time.monotonic() < deadline:
        time.sleep(0.01)


@needs_root
def test_a_stopped_rank_before_the_dump_is_named_after_its_grace(tmp_path):
    """A rank stopped (SIGSTOP: its peers would wait on it in the all-reduce) is refused before
    the dump once it has stayed stopped STOP_GRACE_S; one continued within the grace is not."""
    launcher, root = _ranks_tree(tmp_path)
    try:
        tp1 = layout.live_ranks(root)["Worker_TP1"].pid
        _stop(tp1)
        t0 = time.monotonic()
        with pytest.raises(RankError) as e:
            layout.discover(root, Sizes(tp=2), tmp_path / "engine.log", stop_grace_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 3
        assert e.value.ranks == ["Worker_TP1"] and f"rank Worker_TP1 (pid {tp1}) is stopped (state T)" in str(e.value)
        threading.Timer(0.2, os.kill, (tp1, signal.SIGCONT)).start()  # continued within the grace: fine
        assert [r.role for r in layout.discover(root, Sizes(tp=2), stop_grace_s=2)] == ["Worker_TP0", "Worker_TP1"]
    finally:
        kill_tree(ProcessId.of(root))
        launcher.wait(10)


@needs_root
def test_the_watch_names_a_dead_rank_at_once_and_a_stopped_one_after_its_grace(tmp_path):
    launcher, root = _ranks_tree(tmp_path)
    try:
        watch = layout.RankWatch(root, Sizes(tp=2), tmp_path / "engine.log", stop_grace_s=0.4)
        assert watch.problem() is None
        tp0 = layout.live_ranks(root)["Worker_TP0"].pid
        _stop(tp0)
        assert watch.problem() is None  # stopped, not yet for its grace
        time.sleep(0.5)
        err = watch.problem()
        assert err is not None and err.ranks == ["Worker_TP0"] and "is stopped (state T) for 0." in str(err)
        assert "during the warm-up" in str(err) and watch.problem() is err  # the first problem is kept

        os.kill(tp0, signal.SIGCONT)
        watch2 = layout.RankWatch(root, Sizes(tp=2), tmp_path / "engine.log")
        tp1 = layout.live_ranks(root)["Worker_TP1"].pid
        os.kill(tp1, signal.SIGKILL)
        time.sleep(0.2)
        err = watch2.problem("the canary record")
        assert err is not None and err.ranks == ["Worker_TP1"] and f"rank Worker_TP1 (pid {tp1}) died during the canary record" in str(err)
        assert "rank 1 up" in str(err)  # its log lines
    finally:
        kill_tree(ProcessId.of(root))
        launcher.wait(10)


_BUSY_RANK = ("taskset -c {cpu} bash -c 'echo \"(Worker_TP0 pid=$$) INFO rank 0 up\"; "
              "exec -a VLLM::Worker_TP0 {python} {script}' &")
#: A rank computing slowly: 10 ms of CPU time, then 20 ms asleep, over and over. The slice is
#: CPU time, not a fixed amount of work, so the rank's ticks grow on any host: a fixed
#: ``sum(range(30000))`` (about 0.5 ms, 2 clock ticks a second) went 1.2 s without a tick on
#: the 2-core AMD VM at load 16, and the watch rightly named it silent.
_BUSY = ("import time\nwhile True:\n    t = time.process_time()\n    while time.process_time() - t < 0.01:\n"
         "        pass\n    time.sleep(0.02)\n")


def _working_and_silent_tree(tmp_path):
    """Like :func:`_ranks_tree`, but Worker_TP0 works (:data:`_BUSY`: 10 ms of CPU time in every
    30 ms or so, as a rank computing slowly on a loaded host) while Worker_TP1 sleeps: alive, not
    stopped, silent."""
    cpus = sorted(os.sched_getaffinity(0))
    (tmp_path / "busy.py").write_text(_BUSY)
    script = (_BUSY_RANK.format(cpu=cpus[0], python=sys.executable, script=tmp_path / "busy.py") + " "
              + _RANK.format(i=1, cpu=cpus[min(1, len(cpus) - 1)]) + " wait")
    log = open(tmp_path / "engine.log", "ab")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", "bash", "-c", script], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = psutil.Process(p.pid).children()
        if kids and len(layout.live_ranks(kids[0].pid)) == 2:
            return p, kids[0].pid
        time.sleep(0.05)
    kill_tree(ProcessId.of(p.pid))
    raise AssertionError("the rank processes did not start")


@needs_root
def test_the_watch_names_a_silent_rank_only_while_requests_are_in_flight(tmp_path):
    """A rank alive and running (state S) but using no CPU time is named once it has been silent
    ``silence_s`` while requests are in flight (between busy() and idle()); the rank that works,
    however slowly, never is; silence outside requests is not counted; 0 turns the watch off."""
    launcher, root = _working_and_silent_tree(tmp_path)
    try:
        tp1 = layout.live_ranks(root)["Worker_TP1"].pid
        # 2 s, not less: a working rank that a loaded host leaves without a clock tick for 1.2 s was
        # named silent at 1 s (the 2-core AMD VM, load 16)
        watch = layout.RankWatch(root, Sizes(tp=2), tmp_path / "engine.log", silence_s=2.0)
        off = layout.RankWatch(root, Sizes(tp=2), tmp_path / "engine.log", silence_s=0)
        off.busy()
        t_end = time.monotonic() + 2.6  # no request in flight: silence is not counted
        while time.monotonic() < t_end:
            assert watch.problem() is None and off.problem() is None
            time.sleep(0.1)
        watch.busy()
        t0 = time.monotonic()
        err = None
        while err is None and time.monotonic() - t0 < 10:
            err = watch.problem("the canary record")
            assert off.problem() is None
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert err is not None and 2.0 <= took < 5.0, took
        assert err.ranks == ["Worker_TP1"], err  # the working rank is not blamed
        msg = str(err)
        assert f"rank Worker_TP1 (pid {tp1}) is alive (state S) but silent: it used no CPU time for 2." in msg, msg
        assert "during the canary record" in msg and "rank_silence_s = 2 s" in msg and "rank 1 up" in msg
        watch2 = layout.RankWatch(root, Sizes(tp=2), silence_s=1.0)
        watch2.busy()
        time.sleep(0.5)
        watch2.problem()
        watch2.idle()  # the request ended before the silence was long enough: forgotten
        time.sleep(1.2)
        assert watch2.problem() is None
    finally:
        kill_tree(ProcessId.of(root))
        launcher.wait(10)


@needs_root
def test_the_fault_hook_kills_or_stops_each_rank_it_names(tmp_path, monkeypatch):
    from warmctl.checkpoint import rankfaults

    launcher, root = _ranks_tree(tmp_path)
    try:
        ranks = layout.live_ranks(root)
        monkeypatch.setenv(rankfaults.RANK_ENV, "before_dump:Worker_TP0, before_dump:Worker_TP1:STOP,ranks:Worker_TP1")
        assert rankfaults.kill_rank("warmup", root) == []  # another point: nothing
        assert rankfaults.kill_rank("before_dump", root) == [ranks["Worker_TP0"].pid, ranks["Worker_TP1"].pid]
        assert not layout.pid_alive(ranks["Worker_TP0"].pid) and layout.stopped(ranks["Worker_TP1"].pid)
    finally:
        kill_tree(ProcessId.of(root))
        launcher.wait(10)


@needs_root
def test_a_rank_killed_by_the_hook_while_criu_dumps_fails_the_dump_and_is_named(tmp_path, monkeypatch):
    """The ``dump`` point: a real SIGKILL of Worker_TP1 once CRIU has seized the tree (its
    TracerPid is CRIU); CRIU's dump then fails (it cannot finish a task that died), the rest of
    the tree is resumed, and :func:`layout.died` names the rank with its log lines."""
    from warmctl.checkpoint import rankfaults
    from warmctl.base.errors import CheckpointError

    monkeypatch.setenv(rankfaults.RANK_ENV, "before_dump:Worker_TP0,dump:Worker_TP1")
    for attempt in range(5):
        # A small tree's dump can end before the hook's thread, polling every 2 ms, sees the
        # seize (a loaded host delays the thread): the dump then succeeds and kills the tree,
        # and the attempt is made again with a new tree. What is asserted below is what follows
        # a kill that landed; five misses in a row fail the test. A kill that lands while CRIU
        # still collects the tree leaves a zombie that CRIU dumps without error: then the
        # images must show it dead (criu.dumped_dead, what the snapshot pipeline refuses).
        launcher, root = _ranks_tree(tmp_path)
        before = list(layout.live_ranks(root).values())
        tp1, tp1_ns = layout.live_ranks(root)["Worker_TP1"].pid, layout.live_ranks(root)["Worker_TP1"].nspid
        img = tmp_path / f"img{attempt}"
        try:
            with rankfaults.kill_rank_during_dump(root) as killed:
                criu.dump(root, img)
        except CheckpointError as err:
            e = err
            break
        except BaseException:
            kill_tree(ProcessId.of(root))
            raise
        if killed:
            assert criu.dumped_dead(img, [tp1_ns]) == [tp1_ns], "a rank killed, the dump succeeded, its images show it alive"
        launcher.wait(10)
    else:
        raise AssertionError("the hook's kill missed five dumps in a row")
    try:
        assert killed == [tp1] and not layout.pid_alive(tp1)
        assert "criu dump of pid" in str(e) and "Dumping FAILED" in str(e), e
        # CRIU met the dead task ("Task N ...", or "Unable to detach from N" when it died later)
        assert re.search(rf"\b{tp1}\b", (img / "dump.log").read_text()), (img / "dump.log").read_text()
        assert set(layout.live_ranks(root)) == {"Worker_TP0"}  # the survivor runs on (CRIU resumed it)
        assert not layout.stopped(layout.live_ranks(root)["Worker_TP0"].pid)
        err = layout.died(root, "TP2", before, "the CRIU dump", tmp_path / "engine.log")
        assert err is not None and err.ranks == ["Worker_TP1"]
        assert f"TP2 engine (pid {root}): rank Worker_TP1 (pid {tp1}) died during the CRIU dump" in str(err)
        assert "rank 1 up" in str(err) and "Worker_TP0" not in str(err)  # its own log lines, not its peer's
        assert layout.died(root, "TP2", before[:1], "the CRIU dump") is None  # a live rank: nothing

        monkeypatch.setenv(rankfaults.RANK_ENV, "before_dump:Worker_TP0")  # no dump point: no thread, nothing killed
        with rankfaults.kill_rank_during_dump(root) as killed:
            pass
        assert killed == [] and set(layout.live_ranks(root)) == {"Worker_TP0"}
    finally:
        kill_tree(ProcessId.of(root))
        launcher.wait(10)
