"""pass@k and mean@k against values worked out by hand: 8 samples per problem, problems with 0,
2 and 8 passing samples, k = 1, 4, 8."""

import math

import pytest
from coordinator_fakes import make_rollout

from rlbus_orchestrator.eval_metrics import eval_metrics, pass_at_k

# 1 - C(6, 4) / C(8, 4) = 1 - 15 / 70: four draws from 8 with 2 passing miss both 15 times in 70
SOME_PASS_AT_4 = 55 / 70


@pytest.mark.parametrize(
    ("c", "k", "expected"),
    [
        (0, 1, 0.0),
        (0, 4, 0.0),
        (0, 8, 0.0),
        (2, 1, 0.25),
        (2, 4, SOME_PASS_AT_4),
        (2, 8, 1.0),  # 8 draws from 8 always hold the 2 passing
        (8, 1, 1.0),
        (8, 4, 1.0),
        (8, 8, 1.0),
    ],
)
def test_pass_at_k_of_one_problem(c, k, expected):
    assert pass_at_k(8, c, k) == pytest.approx(expected)


def test_pass_at_k_is_unbiased_not_one_minus_the_miss_rate_to_the_k():
    biased = 1 - (1 - 2 / 8) ** 4
    assert pass_at_k(8, 2, 4) != pytest.approx(biased)


def three_problems():
    """Problem 0: no sample passes; 1: two of eight; 2: all eight (rewards 0/1)."""
    return [
        make_rollout(f"eval-3-0-{i}", [1.0] * c + [0.0] * (8 - c)) for i, c in enumerate((0, 2, 8))
    ]


def test_environment_metrics_average_the_problems():
    m = eval_metrics("math", three_problems(), num_expected=3, ks=[1, 4, 8], n=8, threshold=1.0)
    assert m["eval/math/pass@1"] == pytest.approx((0 + 0.25 + 1) / 3)
    assert m["eval/math/pass@4"] == pytest.approx((0 + SOME_PASS_AT_4 + 1) / 3)
    assert m["eval/math/pass@8"] == pytest.approx((0 + 1 + 1) / 3)
    for k in (1, 4, 8):  # the mean reward of k samples is the mean of all n, whatever k
        assert m[f"eval/math/mean@{k}"] == pytest.approx((0 + 0.25 + 1) / 3)
    assert m["eval/math/reward/mean"] == pytest.approx(10 / 24)
    assert (m["eval/math/num_examples"], m["eval/math/num_samples"], m["eval/math/failed"]) == (
        3.0,
        24.0,
        0.0,
    )
    assert m["eval/math/completion_len/mean"] == 3.0 and m["eval/math/turns/mean"] == 1.0


def test_the_threshold_decides_what_passes_and_mean_at_k_keeps_partial_rewards():
    rollouts = [make_rollout("eval-1-0-0", [0.5, 0.9, 0.2, 0.0])]
    m = eval_metrics("sim", rollouts, num_expected=1, ks=[1, 2], n=4, threshold=0.8)
    assert m["eval/sim/pass@1"] == pytest.approx(0.25)
    assert m["eval/sim/pass@2"] == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert m["eval/sim/mean@2"] == pytest.approx(0.4)


def test_failed_problems_are_counted_and_k_above_n_is_left_out():
    failed = make_rollout("eval-3-0-3", [])
    failed.error = "engine gone"
    m = eval_metrics(
        "math", [*three_problems(), failed], num_expected=5, ks=[1, 16], n=8, threshold=1.0
    )
    assert m["eval/math/failed"] == 2.0  # one error, one that never came back
    assert m["eval/math/num_examples"] == 3.0 and "eval/math/pass@16" not in m
    assert m["eval/math/pass@1"] == pytest.approx((0 + 0.25 + 1) / 3)


def test_an_evaluation_with_no_sample_reports_its_failures_only():
    m = eval_metrics("math", [], num_expected=4, ks=[1], n=1, threshold=1.0)
    assert m == {
        "eval/math/num_examples": 0.0,
        "eval/math/num_samples": 0.0,
        "eval/math/failed": 4.0,
    }
