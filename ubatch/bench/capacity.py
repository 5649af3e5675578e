"""How much of a step a capacity-bounded MoE model drops, and a capacity measured from the run.

With a finite ``capacity_factor`` each expert-parallel rank sends at most a fixed number of rows
to each peer (what keeps the all-to-all small at 4-8 ranks), and assignments past it are dropped.
A split step bounds each ubatch on its own, so it can drop differently from the unsplit step:
a benchmark that sets a capacity reports both, or its speedup would hide a change in the output.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ubatch.bench.measure import EagerRuns
from ubatch.bench.modes import eager_call
from ubatch.bench.workload import Step
from ubatch.models.capacity import measure_capacity
from ubatch.overlap import supported


def _dropped_share(counters: list[torch.Tensor], run: Callable[[], Any], assignments: int) -> float:
    """Share of the (token, expert) assignments of one call of ``run`` that were dropped, over
    every rank (the counters are the layers' device counters; reset before and after)."""
    for counter in counters:
        counter.zero_()
    run()
    dropped = torch.stack(counters).sum().to(torch.float64)
    total = torch.tensor(float(assignments), dtype=torch.float64, device=dropped.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        both = torch.stack([dropped, total])
        dist.all_reduce(both)
        dropped, total = both[0], both[1]
    for counter in counters:
        counter.zero_()
    return float(dropped / total)


def dropped_fractions(
    model: Any, step: Step, num_ubatches: int, *, sm_partition: Any = None
) -> dict[str, float] | None:
    """{"unsplit": share, "ubatched": share} of the step's assignments dropped for lack of
    capacity, or None for a model without a finite capacity (nothing can be dropped)."""
    config = model.config
    if not getattr(config, "num_experts", 0) or config.capacity_factor is None:
        return None
    counters = list(model.overflow_counters().values())
    runs = EagerRuns(model, step, num_ubatches, sm_partition=sm_partition)
    assignments = step.num_tokens * config.top_k * len(counters)
    with torch.inference_mode():
        return {
            "unsplit": _dropped_share(counters, runs.baseline, assignments),
            "ubatched": _dropped_share(counters, runs.ubatched, assignments),
        }


def set_measured_capacity(
    model: Any, args: argparse.Namespace, step_at: Callable[[int], Step], margin: float
) -> dict[str, Any]:
    """Measure the routing fill of one eager run of every supported mode at every ``--tokens``
    size, and set every MoE layer's capacity factors from it (what the report's
    ``setup.capacity`` says)."""

    def runs() -> Iterator[Callable[[], Any]]:
        for tokens in args.tokens:
            step = step_at(tokens)  # binds its KV cache: run its modes before the next size's
            for mode in supported(model, args.modes):
                yield eager_call(model, step, mode)

    measured = measure_capacity(model, runs(), margin=margin, group=dist.group.WORLD if dist.is_initialized() else None)
    measured.apply(model)
    return measured.report()
