"""warmctl bench, the parts that need no engine: the over-capacity rule, capacity from vLLM's
/metrics text, the per-cell arithmetic, number formats and the report layout of seed 003."""

from __future__ import annotations

import pytest

from warmctl.bench.client import RequestResult, random_prompt
from warmctl.bench.matrix import (OVER_CAPACITY, VALID, DecodeCell, MatrixResult, PrefillRow, over_capacity,
                                  summarize_cell)
from warmctl.bench.metrics import capacity_from_samples, counter, parse_prometheus
from warmctl.bench.report import fmt_kilo, fmt_ms, fmt_tokens, markdown, plots
from warmctl.bench.startup import StartupResult, StartupRun
from warmctl.bench.startup import markdown as startup_markdown
from warmctl.cli.bench import _ints, resolve_target

# The tiny engine's own line (vLLM 0.32 CPU, VLLM_CPU_KVCACHE_SPACE=1), trimmed to the labels used.
TINY_INFO = ('vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="2097152",'
             'num_gpu_blocks="16384",num_cpu_blocks="None"} 1.0\n')


@pytest.mark.parametrize("context,concurrency,capacity,over", [
    (500, 2, 1000, False),      # exactly full: 1,000 = 1,000 fits
    (501, 2, 1000, True),       # 1,002 > 1,000
    (1000, 1, 1000, False),
    (1, 1001, 1000, True),
    (1024, 2048, 2_097_152, False),   # tiny: vLLM logs "Maximum concurrency for 1,024 tokens: 2048.00x"
    (1024, 2049, 2_097_152, True),
    # seed 003 (Ling-3.0-flash-fp4): 128K x 64 ran, 128K x 128 was over capacity, so a capacity of
    # 10M tokens reproduces its grid: 131,072 x 64 = 8,388,608 <= 10M < 16,777,216 = 131,072 x 128
    (131_072, 64, 10_000_000, False),
    (131_072, 128, 10_000_000, True),
    (257_024, 32, 10_000_000, False),  # "251K" x 32 = 8,224,768
    (257_024, 64, 10_000_000, True),   # 16,449,536
    (10**9, 10**9, None, False),       # unknown capacity never excludes a cell
])
def test_over_capacity_rule(context, concurrency, capacity, over):
    assert over_capacity(context, concurrency, capacity) is over


