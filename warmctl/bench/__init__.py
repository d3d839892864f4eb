"""``warmctl bench``: measure an engine the way seeds 000 and 003 report it.

- :mod:`warmctl.bench.matrix`: prefill by context length and sustained decode by context x
  concurrency, with "over capacity" cells, against any OpenAI-compatible endpoint;
- :mod:`warmctl.bench.startup`: cold start vs ``up`` from a snapshot, by phase;
- :mod:`warmctl.bench.probes`: needle recall, agent turns (prefix cache), spec-decode acceptance;
- :mod:`warmctl.bench.report`: JSON, Markdown (seed 003's layout) and PNG plots.
"""

from warmctl.bench.matrix import DecodeCell, MatrixOptions, MatrixResult, PrefillRow, over_capacity, run_matrix

__all__ = ["DecodeCell", "MatrixOptions", "MatrixResult", "PrefillRow", "over_capacity", "run_matrix"]
