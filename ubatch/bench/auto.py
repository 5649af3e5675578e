"""``--policy auto``: what the calibrated split policy picks at every sweep point, beside the
best ubatch count measured there, all from the same run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ubatch.bench.measure import Measurement
from ubatch.policy import SplitPolicy, calibrate_from_samples

GRAPH_POLICY_NOTE = (
    "graph replays: the policy picks the ubatch count whose graph replayed faster in a "
    "short timing right after capture (capture_time_ms), separate from the measured figures"
)


def auto_policy_report(
    results: Sequence[dict[str, Any]],
    measure_at: Callable[[int, int], Measurement],
    *,
    tokens: Sequence[int],
    num_ubatches: Sequence[int],
    calibrate_tokens: Sequence[int],
    stages: int,
    graphs: bool,
) -> dict[str, Any]:
    """Calibrate on ``calibrate_tokens`` (``measure_at(tokens, 2)``), then compare the policy's
    pick with the best measured configuration at every sweep point; ``stages`` collectives per
    step (two per layer: dispatch and combine, or two all-reduces). For graph replays the eager
    cost model does not apply (no host launch cost): see ``GRAPH_POLICY_NOTE``."""
    if graphs:
        return {
            "note": GRAPH_POLICY_NOTE,
            "points": [policy_point(results, t, fastest_at_capture(results, t)) for t in tokens],
        }
    calibration = {t: measure_at(t, 2).calibration_sample() for t in calibrate_tokens}
    costs = calibrate_from_samples(calibration, stages=stages)
    policy = SplitPolicy(costs, candidates=[1, *num_ubatches])
    return {
        "calibration": {str(t): sample for t, sample in calibration.items()},
        "costs": {
            "compute_ms_per_token": costs.compute_ms_per_token,
            "comm_ms": vars(costs.comm_ms),
            "host_ms": costs.host_ms,
            "ubatch_host_ms": costs.ubatch_host_ms,
            "split_stretch": costs.split_stretch,
            "stages": costs.stages,
        },
        "points": [policy_point(results, t, policy.decide(t)) for t in tokens],
    }


def fastest_at_capture(results: Sequence[dict[str, Any]], tokens: int) -> int:
    """The ubatch count whose graph was fastest in the timings right after capture."""
    timed: dict[int, float] = {}
    for r in results:
        if r["tokens_per_rank"] == tokens:
            timed.update({int(n): ms for n, ms in r["capture_time_ms"].items()})
    return min(timed, key=timed.get)


def policy_point(results: Sequence[dict[str, Any]], tokens: int, choice: int) -> dict[str, Any]:
    """The policy's ``choice`` beside the best measured ubatch count at ``tokens``."""
    rows = [r for r in results if r["tokens_per_rank"] == tokens]
    measured = {1: rows[0]["baseline_ms"], **{r["num_ubatches"]: r["ubatched_ms"] for r in rows}}
    best = min(measured, key=measured.get)
    point = {"tokens_per_rank": tokens, "choice": choice, "best": best, "best_ms": measured[best]}
    return {**point, "auto_ms": measured[choice], "auto_vs_best": round(measured[best] / measured[choice], 4)}
