"""Replay the split policy on saved ``ubatch-bench`` reports: recalibrate from each report's
calibration samples, decide every sweep point again, and compare with what was measured there.
A change to the cost model can then be judged on every GPU sweep already run, with no GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ubatch.policy import Linear, SplitPolicy, StepCosts, calibrate_from_samples


@dataclass(frozen=True)
class ReplayedPoint:
    tokens: int
    choice: int
    best: int
    measured_ms: dict[int, float]

    @property
    def vs_best(self) -> float:
        """The best measured time over the chosen count's: 1.0 when the policy picked the best."""
        return self.measured_ms[self.best] / self.measured_ms[self.choice]


def calibration_samples(report: dict[str, Any]) -> dict[int, dict[str, float | None]]:
    """``{tokens: {compute_ms, comm_ms, baseline_ms, ubatched_ms}}`` of the report's calibration.

    Reports from before the samples were saved hold only the costs fitted from them; the samples
    that fit used (compute at the largest size, communication at both, both steps at the
    smallest, the split step at the largest, through the fixed per-ubatch overhead it then
    fitted) are recovered from those, and the rest is None."""
    auto = report["auto"]
    if "calibration" in auto:
        return {int(t): sample for t, sample in auto["calibration"].items()}
    sizes = sorted(report["args"]["calibrate_tokens"])
    if len(sizes) != 2:
        raise ValueError(f"can only recover two calibration sizes from fitted costs, got {sizes}")
    small, large = sizes
    fitted = auto["costs"]
    comm = Linear(**fitted["comm_ms"])
    old = StepCosts(fitted["compute_ms_per_token"], comm, stages=fitted["stages"])
    return {
        small: {
            "compute_ms": None,
            "comm_ms": comm(small),
            "baseline_ms": fitted["host_ms"],
            "ubatched_ms": 2 * fitted["ubatch_host_ms"],
        },
        large: {
            "compute_ms": fitted["compute_ms_per_token"] * large,
            "comm_ms": comm(large),
            "baseline_ms": None,
            "ubatched_ms": old.pipeline_ms(large, 2) + 2 * fitted["ubatch_gpu_ms"],
        },
    }


def replay(report: dict[str, Any], **policy_kwargs: Any) -> list[ReplayedPoint]:
    """The current policy's pick at every sweep point of an eager ``--policy auto`` report."""
    if "costs" not in report.get("auto", {}):
        raise ValueError("the report has no eager --policy auto calibration (graph sweeps pick by timing)")
    costs = calibrate_from_samples(calibration_samples(report), stages=report["auto"]["costs"]["stages"])
    policy = SplitPolicy(costs, candidates=[1, *report["args"]["num_ubatches"]], **policy_kwargs)
    measured: dict[int, dict[int, float]] = {}
    for row in report["results"]:
        times = measured.setdefault(row["tokens_per_rank"], {1: row["baseline_ms"]})
        times[row["num_ubatches"]] = row["ubatched_ms"]
    return [
        ReplayedPoint(tokens, policy.decide(tokens), min(times, key=times.get), times)
        for tokens, times in measured.items()
    ]
