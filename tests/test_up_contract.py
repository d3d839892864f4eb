"""The one ``up`` contract (:mod:`warmctl.records.contract`): no path drops or renames a field.

An :class:`UpResult` with every field set to something other than its default (streamed,
lazy_copy, failure, ...) goes through the agent's JSON (a real job on a real uvicorn, followed
over its server-sent events), the client's parser (:meth:`AgentClient.up`) and the CLI's
``--json`` writer (``warmctl up --json`` through the agent, a real subprocess), and must come
out equal, with the keys docs/cli-json.md lists. A failed ``up`` must reach the client and the
CLI with its failure (type, message, exit code): one made up in a job, and a real one (``up``
with ``cold_start`` never and no snapshot).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from tests.conftest import isolated_env, tiny_profile, warmctl
from tests.test_agent_api import TOKEN, LiveAgent
from warmctl.client import AgentClient
from warmctl.records.contract import Failure, UpOptions, UpRequest, UpResult
from warmctl.base.errors import CanaryMismatch, SnapshotNotFound
from warmctl.records.state import EngineState

REPO = Path(__file__).resolve().parent.parent
DIGEST = "sha256:" + "ab" * 32


def _state() -> EngineState:
    return EngineState(name="tiny", phase="serving", source="restore", manifest_digest=DIGEST, root_pid=4242,
                       internal_port=18301, public_host="127.0.0.1", public_port=18381, served_model_name="tiny",
                       log_path="/var/log/tiny.log", timings={"restore": 1.5, "total": 2.0}, restore_pages="lazy",
                       layout="tp=1", ranks={"EngineCore": 4243})


def _full() -> UpResult:
    """Every field of :class:`UpResult` away from its default."""
    return UpResult(name="tiny", source="restore", already_up=True, reason="snapshot made from another profile",
                    snapshot_digest=DIGEST, fetched={"remote": 123, "local": 456},
                    streamed={"files": 7, "bytes": 8_000_000, "waited_s": 0.25}, lazy_copy="running",
                    snapshot_error="the snapshot of tiny:latest failed, nothing of it is named in the catalog; "
                                   "tiny keeps serving from its cold start: FileExistsError: [Errno 17] File exists",
                    timings={"materialize": 1.25, "restore": 0.5, "total": 1.75}, state=_state(),
                    failure=Failure(type="HostError", message="something on this host", exit_code=10))


def _documented_keys() -> set[str]:
    text = (REPO / "docs" / "cli-json.md").read_text()
    sec = text.split("### `up NAME --json`")[1].split("\n### ")[0]
    return set(json.loads(re.search(r"```json\n(.*?)```", sec, re.S).group(1)))


def test_the_full_result_sets_every_field_and_its_document_has_the_documented_keys():
    full = _full()
    for k, f in UpResult.model_fields.items():  # a new field must be added to _full too
        assert getattr(full, k) != f.get_default(call_default_factory=True), f"_full() leaves {k} at its default"
    doc = full.to_json()
    fields = {f.alias or k for k, f in UpResult.model_fields.items()}
    assert set(doc) == _documented_keys() == fields | {"path", "public", "pid", "timings"}
    assert doc["path"] == "already-up" and doc["public"] == "127.0.0.1:18381" and doc["pid"] == 4242
    assert doc["timings"] == doc["timings_s"] == full.timings
    assert doc["streamed"] == {"files": 7, "bytes": 8_000_000, "waited_s": 0.25}
    assert doc["failure"] == {"type": "HostError", "message": "something on this host", "exit_code": 10}
    back = UpResult.from_json(json.loads(json.dumps(doc)))
    assert back == full and back.to_json() == doc


def test_an_older_agents_document_still_parses():
    """The keys an agent wrote before this contract (no ``name``, ``timings_s``, ``failure``)."""
    old = {"source": "cold", "path": "cold", "reason": "no snapshot", "snapshot": None, "fetched": {},
           "streamed": None, "timings": {"total": 3.0}, "state": _state().model_dump(mode="json")}
    res = UpResult.from_json(old)
    assert (res.name, res.source, res.timings, res.already_up, res.failure) == ("tiny", "cold", {"total": 3.0}, False, None)


def test_failed_carries_type_message_and_exit_code():
    res = UpResult.failed("tiny", CanaryMismatch("token 3 differs"))
    assert res.failure == Failure(type="CanaryMismatch", message="token 3 differs", exit_code=3)
    assert res.to_json()["path"] is None and res.to_json()["state"] is None
    e = res.error()
    assert type(e) is CanaryMismatch and str(e) == "token 3 differs" and e.exit_code == 3
    assert UpResult.failed("tiny", ValueError("x")).failure == Failure(type="InternalError", message="ValueError: x")


def test_request_and_options_round_trip():
    req = UpRequest(name="tiny", tag="v2", digest=DIGEST, cold_start="never", port=18381, host="127.0.0.1",
                    snapshot_after=True, insecure=True, allow_rollback=True, restart="on-failure", restart_limit=3)
    for k, f in UpRequest.model_fields.items():
        assert getattr(req, k) != f.get_default(call_default_factory=True), f"the request leaves {k} at its default"
    body = req.options().model_dump(mode="json")
    assert "name" not in body and UpRequest.of("tiny", UpOptions.model_validate(body)) == req
    with pytest.raises(ValueError):
        UpOptions.model_validate({"port": "8080"})  # strict, as the agent's body
    with pytest.raises(ValueError):
        UpOptions.model_validate({"name": "tiny"})  # the name is the path's


@pytest.fixture
def live(tmp_path):
    a = LiveAgent(tmp_path / "home")
    yield a
    a.stop()


def _held_up(live: LiveAgent, outcome) -> tuple[threading.Event, object]:
    """A live ``up`` job of ``tiny`` with the parameters of a default request, which ends with
    ``outcome()`` once someone follows its events: the client's (or the CLI's) POST joins it
    (:meth:`warmctl.agent.service.AgentState.submit`'s ``join_same``), so what comes back went through the
    agent's job result, its event stream and the client's parser."""
    followed = threading.Event()
    jobs = live.agent.jobs
    real = jobs.events_since

    def events_since(job_id, *a, **kw):
        followed.set()
        return real(job_id, *a, **kw)

    jobs.events_since = events_since  # the SSE handler reads it per call

    def run(rep, job):
        assert followed.wait(60), "nobody followed the job"
        return outcome()

    job = jobs.submit("up", "tiny", ["engine:tiny"], run, UpOptions().model_dump())
    return followed, job


def test_every_field_survives_the_agent_and_the_client(live):
    full = _full()
    _held_up(live, full.to_json)
    res = AgentClient(live.url, TOKEN).up(UpRequest(name="tiny"))
    assert res == full
    j = live.http.get("/v1/jobs", params={"state": "succeeded"}).json()[0]
    assert j["result"] == full.to_json()  # the job's result as stored and served is the document


def test_a_failed_job_reaches_the_client_with_its_failure(live):
    def fail():
        raise CanaryMismatch("canary: token 3 differs\nrecorded 17, got 18")

    _held_up(live, fail)
    res = AgentClient(live.url, TOKEN).up(UpRequest(name="tiny"), check=False)
    assert res == UpResult.failed("tiny", CanaryMismatch("canary: token 3 differs\nrecorded 17, got 18"))
    assert res.failure == Failure(type="CanaryMismatch", message="canary: token 3 differs\nrecorded 17, got 18",
                                  exit_code=3)


def _cli_env(live: LiveAgent, tmp_path: Path, engine_ports) -> dict[str, str]:
    env = isolated_env(tmp_path / "cli", *engine_ports)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    return {**env, "WARMCTL_AGENT_URL": live.url, "WARMCTL_AGENT_TOKEN_FILE": str(token)}


def test_the_cli_json_through_the_agent_is_the_same_document(live, tmp_path, engine_ports):
    full = _full()
    _held_up(live, full.to_json)
    r = warmctl("up", "tiny", "--json", env=_cli_env(live, tmp_path, engine_ports), check=False, timeout=120)
    assert json.loads(r.stdout) == full.to_json()
    # a result with a failure exits with the failure's code and says it on stderr
    assert r.returncode == 10 and "error: something on this host" in r.stderr, r.stderr


def test_a_failed_up_through_the_cli_prints_its_failure(live, tmp_path, engine_ports):
    def fail():
        raise CanaryMismatch("canary: token 3 differs")

    _held_up(live, fail)
    r = warmctl("up", "tiny", "--json", env=_cli_env(live, tmp_path, engine_ports), check=False, timeout=120)
    assert r.returncode == 3 and "canary: token 3 differs" in r.stderr, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert doc == UpResult.failed("tiny", CanaryMismatch("canary: token 3 differs")).to_json()


def test_a_real_failed_up_through_the_agent_and_the_client(live, engine_ports):
    """``cold_start`` never, a profile and no snapshot: the agent's ``up`` fails for real; the
    client gets the failure with the agent's message, the same class and exit code."""
    profiles = live.settings.profile_dirs[0]
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "tiny.toml").write_text(tiny_profile(*engine_ports))
    c = AgentClient(live.url, TOKEN)
    res = c.up(UpRequest(name="tiny", cold_start="never"), check=False)
    f = res.failure
    assert f is not None and (f.type, f.exit_code) == ("SnapshotNotFound", 4), res
    assert "no snapshot tiny:latest" in f.message and "not cold-starting tiny: cold_start is 'never' (request)" in f.message
    assert res.state is None and res.to_json()["path"] is None
    with pytest.raises(SnapshotNotFound, match="not cold-starting tiny") as e:
        c.up(UpRequest(name="tiny", cold_start="never"))
    assert e.value.exit_code == 4
    j = live.http.get("/v1/jobs", params={"state": "failed"}).json()[0]
    assert j["params"]["cold_start"] == "never" and Failure.model_validate(j["error"]) == f


