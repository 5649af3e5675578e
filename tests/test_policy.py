"""The split policy: its cost model, calibration and decisions."""

import pytest

from ubatch.policy import Linear, SplitPolicy, StepCosts, calibrate


def test_linear_fit_recovers_a_line_and_handles_one_point():
    line = Linear.fit([1, 2, 4], [3, 5, 9])
    assert line.intercept == pytest.approx(1) and line.slope == pytest.approx(2)
    assert Linear.fit([4, 4], [2, 2]) == Linear(0.0, 0.5)
    with pytest.raises(ValueError, match="matching, non-empty"):
        Linear.fit([], [])


def test_prediction_approaches_the_ideal_with_more_ubatches():
    costs = StepCosts(1.0, Linear(0, 1.0))  # C = M: ideal 2x
    unsplit = costs.predict_ms(1000, 1)
    assert unsplit == pytest.approx(2000)
    assert [round(unsplit / costs.predict_ms(1000, n), 3) for n in (2, 4)] == [1.333, 1.6]


def test_the_host_floor_keeps_small_batches_whole():
    costs = StepCosts(0.02, Linear(0.05, 0.03), host_ms=20.0, ubatch_host_ms=30.0)
    policy = SplitPolicy(costs, candidates=(2, 3))
    assert (costs.predict_ms(256, 1), costs.predict_ms(256, 2)) == (20.0, 60.0)
    assert policy.decide(256) == 1 and policy.decide(1024) == 1
    assert policy.decide(8192) in (2, 3)


def test_calibration_reads_compute_rate_at_the_largest_size_and_host_at_the_smallest():
    serial = {256: (20.0, 1.0), 2048: (40.0, 8.0)}
    costs = calibrate(lambda t: serial[t], lambda t, n: 21.0 * n + 10 * (n - 1), [256, 2048])
    assert costs.compute_ms_per_token == pytest.approx(40.0 / 2048)
    assert costs.comm_ms(256) == pytest.approx(1.0) and costs.comm_ms(2048) == pytest.approx(8.0)
    assert (costs.host_ms, costs.ubatch_host_ms) == (21.0, 26.0)
    with pytest.raises(ValueError, match="at least two sizes"):
        calibrate(lambda t: (1, 1), lambda t, n: 1, [256])


def test_threshold_fallback_and_validation():
    policy = SplitPolicy(threshold_tokens=1024)
    assert (policy.decide(512), policy.decide(1024)) == (1, 2)
    with pytest.raises(ValueError, match="candidates"):
        SplitPolicy(candidates=(0,))
    with pytest.raises(ValueError, match="min_gain must be >= 1.0, got 0.5"):
        SplitPolicy(min_gain=0.5)
