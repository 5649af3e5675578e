"""Time one configuration: unsplit baseline, ubatched, and the serial compute / comm split.

Every figure of a result comes from the same process and run. The unsplit and the ubatched step
are timed in shared rounds (each round runs both), so a result carries their medians and the
spread of the speedup over the rounds. The compute and communication times come from traced
single-ubatch runs (the same kernels, strictly serial: each collective waits for the compute
before it and the compute after it waits for the collective; the median of three), so the ideal
speedup (C+M)/max(C,M) is measured, not modelled. A speedup that beats that ideal in every round
is a measurement error and is reported as ruled out, not as a speedup. ``ubatch.bench.graphs``
times graph replays of the same step, with ``unsplit_call`` for its eager baseline.
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ubatch.bench.schedule import ideal_speedup
from ubatch.bench.workload import Step
from ubatch.context import set_forward_context
from ubatch.scheduler import UBatchScheduler
from ubatch.trace import Interval, busy_ms, hidden_comm_fraction
from ubatch.wrapper import UBatchWrapper

logger = logging.getLogger(__name__)


def keep_freed_cpu_memory() -> None:
    """Stop glibc from handing large freed blocks back to the OS, as CPU timings need.

    Blocks above glibc's mmap threshold (adaptive, at most 32 MB) are unmapped on free, so a step
    whose buffers are that large pays page faults on every call, and a split into smaller
    buffers escapes them: a decode step of 256 tokens looked 2.8x faster split on CPU with no
    communication at all. Raising the threshold makes both runs reuse heap memory once the heap
    has grown to hold them (within the first three calls: the warm-up). Process-wide; a no-op
    where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt: CPU timings may include page faults of large buffers")
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    for option in (m_mmap_threshold, m_trim_threshold):
        if not mallopt(option, 1 << 30):
            logger.debug("mallopt(%d) refused: CPU timings may include page faults of large buffers", option)


def drain(device: torch.device) -> None:
    """Wait for the device, then for every rank: a timed run starts with nothing in flight."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def median_ms(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs, the device drained around each run."""
    (samples,) = interleaved_samples_ms([fn], device, warmup=warmup, repeats=repeats)
    return statistics.median(samples)


def interleaved_samples_ms(
    fns: Sequence[Callable[[], Any]], device: torch.device, *, warmup: int, repeats: int
) -> list[list[float]]:
    """Wall times (ms) of each of ``fns`` over ``repeats`` rounds, one run of each per round (in
    turn first) and the device drained around every run: whatever else loads the machine
    meanwhile falls on all of them alike, so the ratio of two runs of one round is a fair sample
    of their ratio."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for round_ in range(repeats):
        for i in (round_ + k for k in range(len(fns))):
            drain(device)
            t0 = time.perf_counter()
            fns[i % len(fns)]()
            drain(device)
            samples[i % len(fns)].append((time.perf_counter() - t0) * 1e3)
    return samples


QUEUED_STEPS = 5  # steps issued without waiting in between, per queued sample


def paired_rounds(
    baseline: Callable[[], Any],
    fn: Callable[[], Any],
    device: Any,
    *,
    repeats: int,
    group: Any = None,
    steps: int = 1,
) -> list[tuple[float, float]]:
    """(baseline ms, mode ms) of each of ``repeats`` rounds, the two runs of a round back to back
    (``interleaved_samples_ms``; under torchrun each run's slowest rank), per step where a run
    is ``steps`` steps (``queued_call``)."""
    base, mode = interleaved_samples_ms([baseline, fn], device, warmup=1, repeats=repeats)
    rounds = slowest_rank_ms({(i, k): ms for i, pair in enumerate(zip(base, mode)) for k, ms in enumerate(pair)}, group)
    return [(rounds[i, 0] / steps, rounds[i, 1] / steps) for i in range(repeats)]


def queued_rounds(
    baseline: Callable[[], Any], fn: Callable[[], Any], device: Any, *, repeats: int, group: Any = None
) -> list[tuple[float, float]]:
    """``paired_rounds`` of runs of ``QUEUED_STEPS`` queued steps each (``queued_call``), per step."""
    return paired_rounds(
        queued_call(baseline), queued_call(fn), device, repeats=repeats, group=group, steps=QUEUED_STEPS
    )


def queued_call(fn: Callable[[], Any], steps: int = QUEUED_STEPS) -> Callable[[], Any]:
    """``steps`` calls of ``fn`` issued one after another, nothing waited for in between: each
    step's launches are queued while the one before runs (stream order keeps a step's input
    copies behind the step before)."""

    def run() -> Any:
        for _ in range(steps):
            out = fn()
        return out

    return run


def slowest_rank_ms(timings_ms: dict[Any, float], group: Any) -> dict[Any, float]:
    """Each timing's largest value over the ranks of ``group`` (every rank holds the same keys, in
    the same order); the timings as they are without a group or over one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return dict(timings_ms)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    values = torch.tensor(list(timings_ms.values()), dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(timings_ms, values.tolist()))