def test_a_real_failed_up_of_the_local_cli_prints_its_failure(tmp_path, engine_ports):
    env = isolated_env(tmp_path / "local", *engine_ports)
    r = warmctl("up", "tiny", "--json", "--cold-start", "never", env=env, check=False, timeout=120)
    assert r.returncode == 4, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert set(doc) == _documented_keys() and doc["name"] == "tiny" and doc["state"] is None
    assert doc["failure"]["type"] == "SnapshotNotFound" and doc["failure"]["exit_code"] == 4
    assert "not cold-starting tiny: cold_start is 'never' (flag)" in doc["failure"]["message"]
    assert doc["failure"]["message"].splitlines()[0] in r.stderr


def test_status_through_the_agent_keeps_lazy_copy_and_failure(live):
    """``status`` through the agent (its engine view, the client) gives the rows the library
    gives, ``lazy_copy`` and ``failure`` included (a lazy restore whose daemon is gone, and why
    the gate took the engine down)."""
    from warmctl.engine.run import LAZY_FAILED
    from warmctl.pipelines.lifecycle import status
    from warmctl.records.state import save as save_state

    save_state(live.settings.run_dir, EngineState(
        name="ghost", phase="serving", source="restore", root_pid=2**22 + 7, internal_port=1, public_host="127.0.0.1",
        public_port=2, served_model_name="x", log_path="/dev/null", restore_pages="lazy", lazy_pid=2**22 + 8,
        lazy_ctime=1.0))
    (live.settings.run_dir / "ghost" / LAZY_FAILED).write_text("the lazy-pages daemon exited before its copy ended\n")
    local = status(live.settings)
    assert [(r.lazy_copy, r.failure) for r in local] == [("done", "the lazy-pages daemon exited before its copy ended")]
    assert AgentClient(live.url, TOKEN).status() == local
