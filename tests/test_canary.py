"""Canary comparison: bit-exact, and the first difference is named precisely."""

from warmctl.engine.canary import first_difference
from warmctl.records.manifest import CanaryCompletion, CanaryRecord


def rec(ids, lps, match="tokens+logprobs", top=None):
    return CanaryRecord(match=match, max_tokens=len(ids), logprobs=1, completions=[
        CanaryCompletion(prompt="p", token_ids=ids, logprobs=lps, top_logprobs=top or [])])


def test_identical_matches():
    assert first_difference(rec([1, 2, 3], [-0.5, -1.25, -2.0]), rec([1, 2, 3], [-0.5, -1.25, -2.0])) is None


def test_token_difference_named():
    d = first_difference(rec([1, 2, 3], [-0.5, -1.0, -2.0]), rec([1, 9, 3], [-0.5, -1.0, -2.0]))
    assert "position 1" in d and "expected token 2" in d and "got token 9" in d


def test_one_ulp_logprob_difference_detected():
    import math

    x = -1.2345
    d = first_difference(rec([1, 2], [-0.5, x]), rec([1, 2], [-0.5, math.nextafter(x, 0)]))
    assert d and "position 1" in d and "logprob" in d


def test_tokens_only_policy_ignores_logprobs():
    assert first_difference(rec([1, 2], [-0.5, -1.0], "tokens"), rec([1, 2], [-0.7, -1.1], "tokens")) is None


def test_topk_and_length_differences():
    assert "top-k" in first_difference(rec([1], [-0.5], top=[{"token_id:1": -0.5}]),
                                       rec([1], [-0.5], top=[{"token_id:2": -0.5}]))
    assert "position 2" in first_difference(rec([1, 2, 3], [-1.0] * 3), rec([1, 2], [-1.0] * 2))