def test_capacity_from_vllm_metrics_text():
    cap, src = capacity_from_samples(parse_prometheus("# HELP x\n" + TINY_INFO))
    assert cap == 2_097_152 and "kv_cache_size_tokens" in src
    # without the group-aware number: blocks x block size
    cap, src = capacity_from_samples(parse_prometheus(
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",kv_cache_size_tokens="None"} 1.0\n'))
    assert cap == 16_000 and "num_gpu_blocks" in src
    # two data-parallel engines each hold their own requests
    two = TINY_INFO + TINY_INFO.replace('engine="0"', 'engine="1"')
    assert capacity_from_samples(parse_prometheus(two))[0] == 2 * 2_097_152
    cap, why = capacity_from_samples(parse_prometheus("vllm:num_requests_running 0.0\n"))
    assert cap is None and "no vllm:cache_config_info" in why


def test_counter_sums_label_sets_and_accepts_total_suffix():
    s = parse_prometheus('vllm:prefix_cache_hits_total{engine="0"} 256.0\nvllm:prefix_cache_hits_total{engine="1"} 128.0\n'
                         'vllm:prefix_cache_hits_created{engine="0"} 1.7e9\n')
    assert counter(s, "vllm:prefix_cache_hits") == 384.0
    assert counter(s, "vllm:spec_decode_num_drafts") is None


def _req(start, ttft, n, gap, completed=True, usage=None, error=None, cut=False):
    r = RequestResult(start=start, ttft=ttft, completed=completed, cut=cut, error=error)
    r.token_times = [ttft + i * gap for i in range(n)] if ttft is not None else []
    r.output_tokens = len(r.token_times)
    r.total = (r.token_times[-1] if r.token_times else 0.5) + 0.001
    r.usage_completion_tokens = usage
    return r


def test_summarize_cell_hand_computed():
    # window [100, 110): two workers. Worker A: 2 requests of 11 tokens, TTFT 0.1 s, 0.1 s apart
    # (10 tok/s after the first); worker B: one request cut at the deadline after 50 tokens at
    # 0.2 s apart (5 tok/s), plus one failed request.
    a1 = _req(100.0, 0.1, 11, 0.1, usage=11)            # tokens at 100.1..101.1
    a2 = _req(101.2, 0.1, 11, 0.1, usage=12)            # usage disagrees -> 1 mismatch
    b1 = _req(100.0, 0.2, 50, 0.2, completed=False, cut=True)   # 100.2..110.0
    bad = _req(101.0, None, 0, 0.0, completed=False, error="HTTP 500: boom")
    c = summarize_cell(DecodeCell(64, 2, VALID), [a1, a2, b1, bad], t0=100.0, duration_s=10.0)
    assert c.output_tokens == 72 and c.total_tok_s == pytest.approx(7.2)
    assert c.per_request_tok_s == pytest.approx(10.0)     # median of 10, 10, 5
    assert c.ttft_s == pytest.approx(0.1)                  # median of 0.1, 0.1, 0.2
    assert c.tbt_s == pytest.approx(0.1)
    assert c.completed == 2 and c.failed == 1 and c.requests == 4
    assert c.usage_mismatches == 1
    assert c.status == "Errors" and c.errors == ["HTTP 500: boom"]
    # busy time inside the window: 1.101 + 1.101 + 10.0 (b1 ends at 110.001, clipped) + 0.501
    assert c.avg_active == pytest.approx(12.703 / 10.0)
    assert len(c.request_log) == 4 and c.request_log[0]["start_s"] == 0.0


def test_formats_follow_seed_003():
    assert fmt_kilo(26_500) == "26.5K" and fmt_kilo(164.14) == "164.1"
    assert fmt_ms(1.165) == "1,165 ms" and fmt_ms(0.0061, 1) == "6.1 ms" and fmt_ms(None) == "—"
    assert [fmt_tokens(n) for n in (8192, 262_144, 256, 1536)] == ["8K", "256K", "256", "1.5K"]
    assert _ints("64, 256,1K,4k") == [64, 256, 1024, 4096]


def test_random_prompts_are_seeded_and_in_vocabulary():
    a, b = random_prompt(300, 7, "slot:0"), random_prompt(300, 7, "slot:0")
    assert a == b and a != random_prompt(300, 7, "slot:1") and a != random_prompt(300, 8, "slot:0")
    assert len(a) == 300 and all(100 <= t < 1000 for t in a)


def _fake_result() -> MatrixResult:
    meta = {"url": "http://h:1", "model": "m", "engine": "vllm", "engine_version": "0.32.0", "max_model_len": 1024,
            "capacity_tokens": 300, "capacity_source": "--capacity-tokens option", "seed": 1,
            "started_at": "2026-01-01T00:00:00+00:00", "options": {"duration_s": 2.0, "max_output": 16,
                                                                     "prompt": "random", "prefill_repeats": 1}}
    pre = [PrefillRow(64, VALID, 64, 0.045, 64 / 0.045, 0.05, 2, 0), PrefillRow(256, VALID, 256, 0.071, 3600.0, 0.08, 2, 0)]
    dec = [DecodeCell(64, 1, VALID, 16, 147.0, 167.9, 0.216, 0.006, 1.0, 10, 9, 294, 0, 0, 2.0),
           DecodeCell(256, 1, VALID, 16, 110.5, 113.6, 0.056, 0.0088, 1.0, 8, 7, 221, 0, 0, 2.0),
           DecodeCell(256, 2, OVER_CAPACITY)]
    return MatrixResult(meta, pre, dec)


def test_markdown_has_seed_003_sections_and_grid(tmp_path):
    md = markdown(_fake_result())
    for s in ("# Speed test matrix", "### Hardware", "### Engine", "### Run", "## Prefill", "## Sustained decode",
              "## All measurements", "Time per measurement: 2.0 s", "KV cache capacity: 300 tokens"):
        assert s in md
    assert "| 64 | 147.0 · 216 ms TTFT | — |" in md
    assert "| 256 | 110.5 · 56 ms TTFT | Over capacity |" in md
    assert "| Sustained decode | 256 | 2 | Over capacity | — | — | — | — | — | — | — | — | — |" in md
    assert "| Prefill | 256 | 1 | Valid | 3.6K | — | 71 ms |" in md
    written = plots(_fake_result(), tmp_path)
    assert [p.name for p in written] == ["prefill.png", "decode.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_startup_markdown_medians_and_ratio():
    cold = [StartupRun("cold", {"weights": 1.0, "torch_compile": 70.0, "cold_start": 90.0, "warmup": 2.0}, 95.0, 0.5, 16, 95.5),
            StartupRun("cold", {"weights": 3.0, "torch_compile": 80.0, "cold_start": 100.0, "warmup": 2.0}, 105.0, 0.5, 16, 105.5),
            StartupRun("failed", {}, 1.0, None, None, None, error="port taken")]
    rest = [StartupRun("restore", {"materialize": 8.0, "restore": 2.0, "canary": 0.5}, 10.0, 0.2, 16, 10.2)]
    res = StartupResult("tiny", "latest", "sha256:" + "0" * 64, cold, rest)
    med = StartupResult.medians(cold)
    assert med["weights"] == 2.0 and med["torch_compile"] == 75.0 and med["ready_s"] == 100.5  # failed run left out
    assert res.ratio() == pytest.approx(100.5 / 10.2)
    md = startup_markdown(res)
    assert "| torch.compile | 75.00 s | — |" in md and "| CRIU restore | — | 2.00 s |" in md
    assert "9.9x faster" in md and "- cold: port taken" in md


def test_resolve_target_url_forms():
    assert resolve_target("http://h:8000/v1/") == "http://h:8000"
    assert resolve_target("https://h") == "https://h"