def event_times_ms(fn: Callable[[], Any], *, warmup: int = 5, repeats: int = 30) -> list[float]:
    """Device time (ms, CUDA events on the current stream) of each of ``repeats`` calls of
    ``fn`` after ``warmup`` untimed ones: a kernel's own time, without the host's, for kernel
    micro-benchmarks (a step's time is ``median_ms``'s wall time)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


@dataclass
class Measurement:
    """One configuration's figures; ``graphs`` says whether the two step times are graph
    replays (``eager_baseline_ms`` is then the eager unsplit step, else the baseline itself)."""

    baseline_ms: float
    ubatched_ms: float
    compute_ms: float
    comm_ms: float
    hidden_comm_fraction: float | None
    timeline: list[Interval]
    eager_baseline_ms: float
    graphs: bool = False
    capture_time_ms: dict[int, float] | None = None
    ubatched_busy_ms: tuple[float, float] | None = None  # (compute, comm) busy in one ubatched step
    transfer_ms: tuple[float, float] | None = None  # NCCL time less waiting, (unsplit, ubatched)
    baseline_samples_ms: Sequence[float] = ()  # every timed repeat, in rounds shared with the ubatched ones
    ubatched_samples_ms: Sequence[float] = ()
    # (unsplit, ubatched) ms per step of each round of QUEUED_STEPS steps issued without waiting
    # in between (``queued_rounds``): a graph launch's host time then hides under the step before
    queued_rounds_ms: Sequence[tuple[float, float]] = ()

    def calibration_sample(self) -> dict[str, float]:
        """What ``ubatch.policy.calibrate_from_samples`` reads of a two-ubatch measurement."""
        return {
            "compute_ms": self.compute_ms,
            "comm_ms": self.comm_ms,
            "baseline_ms": self.baseline_ms,
            "ubatched_ms": self.ubatched_ms,
        }

    @property
    def speedup(self) -> float:
        """The measured ratio of the medians, unsplit over ubatched (see ``ruled_out``)."""
        return self.baseline_ms / self.ubatched_ms

    @property
    def speedup_range(self) -> tuple[float, float] | None:
        """(lowest, highest) speedup over the timed rounds, each round's unsplit time over its
        ubatched one (the median's ratio included); None without the samples."""
        if not self.baseline_samples_ms or not self.ubatched_samples_ms:
            return None
        ratios = [b / u for b, u in zip(self.baseline_samples_ms, self.ubatched_samples_ms)] + [self.speedup]
        return min(ratios), max(ratios)

    @property
    def ruled_out(self) -> bool:
        """The speedup beats the ideal by more than its measured spread: in every round the
        split ran faster than perfect overlap of this run's own C and M allows. Then the figure
        is a measurement error (noise, a skewed baseline), not a speedup, and is not reported."""
        spread = self.speedup_range
        return spread is not None and spread[0] > self.ideal_speedup * (1 + 1e-9)

    @property
    def ideal_speedup(self) -> float:
        return ideal_speedup(self.compute_ms, self.comm_ms)

    @property
    def hideable_comm_fraction(self) -> float | None:
        """The most of the communication that compute can cover, min(C, M) / M: a step with
        more communication than compute (M > C) cannot hide all of it, however it is split."""
        return None if self.comm_ms <= 0 else min(self.compute_ms, self.comm_ms) / self.comm_ms

    @property
    def comm_stretch(self) -> float | None:
        """How much longer communication was busy in the ubatched step than in the unsplit one
        (M): above 1 when collectives run slower beside compute or cost more split. Where the
        step is bound by communication, this caps the speedup below the ideal."""
        if self.ubatched_busy_ms is None or self.comm_ms <= 0:
            return None
        return self.ubatched_busy_ms[1] / self.comm_ms

    @property
    def transfer_stretch(self) -> float | None:
        """``comm_stretch`` without the waiting: how much slower collectives moved their data."""
        if self.transfer_ms is None or self.transfer_ms[0] <= 0:
            return None
        return self.transfer_ms[1] / self.transfer_ms[0]

    @property
    def speedup_bound(self) -> float | None:
        """The best any schedule of the ubatched step's own kernels allows: it cannot finish
        before its compute kernels have run, nor before its collectives have moved their data."""
        if self.transfer_ms is None or self.ubatched_busy_ms is None:
            return None
        return self.baseline_ms / max(self.ubatched_busy_ms[0], self.transfer_ms[1])

    @property
    def queued_speedup(self) -> float | None:
        """The median round's unsplit over ubatched time per step with steps queued; None where
        no queued rounds were timed."""
        if not self.queued_rounds_ms:
            return None
        return statistics.median(base / ubatched for base, ubatched in self.queued_rounds_ms)

    def _efficiency_of(self, speedup: float | None) -> float | None:
        if speedup is None or self.ideal_speedup <= 1.0 + 1e-9:
            return None
        return (speedup - 1.0) / (self.ideal_speedup - 1.0)

    @property
    def efficiency(self) -> float | None:
        return None if self.ruled_out else self._efficiency_of(self.speedup)

    @property
    def efficiency_bound(self) -> float | None:
        """``speedup_bound`` as an efficiency: below the target, the kernels, not the schedule,
        stand in the way."""
        return self._efficiency_of(self.speedup_bound)

    def as_dict(self) -> dict[str, Any]:
        ubatched_busy = self.ubatched_busy_ms or (None, None)
        transfer = self.transfer_ms or (None, None)
        spread = self.speedup_range or (None, None)
        figures = {
            "baseline_ms": self.baseline_ms,
            "ubatched_ms": self.ubatched_ms,
            "baseline_min_ms": min(self.baseline_samples_ms, default=None),
            "baseline_max_ms": max(self.baseline_samples_ms, default=None),
            "ubatched_min_ms": min(self.ubatched_samples_ms, default=None),
            "ubatched_max_ms": max(self.ubatched_samples_ms, default=None),
            "speedup": None if self.ruled_out else self.speedup,
            "measured_speedup": self.speedup,
            "speedup_min": spread[0],
            "speedup_max": spread[1],
            "eager_baseline_ms": self.eager_baseline_ms,
            "compute_ms": self.compute_ms,
            "comm_ms": self.comm_ms,
            "ideal_speedup": self.ideal_speedup,
            "efficiency": self.efficiency,
            "hidden_comm_fraction": self.hidden_comm_fraction,
            "hideable_comm_fraction": self.hideable_comm_fraction,
            "ubatched_compute_ms": ubatched_busy[0],
            "ubatched_comm_ms": ubatched_busy[1],
            "comm_stretch": self.comm_stretch,
            "transfer_ms": transfer[0],
            "ubatched_transfer_ms": transfer[1],
            "transfer_stretch": self.transfer_stretch,
            "speedup_bound": self.speedup_bound,
            "efficiency_bound": self.efficiency_bound,
            "queued_baseline_ms": _median_of(base for base, _ in self.queued_rounds_ms),
            "queued_ubatched_ms": _median_of(ubatched for _, ubatched in self.queued_rounds_ms),
            "queued_speedup": self.queued_speedup,
            "queued_efficiency": self._efficiency_of(self.queued_speedup),
        }
        return {
            "graphs": self.graphs,
            "repeats": len(self.baseline_samples_ms),
            "ruled_out": self.ruled_out,
            **{name: None if value is None else round(value, 4) for name, value in figures.items()},
            "capture_time_ms": None
            if self.capture_time_ms is None
            else {n: round(ms, 4) for n, ms in self.capture_time_ms.items()},
        }


def _median_of(values: Any) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def step_forward(runnable: Any, model: Any, step: Step, slices: Any = None) -> Any:
    """``step`` through ``runnable`` (``model`` or a wrapper of it) once, eagerly, in the forward
    context it needs: its attention metadata, ``model``'s attention layers left uncompiled, and the
    ubatch ``slices`` a wrapper cuts it into (None: whole)."""
    with (
        torch.inference_mode(),
        set_forward_context(
            step.attn_metadata,
            no_compile_layers=model.attention_layers,
            ubatch_slices=slices,
            num_tokens=step.num_tokens,
        ),
    ):
        return runnable(step.input_ids, step.positions)


def unsplit_call(model: Any, step: Step) -> Callable[[], Any]:
    """A call that runs ``step`` through ``model`` eagerly, whole."""
    return lambda: step_forward(model, model, step)


class EagerRuns:
    """The eager runs of one step: unsplit, ubatched, and serial on a one-ubatch scheduler.

    The serial run's scheduler has ordinary streams and the default process group whatever the
    SM partition, so C and M describe the step the baseline runs (the whole device), not the
    compute partition: the ideal stays the same for every partition of one step.
    """

    def __init__(self, model: Any, step: Step, num_ubatches: int, *, sm_partition: Any = None) -> None:
        self.model, self.step, self.device = model, step, model.device
        self.wrapper = UBatchWrapper(model, num_ubatches=num_ubatches, device=self.device, sm_partition=sm_partition)
        self.wrapper.scheduler.prepare()
        self.serial_scheduler = UBatchScheduler(1, self.device)
        self.serial_scheduler.prepare()
        self.slices = step.slices(num_ubatches)

    def _run(self, slices: Any, runnable: Callable[[], Any]) -> Any:
        with (
            torch.inference_mode(),
            set_forward_context(
                self.step.attn_metadata,
                no_compile_layers=self.model.attention_layers,
                ubatch_slices=slices,
                num_tokens=self.step.num_tokens,
            ),
        ):
            return runnable()

    def baseline(self) -> Any:
        return unsplit_call(self.model, self.step)()

    def ubatched(self) -> Any:
        return self._run(self.slices, lambda: self.wrapper(self.step.input_ids, self.step.positions))

    def serial(self) -> Any:
        return self._run(
            None, lambda: self.serial_scheduler.run([lambda: self.model(self.step.input_ids, self.step.positions)])
        )

    def serial_costs(self, runs: int = 3) -> tuple[float, float]:
        """(compute ms, comm ms): the medians over ``runs`` traced serial runs."""
        traces = [self.traced(self.serial, self.serial_scheduler) for _ in range(runs)]
        return (
            statistics.median(sum(i.duration_ms for i in t if i.kind == "compute") for t in traces),
            statistics.median(sum(i.duration_ms for i in t if i.kind == "comm") for t in traces),
        )

    def traced(self, fn: Callable[[], Any], scheduler: UBatchScheduler | None = None) -> list[Interval]:
        """``scheduler``'s (default: the wrapper's) timeline of one call of ``fn``, after an
        untraced call."""
        scheduler = scheduler or self.wrapper.scheduler
        fn()
        drain(self.device)
        scheduler.start_trace()
        try:
            fn()
        finally:
            trace = scheduler.stop_trace()
        return trace.intervals()


def measure(
    model: Any, step: Step, num_ubatches: int, *, warmup: int, repeats: int, sm_partition: Any = None
) -> Measurement:
    """Baseline and ubatched timings of one step shape in shared rounds, and the serial-traced
    compute and communication, all eager."""
    runs = EagerRuns(model, step, num_ubatches, sm_partition=sm_partition)
    baseline, ubatched = interleaved_samples_ms(
        [runs.baseline, runs.ubatched], runs.device, warmup=warmup, repeats=repeats
    )
    baseline_ms = statistics.median(baseline)
    compute_ms, comm_ms = runs.serial_costs()
    timeline = runs.traced(runs.ubatched)
    return Measurement(
        baseline_ms,
        statistics.median(ubatched),
        compute_ms,
        comm_ms,
        hidden_comm_fraction(timeline),
        timeline,
        eager_baseline_ms=baseline_ms,
        ubatched_busy_ms=device_busy_ms(timeline, runs.device),
        baseline_samples_ms=baseline,
        ubatched_samples_ms=ubatched,
    )


def device_busy_ms(timeline: list[Interval], device: torch.device) -> tuple[float, float] | None:
    """(compute, comm) busy in a traced step, from CUDA events; None on CPU, where a collective's
    interval is host-observed and includes the time its ubatch sat parked."""
    if device.type != "cuda":
        return None
    return busy_ms(timeline, "compute"), busy_ms(timeline, "comm")
