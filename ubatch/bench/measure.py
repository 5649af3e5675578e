"""Time one configuration: unsplit baseline, ubatched, and the serial compute / comm split.

Every figure of a result comes from the same process and run. The compute and communication
times come from a traced single-ubatch run (the same kernels, strictly serial: each collective
waits for the compute before it and the compute after it waits for the collective), so the ideal
speedup (C+M)/max(C,M) is measured, not modelled.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ubatch.bench.workload import Step
from ubatch.context import set_forward_context
from ubatch.trace import Interval, hidden_comm_fraction
from ubatch.wrapper import UBatchWrapper


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def median_ms(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs, the device drained around each run."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


@dataclass
class Measurement:
    baseline_ms: float
    ubatched_ms: float
    compute_ms: float
    comm_ms: float
    hidden_comm_fraction: float | None
    timeline: list[Interval]

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.ubatched_ms

    @property
    def ideal_speedup(self) -> float:
        longer = max(self.compute_ms, self.comm_ms)
        return (self.compute_ms + self.comm_ms) / longer if longer > 0 else 1.0

    @property
    def efficiency(self) -> float | None:
        if self.ideal_speedup <= 1.0 + 1e-9:
            return None
        return (self.speedup - 1.0) / (self.ideal_speedup - 1.0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "baseline_ms": round(self.baseline_ms, 4),
            "ubatched_ms": round(self.ubatched_ms, 4),
            "speedup": round(self.speedup, 4),
            "compute_ms": round(self.compute_ms, 4),
            "comm_ms": round(self.comm_ms, 4),
            "ideal_speedup": round(self.ideal_speedup, 4),
            "efficiency": None if self.efficiency is None else round(self.efficiency, 4),
            "hidden_comm_fraction": None
            if self.hidden_comm_fraction is None
            else round(self.hidden_comm_fraction, 4),
        }


def measure(model: Any, step: Step, num_ubatches: int, *, warmup: int, repeats: int,
            sm_partition: Any = None) -> Measurement:
    """Baseline, ubatched and serial-traced timings of one step shape."""
    device = model.device
    wrapper = UBatchWrapper(model, num_ubatches=num_ubatches, device=device, sm_partition=sm_partition)
    wrapper.scheduler.prepare()
    slices = step.slices(num_ubatches)

    def run(slices_: Any, runnable: Callable[[], Any]) -> Any:
        with torch.inference_mode(), set_forward_context(
            step.attn_metadata, no_compile_layers=model.attention_layers, ubatch_slices=slices_,
            num_tokens=step.num_tokens,
        ):
            return runnable()

    def baseline() -> Any:
        return run(None, lambda: model(step.input_ids, step.positions))

    def ubatched() -> Any:
        return run(slices, lambda: wrapper(step.input_ids, step.positions))

    def serial() -> Any:
        return run(None, lambda: wrapper.scheduler.run([lambda: model(step.input_ids, step.positions)]))

    baseline_ms = median_ms(baseline, device, warmup=warmup, repeats=repeats)
    ubatched_ms = median_ms(ubatched, device, warmup=warmup, repeats=repeats)
    serial_trace = _traced(wrapper, serial, device)
    compute_ms = sum(i.duration_ms for i in serial_trace if i.kind == "compute")
    comm_ms = sum(i.duration_ms for i in serial_trace if i.kind == "comm")
    timeline = _traced(wrapper, ubatched, device)
    return Measurement(baseline_ms, ubatched_ms, compute_ms, comm_ms, hidden_comm_fraction(timeline), timeline)


def _traced(wrapper: UBatchWrapper, fn: Callable[[], Any], device: torch.device) -> list[Interval]:
    fn()
    _sync(device)
    wrapper.scheduler.start_trace()
    try:
        fn()
    finally:
        trace = wrapper.scheduler.stop_trace()
    return trace.intervals()
