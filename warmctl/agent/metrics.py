"""Prometheus metrics of the agent (``GET /metrics``, text format 0.0.4).

Counters and histograms are fed by jobs; engine state and job counts are read at scrape time.

- ``warmctl_restore_phase_seconds{phase}`` (histogram): seconds of each phase of ``up``
  through the restore path (materialize, restore, health, canary, gate, total);
- ``warmctl_cold_start_seconds`` (histogram): seconds of ``up`` through the cold path;
- ``warmctl_bytes_pulled_total`` (counter): bytes read from the store and written out by
  ``up`` (materialize);
- ``warmctl_canary_total{result}`` (counter): canary replays, ``result`` = ``pass``/``fail``;
- ``warmctl_engine_state{name,phase}`` (gauge): 1 for each recorded engine's phase
  (``starting``, ``restoring``, ``health``, ``canary``, ``serving``, ``failed``, or ``dead``
  when its process is gone);
- ``warmctl_engine_up{name}`` (gauge): 1 when the engine and its gate are alive;
- ``warmctl_jobs{kind,state}`` (gauge): jobs the agent knows, by kind and state;
- ``warmctl_jobs_finished_total{kind,state}`` (counter): jobs ended since the agent started;
- ``warmctl_agent_recovered_total{action}`` (counter): engines ``adopted``/``cleaned`` at start, and directories ``ignored`` (not the agent's records).
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from warmctl.records.config import Settings
from warmctl.records.state import all_states

PHASE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 21, 34, 60, 120, 300, 600)


class _Scraped(Collector):
    def __init__(self, settings: Settings, job_counts: Callable[[], dict[tuple[str, str], int]]):
        self.settings = settings
        self.job_counts = job_counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        state = GaugeMetricFamily("warmctl_engine_state", "1 for the current phase of each recorded engine",
                                  labels=["name", "phase"])
        up = GaugeMetricFamily("warmctl_engine_up", "1 when the engine and its gate processes are alive",
                               labels=["name"])
        for st in all_states(self.settings.run_dir):
            alive = st.engine_alive()
            state.add_metric([st.name, st.phase if alive or st.phase in ("restoring", "starting") else "dead"], 1)
            up.add_metric([st.name], 1.0 if alive and st.gate_alive() else 0.0)
        yield state
        yield up
        jobs = GaugeMetricFamily("warmctl_jobs", "Jobs the agent knows, by kind and state", labels=["kind", "state"])
        for (kind, st_), n in sorted(self.job_counts().items()):
            jobs.add_metric([kind, st_], n)
        yield jobs


class Metrics:
    """The agent's metrics in their own registry (so several agents can live in one process,
    e.g. in tests). ``render()`` returns the exposition text."""

    def __init__(self, settings: Settings, job_counts: Callable[[], dict[tuple[str, str], int]]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.restore_phase = Histogram("warmctl_restore_phase_seconds", "Seconds of each phase of up (restore path)",
                                       ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.cold_start = Histogram("warmctl_cold_start_seconds", "Seconds of up through the cold path",
                                    buckets=PHASE_BUCKETS, registry=r)
        self.bytes_pulled = Counter("warmctl_bytes_pulled", "Bytes read from the store and written out by up",
                                    registry=r)
        self.canary = Counter("warmctl_canary", "Canary replays after restore", ["result"], registry=r)
        self.jobs_finished = Counter("warmctl_jobs_finished", "Jobs ended since the agent started",
                                     ["kind", "state"], registry=r)
        self.recovered = Counter("warmctl_agent_recovered", "Engines adopted or cleaned up at agent start",
                                 ["action"], registry=r)
        for res in ("pass", "fail"):
            self.canary.labels(res)
        for a in ("adopted", "cleaned", "ignored"):
            self.recovered.labels(a)
        r.register(_Scraped(settings, job_counts))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
