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
    costs = StepCosts(Linear(0, 1.0), Linear(0, 1.0))  # C = M: ideal 2x
    unsplit = costs.predict_ms(1000, 1)
    assert unsplit == pytest.approx(2000)
    assert [round(unsplit / costs.predict_ms(1000, n), 3) for n in (2, 4)] == [1.333, 1.6]


def test_small_batches_stay_whole_and_comm_heavy_large_ones_split():
    costs = StepCosts(Linear(0.5, 0.001), Linear(0.05, 0.002), handoff_ms=0.2)
    policy = SplitPolicy(costs, candidates=(2, 3))
    assert policy.decide(64) == 1
    assert policy.decide(16384) in (2, 3)


def test_calibration_measures_handoff_beyond_the_model():
    serial = {256: (1.0, 1.0), 2048: (8.0, 8.0)}
    costs = calibrate(lambda t: serial[t], lambda t, n: 5.0, [256, 2048])
    assert costs.compute_ms(256) == pytest.approx(1.0) and costs.comm_ms(2048) == pytest.approx(8.0)
    assert costs.handoff_ms == pytest.approx(5.0 - StepCosts(costs.compute_ms, costs.comm_ms).predict_ms(256, 2))
    with pytest.raises(ValueError, match="at least two sizes"):
        calibrate(lambda t: (1, 1), lambda t, n: 1, [256])


def test_threshold_fallback_and_validation():
    policy = SplitPolicy(threshold_tokens=1024)
    assert (policy.decide(512), policy.decide(1024)) == (1, 2)
    with pytest.raises(ValueError, match="candidates"):
        SplitPolicy(candidates=(0,))
    with pytest.raises(ValueError, match="min_gain must be >= 1.0, got 0.5"):
        SplitPolicy(min_gain=0.5)
