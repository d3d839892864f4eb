"""Start-up phases parsed from vLLM's own log lines."""

from warmctl.engine.vllm import parse_startup_phases

CPU_LOG = """\
(Worker pid=26) INFO 11-29 10:03:44 [default_loader.py:501] Loading weights took 0.01 seconds
(Worker pid=26) INFO 11-29 10:03:46 [cpu_model_runner.py:87] Warming up model for the compilation...
(Worker pid=26) INFO 11-29 10:04:17 [decorators.py:743] [backbone] saved AOT compiled function to /root/x
(EngineCore pid=13) INFO 11-29 10:04:20 [core.py:402] init engine (profile, create kv cache, warmup model) took 34.46 s
"""

GPU_LOG = """\
INFO 09-03 14:01:10 [default_loader.py:262] Loading weights took 77.20 seconds
INFO 09-03 14:03:20 [backends.py:215] torch.compile takes 122.4 s in total
INFO 09-03 14:05:00 [gpu_model_runner.py:2100] Graph capturing finished in 31 secs, took 2.1 GiB
"""


def test_cpu_log_compile_span_from_timestamps():
    p = parse_startup_phases(CPU_LOG, total_s=94.1)
    assert p["weights"] == 0.01 and p["torch_compile"] == 31.0 and p["graph_capture"] == 0.0
    assert abs(p["other"] - (94.1 - 31.01)) < 1e-9 and p["total"] == 94.1


def test_gpu_log_explicit_totals():
    p = parse_startup_phases(GPU_LOG, total_s=854)
    assert (p["weights"], p["torch_compile"], p["graph_capture"]) == (77.2, 122.4, 31.0)
    assert abs(p["other"] - (854 - 230.6)) < 1e-9


def test_empty_log():
    assert parse_startup_phases("", total_s=5.0) == {"weights": 0.0, "torch_compile": 0.0, "graph_capture": 0.0,
                                                     "other": 5.0, "total": 5.0}
