"""Whether to split a step, and into how many ubatches: never slower than running it whole.

A cost model calibrated at start-up predicts a step's time for each ubatch count ``N``:

- the GPU: unsplit ``C(t) + M(t)`` (compute, then communication). Split, with ``c = C(t/N)``,
  ``m = M(t/N)`` and ``S`` pipeline stages (the collectives a step runs, e.g. two all-to-alls
  per MoE layer): ``(N * max(c, m) + min(c, m) / S) * k``. The busier resource works N times in
  a row, the other adds one stage of fill and drain, and ``k`` is how much longer than that a
  split step ran (profiled on H200s: collectives stretched beside compute, smaller kernels);
- the host: launching an unsplit step costs ``h``, and each ubatch of a split step ``h_u`` (its
  share of the launches plus the hand-offs, at least ``h / 2``), so N ubatches cannot finish
  before ``N * h_u`` (what makes eager splits of small batches lose);
- the step takes the longer of the two.

``C`` is GPU compute per token (measured at the largest calibration size, where the GPU, not the
host, is the bottleneck), ``M`` is linear in the tokens; ``h`` and ``h_u`` come from the unsplit
and the two-ubatch step at the smallest size, where the host is the bottleneck, and ``k`` from the
two-ubatch step at the largest size: its time over the pipeline's prediction (never below 1). A
factor, not a fixed cost per ubatch, because those losses grow with the step: replayed on the
committed H200 sweeps (``scripts/replay_policy.py``), a fixed cost fitted at 2048 tokens
overstated the split at 1024 and picked 0.75x of the best in one; the factor stays within
0.988x on all of them. Weights
that memory-bound expert GEMMs read again per ubatch are a fixed cost it leaves out; decode
steps, where they weigh, replay graphs and pick by timing instead (``ubatch.bench``). A split
must beat unsplit by ``min_gain`` in the model, a margin for what it leaves out; without
calibration a token threshold decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Linear:
    intercept: float
    slope: float

    def __call__(self, x: float) -> float:
        return max(0.0, self.intercept + self.slope * x)

    @classmethod
    def fit(cls, xs: Sequence[float], ys: Sequence[float]) -> Linear:
        """Least squares through the points (a single point: through the origin)."""
        if len(xs) != len(ys) or not xs:
            raise ValueError(f"need matching, non-empty samples, got {len(xs)} x and {len(ys)} y")
        if len(set(xs)) == 1:
            return cls(0.0, sum(ys) / sum(xs) if xs[0] else 0.0)
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return cls(my - slope * mx, slope)


@dataclass(frozen=True)
class StepCosts:
    compute_ms_per_token: float
    comm_ms: Linear
    host_ms: float = 0.0
    ubatch_host_ms: float = 0.0
    split_stretch: float = 1.0
    stages: int = 1

    def pipeline_ms(self, num_tokens: int, num_ubatches: int) -> float:
        """GPU time of a split step before the stretch ``k``."""
        c = self.compute_ms_per_token * num_tokens / num_ubatches
        m = self.comm_ms(num_tokens / num_ubatches)
        return num_ubatches * max(c, m) + min(c, m) / self.stages

    def predict_ms(self, num_tokens: int, num_ubatches: int) -> float:
        if num_ubatches == 1:
            gpu = self.compute_ms_per_token * num_tokens + self.comm_ms(num_tokens)
            return max(gpu, self.host_ms)
        gpu = self.pipeline_ms(num_tokens, num_ubatches) * self.split_stretch
        return max(gpu, num_ubatches * self.ubatch_host_ms)


def calibrate(
    serial_costs: Callable[[int], tuple[float, float]],
    step_time: Callable[[int, int], float],
    sizes: Sequence[int],
    *,
    stages: int = 1,
) -> StepCosts:
    """Fit the model: ``serial_costs(t) -> (compute_ms, comm_ms)`` of an unsplit step measured at
    each size (compute and communication apart); ``step_time(t, n)`` of the whole step, unsplit
    and in two ubatches at the smallest size, in two at the largest; ``stages`` collectives per
    step."""
    if len(sizes) < 2:
        raise ValueError(f"calibration needs at least two sizes, got {list(sizes)}")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an integer >= 1, got {stages!r}")
    samples = {t: serial_costs(t) for t in sizes}
    largest, smallest = max(sizes), min(sizes)
    comm = Linear.fit(list(samples), [m for _, m in samples.values()])
    host = step_time(smallest, 1)
    # A split launches everything the whole step does: its host time is never below the whole
    # step's, whatever noise made one measurement of it shorter (with nothing to hide, a noisy
    # unsplit time would otherwise predict a split faster).
    costs = StepCosts(samples[largest][0] / largest, comm, host, max(step_time(smallest, 2), host) / 2, stages=stages)
    stretch = step_time(largest, 2) / costs.pipeline_ms(largest, 2)
    return dataclasses.replace(costs, split_stretch=max(1.0, stretch))


def calibrate_from_samples(samples: Mapping[int, Mapping[str, float | None]], *, stages: int = 1) -> StepCosts:
    """``calibrate`` from ``{tokens: {compute_ms, comm_ms, baseline_ms, ubatched_ms}}``: the unsplit
    step's compute and communication measured apart, the unsplit step and the two-ubatch step, as
    ``ubatch-bench`` keeps them in its reports."""
    return calibrate(
        lambda t: (samples[t]["compute_ms"], samples[t]["comm_ms"]),
        lambda t, n: samples[t]["baseline_ms"] if n == 1 else samples[t]["ubatched_ms"],
        sorted(samples),
        stages=stages,
    )


class SplitPolicy:
    """Chooses the ubatch count per step: the predicted fastest, 1 (unsplit) on a tie.

    ``min_gain`` is the predicted speedup a split must beat, so noise in the model never makes a
    step slower; without costs, steps of at least ``threshold_tokens`` split in two. The default
    1.05 comes from replaying the policy on two H200 sweeps' calibrations (1.15 missed a 1.19x
    split at 1024 tokens on the slow link; 1.05 picked the best count at every point).
    """

    def __init__(
        self,
        costs: StepCosts | None = None,
        *,
        candidates: Sequence[int] = (1, 2, 3, 4),
        min_gain: float = 1.05,
        threshold_tokens: int = 4096,
    ) -> None:
        if not candidates or any(not isinstance(n, int) or n < 1 for n in candidates):
            raise ValueError(f"candidates must be ubatch counts >= 1, got {list(candidates)}")
        if min_gain < 1.0:
            raise ValueError(f"min_gain must be >= 1.0, got {min_gain}")
        self.costs = costs
        self.candidates = sorted(set(candidates) | {1})
        self.min_gain = min_gain
        self.threshold_tokens = threshold_tokens

    def decide(self, num_tokens: int) -> int:
        splits = [n for n in self.candidates if 1 < n <= num_tokens]
        if self.costs is None:
            return 2 if splits and 2 in splits and num_tokens >= self.threshold_tokens else 1
        unsplit = self.costs.predict_ms(num_tokens, 1)
        best = min(splits, key=lambda n: self.costs.predict_ms(num_tokens, n), default=1)
        if best == 1 or unsplit < self.min_gain * self.costs.predict_ms(num_tokens, best):
            return 1
        return best


class ModePolicy:
    """Chooses the overlap mode (``ubatch.overlap.OverlapMode`` names) predicted fastest for a
    step of ``num_tokens``, from each mode's step time measured at a few sizes: linear in the
    tokens between measured sizes, proportional beyond the largest and flat below the smallest.

    Modes are listed simplest first (unsplit first); a later mode must beat every earlier one by
    ``min_gain`` in the prediction, so timing noise never trades a plain step for a mode that is
    no faster. Calibrated from graph replays (no host cost in the prediction), which is how the
    split policy picks ubatch counts under graphs too.
    """

    def __init__(self, timings_ms: Mapping[str, Mapping[int, float]], *, min_gain: float = 1.01) -> None:
        if not timings_ms:
            raise ValueError("ModePolicy needs the timings of at least one mode")
        if min_gain < 1.0:
            raise ValueError(f"min_gain must be >= 1.0, got {min_gain}")
        for name, samples in timings_ms.items():
            if not samples or any(not isinstance(t, int) or t < 0 or not ms > 0 for t, ms in samples.items()):
                raise ValueError(f"mode {name!r} needs timings {{tokens >= 0: ms > 0}}, got {dict(samples)}")
        self.timings_ms = {name: dict(sorted(samples.items())) for name, samples in timings_ms.items()}
        self.min_gain = min_gain

    def predict_ms(self, mode: str, num_tokens: int) -> float:
        samples = self.timings_ms[mode]
        sizes = list(samples)
        if num_tokens <= sizes[0]:
            return samples[sizes[0]]
        if num_tokens >= sizes[-1]:
            return samples[sizes[-1]] * num_tokens / sizes[-1] if sizes[-1] else samples[sizes[-1]]
        hi = next(i for i, t in enumerate(sizes) if t >= num_tokens)
        (t0, y0), (t1, y1) = (sizes[hi - 1], samples[sizes[hi - 1]]), (sizes[hi], samples[sizes[hi]])
        return y0 + (y1 - y0) * (num_tokens - t0) / (t1 - t0)

    def decide(self, num_tokens: int) -> str:
        choice = None
        for mode in self.timings_ms:
            ms = self.predict_ms(mode, num_tokens)
            if choice is None or ms * self.min_gain < choice[1]:
                choice = (mode, ms)
        return choice[0]
