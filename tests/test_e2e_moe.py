"""The mixture-of-experts model, for real: ``tiny-moe-tp2`` (``builtin:tiny-moe``, a Mixtral of
4 experts per layer with top-2 routing, built locally like ``builtin:tiny``) at tensor parallel 2
on the CPU build of vLLM, snapshotted with real CRIU and restored with nothing set by hand.

Expert parallel is not run: the CPU build's ranks die of SIGSEGV in its MoE kernel at the first
request with ``--enable-expert-parallel``, so warmctl refuses that flag on the CPU build before
any engine starts (docs/design.md, "Expert parallel"; tests/test_profile.py and
tests/test_profile_cli.py test the refusal). Every rank holds every expert here, its weights
split in two.

One session snapshot (``moe_snapshot``) serves every test here. Order: the layout and the model
recorded; ``up`` restoring both ranks, the canary replayed through the gate bit for bit, a chat
completion, ``status``/``ls`` naming the ranks; node B restoring it from a directory remote with
its own home and key.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tests.conftest import listening, ls_row, node_b_env, rank_env, rank_procs, shm_leaked, shm_names, up_restore, warmctl

from warmctl.records.manifest import Manifest
from warmctl.models.tinymodel import MOE_EXPERTS, MOE_TOP_K

pytestmark = pytest.mark.e2e

NAME = "tiny-moe-tp2"
ROLES = ["Worker_TP0", "Worker_TP1"]


@pytest.fixture(scope="module")
def a(wc_env, engine_ports, moe_snapshot) -> dict[str, str]:
    env = rank_env(wc_env, NAME, *engine_ports)
    yield env
    warmctl("down", NAME, env=env, check=False)


def _manifest(env, digest: str) -> Manifest:
    """The manifest ``digest`` from the local store of the home of ``env`` (its config file)."""
    from warmctl.records.config import load_settings
    from warmctl.store import open_store

    return open_store(load_settings(Path(env["WARMCTL_CONFIG"])).store_dir).get_manifest(digest)


def _status(env) -> dict:
    [st] = [s for s in json.loads(warmctl("status", "--json", env=env).stdout) if s["name"] == NAME]
    return st


def _canary_through_the_gate(env, gate_port: int, digest: str) -> str | None:
    """The snapshot's canary replayed through the public port: :func:`first_difference` of the
    recorded completions (tokens and float logprobs, bit for bit) and what the gate serves now."""
    from warmctl.engine import canary
    from warmctl.records.profile import Profile

    m = _manifest(env, digest)
    spec = Profile.model_validate(m.profile).canary
    return canary.first_difference(m.canary, canary.run(f"http://127.0.0.1:{gate_port}", spec, NAME))


def test_the_moe_snapshot_records_tp2_without_expert_parallel_and_the_moe_model(a, moe_snapshot):
    row = ls_row(a, NAME)
    lay = row["layout"]
    assert row["digest"] == moe_snapshot["digest"]
    assert (lay["tp"], lay["pp"], lay["dp"], lay["ep"], lay["world_size"]) == (2, 1, 1, 1, 2)
    assert [r["role"] for r in lay["ranks"]] == ROLES and [r["rank"] for r in lay["ranks"]] == [0, 1]
    assert len({r["nspid"] for r in lay["ranks"]}) == 2 and lay["cpu_bind_source"] == "default"
    assert [r["cpus"] for r in lay["ranks"]] == lay["cpu_bind"].split("|")
    assert lay["network_lock"] in ("nftables", "iptables")
    head, *rows = warmctl("ls", env=a).stdout.splitlines()
    [cells] = [r.split("\t") for r in rows if r.startswith(f"{NAME}:")]
    ranks = cells[head.split("\t").index("ranks")]  # that column only: the host's is "AMD EPYC" on some
    assert ranks.startswith("TP2 (Worker_TP0 ns-pid") and "Worker_TP1 ns-pid" in ranks and "EP" not in ranks, ranks
    m = _manifest(a, moe_snapshot["digest"])
    assert m.profile["engine"]["model"] == "builtin:tiny-moe" and m.canary.match == "tokens+logprobs"
    assert m.canary.completions and all(c.logprobs and c.top_logprobs for c in m.canary.completions)
    # the engine served the mixture of experts warmctl built: a Mixtral, 4 experts, top-2
    [cfg] = (Path(a["WARMCTL_TEST_HOME"]) / "models").glob("tiny-moe-*/config.json")
    c = json.loads(cfg.read_text())
    assert c["architectures"] == ["MixtralForCausalLM"]
    assert (c["num_local_experts"], c["num_experts_per_tok"]) == (MOE_EXPERTS, MOE_TOP_K) == (4, 2)


def test_up_restores_both_ranks_and_the_canary_matches_through_the_gate(a, engine_ports, moe_snapshot):
    shm_before = shm_names()
    r, res = up_restore(a, NAME)
    assert res["path"] == "restore" and res["snapshot"] == moe_snapshot["digest"], r.stderr
    assert {"restore", "ranks", "canary", "gate"} <= set(res["timings_s"])  # ranks checked before the canary
    st = _status(a)
    assert st["layout"] == "TP2" and sorted(st["ranks"]) == ROLES and st["healthy"]
    assert rank_procs(ROLES) == {role: [st["ranks"][role]] for role in ROLES}
    assert f"TP2: Worker_TP0 {st['ranks']['Worker_TP0']}, Worker_TP1 {st['ranks']['Worker_TP1']}" in \
        warmctl("status", env=a).stdout
    # up's own canary passed; replayed once more through the public port it is still bit for bit
    assert _canary_through_the_gate(a, engine_ports[1], moe_snapshot["digest"]) is None
    chat = httpx.post(f"http://127.0.0.1:{engine_ports[1]}/v1/chat/completions", timeout=60, json={
        "model": NAME, "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the capital of France? One word."}]})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"].strip(), chat.text
    warmctl("down", NAME, env=a)
    assert rank_procs(ROLES) == {} and not listening(engine_ports[1]) and not shm_leaked(shm_before)


def test_node_b_restores_the_moe_snapshot_from_a_directory_remote(a, engine_ports, moe_snapshot, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-fleet")
    remote = root / "remote"
    r = warmctl("push", NAME, "--to", str(remote), env=a)
    assert f"push {NAME}:latest ({moe_snapshot['digest'][:19]})" in r.stderr
    b = rank_env(node_b_env(root / "b", a, remote, *engine_ports), NAME, *engine_ports)  # its own home and key
    try:
        r, res = up_restore(b, NAME)
        assert res["path"] == "restore" and res["snapshot"] == moe_snapshot["digest"], r.stderr
        assert res["fetched"]["remote"] > 100 * 2**20, res
        st = _status(b)
        assert st["layout"] == "TP2" and sorted(st["ranks"]) == ROLES and st["healthy"]
        assert _canary_through_the_gate(b, engine_ports[1], moe_snapshot["digest"]) is None
        lay = ls_row(b, NAME)["layout"]  # B's local catalog names it now, layout included
        assert (lay["tp"], lay["ep"], lay["world_size"]) == (2, 1, 2) and [r["role"] for r in lay["ranks"]] == ROLES
    finally:
        warmctl("down", NAME, env=b, check=False)
    assert rank_procs(ROLES) == {}
