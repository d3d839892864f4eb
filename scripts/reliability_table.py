"""Write docs/reliability.md's fault-matrix section from the matrix the tests run.

``python scripts/reliability_table.py``: the table between ``<!-- fault-matrix:begin -->`` and
``<!-- fault-matrix:end -->`` is made from tests/fault_matrix.py (:data:`MATRIX`: remote x
sealed x path x fault, with each cell's bound, exit code and what it leaves), so it says what
tests/test_fault_matrix.py asserts (its ``test_the_reliability_table_is_the_matrix`` fails when
the doc differs). The summary between ``<!-- fault-matrix-run:begin -->`` and
``<!-- fault-matrix-run:end -->`` is the last run's (build/fault-matrix.json, written by the
test module: cells, exit codes, seconds); it is left as it is when there is no such file.
``--check``: exit 1, changing nothing, when the table differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fault_matrix import BOUND_S, FAULTS, LEFT, MATRIX, PATHS, SETTINGS  # noqa: E402
from warmctl.base.errors import EXIT_CODES  # noqa: E402

DOC = ROOT / "docs" / "reliability.md"
RESULTS = ROOT / "build" / "fault-matrix.json"
BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"
RUN_BEGIN, RUN_END = "<!-- fault-matrix-run:begin -->", "<!-- fault-matrix-run:end -->"


def table() -> str:
    """The section's text (between the markers, without them): one row per (path, fault), the
    remotes it runs on, its bound, exit code and what is left."""
    rows: dict[tuple[str, str], list] = {}
    for c in sorted(MATRIX, key=lambda c: (PATHS.index(c.path), list(FAULTS).index(c.fault))):
        rows.setdefault((c.path, c.fault), []).append(c)
    settings = ", ".join(f"`{k}={v}`" for k, v in SETTINGS.items())
    out = [f"{len(MATRIX)} cells, run by `tests/test_fault_matrix.py::test_fault` under {settings}; "
           "each asserts that the command ends within its bound with the exit code below and one error line "
           "naming the object (the chunk's digest, or the remote's location for a network fault) and the fault, "
           "that it names nothing it could not verify, leaves no process, `/dev/shm` file or partial object, "
           "and that the same command succeeds once the fault is removed, moving only what is missing. The faults:",
           "", *(f"- {f}: {what}" for f, what in FAULTS.items()), "",
           "| path | fault | remotes | bound | exit code | error says | what is left |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for (path, fault), cells in rows.items():
        c = cells[0]
        where = ", ".join(f"{x.remote} {x.seal}" for x in cells)
        out.append(f"| `{path}` | {fault} | {where} | {BOUND_S[fault]} s | "
                   f"{EXIT_CODES[c.exit][0]} (`{c.exit}`) | \"{c.says}\" | {LEFT[path]} |")
    return "\n".join(out)


def run_summary(results: dict) -> str:
    failed = sorted(cid for cid, r in results["cells"].items() if "failed" in r)
    cells = {cid: r for cid, r in results["cells"].items() if "seconds" in r}
    by_fault: dict[str, float] = {}
    for cid, r in cells.items():
        fault = cid.rsplit("-", 1)[1] if not cid.endswith("-5xx") else "5xx"
        by_fault[fault] = max(by_fault.get(fault, 0.0), r["seconds"])
    done = [r["cell_seconds"] for r in cells.values() if "cell_seconds" in r]
    slow = ", ".join(f"{f} {by_fault[f]:.1f} s" for f in FAULTS if f in by_fault)
    run = results.get("run")
    wall = (f" The last run of {run['cells']} cells took {run['wall_seconds']:.0f} s of wall time on {run['cores']} "
            f"cores ({run['workers']} cells at a time beside the `up`-family, one at a time per snapshot in "
            f"{run.get('lanes', 1)} lane(s))." if run else "")
    return (f"Last run ({results['date']}, build/fault-matrix.json; a shared 2-core host): "
            f"{len(cells) + len(failed)} of {len(MATRIX)} cells run, "
            f"{len(done)} passed whole" + (f", {len(failed)} failed ({', '.join(failed)})" if failed else "") + ", "
            f"{sum(done):.0f} s of cell time for them all (failing command, checks, the "
            f"rerun, waits for the engine's port included); the slowest failing command by fault: {slow}.{wall}")


def _replace(doc: str, begin: str, end: str, body: str) -> str:
    if begin not in doc:
        return doc.rstrip("\n") + f"\n\n{begin}\n{body}\n{end}\n"
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def section(doc: str) -> str | None:
    """The fault-matrix section of ``doc`` (between the markers), or None."""
    if BEGIN not in doc:
        return None
    return doc.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def main(argv: list[str]) -> int:
    doc = DOC.read_text()
    if "--check" in argv:
        return 0 if section(doc) == table() else 1
    doc = _replace(doc, BEGIN, END, table())
    if RESULTS.exists():
        doc = _replace(doc, RUN_BEGIN, RUN_END, run_summary(json.loads(RESULTS.read_text())))
    DOC.write_text(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
