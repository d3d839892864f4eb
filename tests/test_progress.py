"""Reporter messages are plain text: a pipeline writes none of rich's markup, the agent keeps a
line as it was reported (brackets and all), and only the CLI's renderer styles a line."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from warmctl.agent.jobs import JobManager
from warmctl.records.progress import ConsoleReporter, Reporter

REPO = Path(__file__).resolve().parent.parent
LINE = "restoring [bold]not markup[/] from /srv/models[v2] ([x])"


def test_a_jobs_log_keeps_a_line_with_brackets_as_reported(tmp_path):
    jobs = JobManager(tmp_path / "jobs")

    def run(rep, job):
        rep.info(LINE)
        rep.warn("warning: " + LINE)
        rep.warn("severe: " + LINE, severe=True)
        return {}

    job = jobs.submit("down", "tiny", ["engine:tiny"], run, {})
    done = jobs.wait(job.id, 10)
    assert done is not None and done.state == "succeeded", done
    assert [ln for ln in done.log if LINE in ln] == [LINE, "warning: " + LINE, "severe: " + LINE]


def _recorded(rep: ConsoleReporter) -> Console:
    console = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=200, record=True)
    rep.__dict__["console"] = console  # the cached_property's slot: print into this console
    return console


def test_the_console_prints_messages_as_text_and_styles_only_warnings():
    rep = ConsoleReporter()
    console = _recorded(rep)
    rep.info(LINE)
    rep.warn(LINE)
    rep.warn(LINE, severe=True)
    text = console.export_text(styles=False, clear=False).splitlines()
    assert text == [LINE, LINE, LINE]
    styled = console.export_text(styles=True).splitlines()
    assert "\x1b[33m" in styled[1] and "\x1b[1;31m" in styled[2] and "\x1b[" not in styled[0], styled


def test_a_quiet_console_reporter_prints_no_warning():
    rep = ConsoleReporter(quiet=True)
    console = _recorded(rep)
    rep.warn(LINE)
    assert console.export_text() == ""


def test_the_base_reporter_reports_a_warning_as_a_line():
    lines: list[str] = []

    class Lines(Reporter):
        def info(self, msg: str) -> None:
            lines.append(msg)

    Lines().warn("w [x]", severe=True)
    assert lines == ["w [x]"]


def test_no_pipeline_module_writes_console_markup():
    """Markup (``[yellow]``, ``[/]``...) and its escape (``\\[``) belong to the renderer
    (warmctl/cli, progress.py): the reporters print a pipeline's lines as plain text, where an
    escape showed as written ("set it in \\[engine.env]", a cold start's CPU binding line)."""
    tag = re.compile(r"\[/?(?:bold|dim|italic|red|green|yellow|blue|cyan|magenta)(?: \w+)*\]|\[/\]|\\\\\[")
    offenders = []
    for p in sorted((REPO / "warmctl").rglob("*.py")):
        rel = p.relative_to(REPO).as_posix()
        if rel.startswith("warmctl/cli/") or rel == "warmctl/records/progress.py":
            continue
        offenders += [f"{rel}:{i}" for i, ln in enumerate(p.read_text().splitlines(), 1) if tag.search(ln)]
    assert offenders == []
