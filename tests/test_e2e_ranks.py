"""Every rank, for real: the ``tiny-tp2`` profile (tensor parallel 2 on the CPU build of vLLM:
two worker processes, a gloo group over loopback TCP, a shared-memory all-reduce) snapshotted
with real CRIU and restored, with nothing set by hand (warmctl binds the ranks' CPUs and picks
CRIU's network lock).

One session snapshot (``tp2_snapshot``) serves every test here: the layout recorded; the
restore serving a chat completion, with ``status`` naming both ranks; node B restoring it from
a directory remote with its own home and key. A rank killed or stopped at each point of the
pipeline (warm-up, dump, before the dump, after the restore) is warmctl's orchestration, tested
on the fake engine's TP2 tree under the same real CRIU: tests/test_e2e_rank_faults.py.
"""

from __future__ import annotations

import json
import os
import socket

import httpx
import pytest
from tests.conftest import listening, ls_row, node_b_env, rank_procs, shm_leaked, shm_names, tp2_env, up_restore, warmctl

from warmctl.checkpoint.affinity import parse_cpu_list

pytestmark = pytest.mark.e2e

ROLES = ["Worker_TP0", "Worker_TP1"]


@pytest.fixture(scope="module")
def a(wc_env, engine_ports, tp2_snapshot) -> dict[str, str]:
    env = tp2_env(wc_env, *engine_ports)
    yield env
    warmctl("down", "tiny-tp2", env=env, check=False)


def _rank_procs() -> dict[str, list[int]]:
    return rank_procs(ROLES)


def _up(env, *args: str, check: bool = True):
    return up_restore(env, "tiny-tp2", *args, check=check)


def _layout(env) -> dict:
    return ls_row(env, "tiny-tp2")


def test_the_snapshot_records_both_ranks_their_cpus_and_the_network_lock(a, tp2_snapshot):
    assert "VLLM_CPU_OMP_THREADS_BIND=" in tp2_snapshot["stderr"]  # warmctl's default binding, said
    row = _layout(a)
    lay = row["layout"]
    assert row["digest"] == tp2_snapshot["digest"]
    assert (lay["tp"], lay["pp"], lay["dp"], lay["ep"], lay["world_size"]) == (2, 1, 1, 1, 2)
    assert [r["role"] for r in lay["ranks"]] == ROLES and [r["rank"] for r in lay["ranks"]] == [0, 1]
    assert len({r["nspid"] for r in lay["ranks"]}) == 2 and all(r["nspid"] > 1 for r in lay["ranks"])
    assert lay["cpu_bind_source"] == "default" and lay["cpu_bind"].count("|") == 1
    assert [r["cpus"] for r in lay["ranks"]] == lay["cpu_bind"].split("|")  # each rank on its own CPUs
    assert lay["network_lock"] in ("nftables", "iptables")
    assert row["host"]["rank_cpus"] == {r["role"]: r["cpus"] for r in lay["ranks"]}  # the catalog's ranks rule
    text = warmctl("ls", env=a).stdout
    assert "TP2 (Worker_TP0 ns-pid" in text and "Worker_TP1 ns-pid" in text


def test_up_restores_every_rank_bound_and_serves_through_the_gate(a, engine_ports, tp2_snapshot):
    shm_before = shm_names()
    r, res = _up(a)
    assert res["path"] == "restore" and res["snapshot"] == tp2_snapshot["digest"], r.stderr
    assert "ranks" in res["timings_s"] and "canary" in res["timings_s"]
    [st] = [s for s in json.loads(warmctl("status", "--json", env=a).stdout) if s["name"] == "tiny-tp2"]
    assert st["layout"] == "TP2" and sorted(st["ranks"]) == ROLES and st["healthy"]
    procs = _rank_procs()
    assert procs == {role: [st["ranks"][role]] for role in ROLES}
    lay = _layout(a)["layout"]
    unbound = os.sched_getaffinity(0)
    for rec in lay["ranks"]:  # bound as recorded (CRIU restores no affinity; up put it back)
        pid = st["ranks"][rec["role"]]
        bound = set().union(*[aff for t in os.listdir(f"/proc/{pid}/task")
                              if (aff := os.sched_getaffinity(int(t))) != unbound])
        assert bound == parse_cpu_list(rec["cpus"]), (rec, bound)
    chat = httpx.post(f"http://127.0.0.1:{engine_ports[1]}/v1/chat/completions", timeout=60, json={
        "model": "tiny-tp2", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": "The capital of France is"}]})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"].strip(), chat.text
    table = warmctl("status", env=a).stdout
    assert f"TP2: Worker_TP0 {st['ranks']['Worker_TP0']}, Worker_TP1 {st['ranks']['Worker_TP1']}" in table
    warmctl("down", "tiny-tp2", env=a)
    assert _rank_procs() == {} and not shm_leaked(shm_before)


def test_node_b_restores_the_tp2_snapshot_from_a_directory_remote(a, engine_ports, tp2_snapshot, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2-fleet")
    remote = root / "remote"
    r = warmctl("push", "tiny-tp2", "--to", str(remote), env=a)
    assert f"push tiny-tp2:latest ({tp2_snapshot['digest'][:19]})" in r.stderr
    b = tp2_env(node_b_env(root / "b", a, remote, *engine_ports), *engine_ports)  # its own home and key
    try:
        r, res = _up(b)
        assert res["path"] == "restore" and res["snapshot"] == tp2_snapshot["digest"], r.stderr
        assert res["fetched"]["remote"] > 100 * 2**20, res
        [st] = [s for s in json.loads(warmctl("status", "--json", env=b).stdout) if s["name"] == "tiny-tp2"]
        assert sorted(st["ranks"]) == ROLES and st["healthy"]
        chat = httpx.post(f"http://127.0.0.1:{engine_ports[1]}/v1/completions", timeout=60, json={
            "model": "tiny-tp2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200 and chat.json()["choices"][0]["text"], chat.text
        assert _layout(b)["layout"]["world_size"] == 2  # B's local catalog names it now, layout included
    finally:
        warmctl("down", "tiny-tp2", env=b, check=False)
    assert _rank_procs() == {}
    # One of the ranks' gloo ports (ephemeral, picked on A) held on B, as by a server that got it
    # from the kernel: refused before the restore, naming it, its holder and the sysctl command
    # that reserves every port of the snapshot; nothing starts, the public port stays closed.
    ports = [int(a.rpartition(":")[2]) for a in _layout(b)["layout"]["listen"]]
    gloo = [p for p in ports if p != engine_ports[0] + 2]  # the API server's: the profile's port
    assert len(gloo) >= 2 * 2, ports  # a port per rank and process group, at least world and TP
    with socket.create_server(("127.0.0.1", gloo[0])):
        r = warmctl("up", "tiny-tp2", "--cold-start", "never", env=b, check=False)
    assert r.returncode == 10, r.stderr
    assert f"127.0.0.1:{gloo[0]} is already in use (by pid {os.getpid()}" in r.stderr, r.stderr
    reserve = r.stderr.split("sysctl -w net.ipv4.ip_local_reserved_ports=")[1].split()[0]
    assert set(ports) <= {int(x) for x in reserve.split(",") if x.isdigit()}, r.stderr
    assert _rank_procs() == {} and not listening(engine_ports[1])
