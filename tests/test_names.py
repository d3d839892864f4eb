"""One name rule for the CLI and the agent: a name one accepts, the other
accepts (dots, up to 128 characters), and what one refuses, the other refuses."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from warmctl.agent import create_app
from warmctl.naming.catalog import CatalogError, Ref
from warmctl.records.config import Settings
from warmctl.pipelines.lifecycle import down, status
from warmctl.base.names import NAME_PATTERN, check_name
from warmctl.records.profile import Profile

GOOD = ["tiny", "llama-3.1-8b-instruct", "Qwen2.5-0.5B", "a" * 64 + ".v2", "x" * 128, "7b_chat"]
BAD = ["../x", "..", ".hidden", "a/b", "x" * 129, "", "-dash", "a b", "a$b", "sp\u00e9cial"]


def _agent_get(settings: Settings, path: str) -> int:
    app = create_app(settings, None, run_startup=False)

    async def go() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent") as c:
            return (await c.get(path)).status_code

    return asyncio.run(go())


@pytest.mark.parametrize("name", GOOD)
def test_a_name_the_cli_accepts_the_agent_accepts(tmp_path, name):
    assert Ref.parse(f"{name}:{name}").name == name
    s = Settings(home=tmp_path, keys_dir=tmp_path / "keys")
    assert down(name, s) is None and status(s, name) == []
    assert _agent_get(s, f"/v1/engines/{name}") == 200  # a valid name (an engine not recorded: reported down), not 422
    assert Profile.model_fields["name"].metadata[0].pattern == NAME_PATTERN


@pytest.mark.parametrize("name", BAD)
def test_a_name_the_cli_refuses_the_agent_refuses(tmp_path, name):
    with pytest.raises(CatalogError, match="letter or digit"):
        Ref.parse(name)
    s = Settings(home=tmp_path, keys_dir=tmp_path / "keys")
    with pytest.raises(CatalogError, match="engine name"):
        down(name, s)
    with pytest.raises(ValueError):
        check_name("name", name)
    if "/" not in name and name not in ("", ".."):  # those never reach the route as one path segment
        assert _agent_get(s, f"/v1/engines/{name}") == 422
