"""Write (or check) the agent's OpenAPI document: ``python -m warmctl.agent.openapi [--check] [PATH]``.

PATH defaults to ``docs/openapi.json`` of the source tree. ``--check`` writes nothing and
exits 1 when the file differs from what the app produces (CI and ``tests/test_agent_api.py``
run it so the published document never goes stale).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def document() -> str:
    """The OpenAPI document of :func:`warmctl.agent.create_app` as stable, indented JSON text."""
    from warmctl.agent.app import create_app
    from warmctl.records.config import Settings

    with tempfile.TemporaryDirectory() as home:
        app = create_app(Settings(home=Path(home)), token=None, run_startup=False)
        return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    args = [a for a in args if a != "--check"]
    path = Path(args[0]) if args else DEFAULT_PATH
    text = document()
    if check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is stale: run `python -m warmctl.agent.openapi`", file=sys.stderr)
            return 1
        print(f"{path} is current")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
