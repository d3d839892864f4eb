"""Property-based tests of the agent against its published OpenAPI document (schemathesis):
a real uvicorn on loopback over an empty data directory; every generated request, with and
without the token, must get an answer the document allows -- and never a 5xx.

The two operations that start engines (``POST /v1/engines/{name}/up`` and
``POST /v1/snapshots``) are left out: a generated name could cold-start a real engine. The
e2e tests cover them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.test_agent_api import TOKEN, LiveAgent

REPO = Path(__file__).resolve().parent.parent
schema = schemathesis.openapi.from_path(str(REPO / "docs" / "openapi.json"))


@pytest.fixture(scope="module")
def live_agent(tmp_path_factory):
    a = LiveAgent(tmp_path_factory.mktemp("agent-schema") / "home")
    yield a
    a.stop()


@schema.exclude(method="POST", path="/v1/engines/{name}/up").exclude(method="POST", path="/v1/snapshots").parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case, live_agent):
    case.call_and_validate(base_url=live_agent.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)


@schema.exclude(method="POST", path="/v1/engines/{name}/up").exclude(method="POST", path="/v1/snapshots").parametrize()
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
def test_without_token_every_v1_call_is_401(case, live_agent):
    r = case.call(base_url=live_agent.url, timeout=30)
    assert r.status_code < 500, r.text
    documented = case.method.lower() in schema.raw_schema["paths"][case.path]
    if documented and (case.path.startswith("/v1/") or case.path == "/metrics"):
        assert r.status_code == 401, (case.method, case.formatted_path, r.status_code, r.text)
