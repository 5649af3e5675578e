"""ubatch-bench --graphs: the unsplit and the ubatched step replayed from CUDA graphs.

Eager decode is bound by the host launching kernels, so what decides whether a split pays is the
step replayed from graphs. Per configuration (T tokens per rank, N ubatches) a ``GraphedModel``
captures T tokens unsplit and in N ubatches: FULL graphs for decode (uniform, one token per
request), PIECEWISE for prefill and mixed steps; FULL for prefill too where asked
(``graph_mode_for``), when every prompt of the step has the same length. Then, for one step:

- ``baseline_ms`` and ``ubatched_ms``: replays of the unsplit and of the N-ubatch graph, timed in
  shared rounds (medians, with the spread beside them, as in ``ubatch.bench.measure``);
- ``queued_speedup`` (and ``queued_efficiency``): the same with ``QUEUED_STEPS`` replays issued
  back to back per run, so each graph launch's host time hides under the replay before, as in a
  runner that schedules ahead (``queued_baseline_ms`` / ``queued_ubatched_ms``: per step);
- ``eager_baseline_ms``: the unsplit step run eagerly, so the graphs' own gain shows;
- ``compute_ms`` and ``comm_ms`` (and the ideal): how long compute and NCCL kernels were busy
  in one replay of the unsplit graph, from the kernels torch.profiler records
  (``ubatch.bench.kernels``; over a link stand-in whose transfers no profiler sees, M by the
  link's own clock, ``ubatch.bench.link_clock``). Not the eager trace: where an eager step is
  host-bound its launch gaps would count as compute;
- ``hidden_comm_fraction``, ``ubatched_compute_ms``, ``ubatched_comm_ms`` and ``comm_stretch``:
  from the kernels of one replayed ubatched step; None (the fraction) when there are no NCCL
  kernels (one rank);
- ``transfer_ms`` / ``ubatched_transfer_ms``, ``transfer_stretch``, ``speedup_bound`` and
  ``efficiency_bound``: the NCCL time less waiting for other ranks (``kernels.transfer_ms``), and
  the best any schedule of the ubatched step's own kernels could reach;
- ``capture_time_ms``: a short, separate timing of both graphs right after capture, what a
  runner can afford at start-up; the auto policy picks the faster per size from it.

The graphs are released before this returns: NCCL's communicator teardown hangs while a graph
that captured one of its collectives is alive.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ubatch.bench.kernels import gathered_transfer_ms, hidden_kernel_fraction, kernel_costs, profile_kernels
from ubatch.bench.link_clock import link_busy_ms, untraced_link
from ubatch.bench.measure import Measurement, interleaved_samples_ms, median_ms, queued_rounds, unsplit_call
from ubatch.bench.workload import Step
from ubatch.context import CUDAGraphMode
from ubatch.graphed import GraphedModel, uniform_token_count

GRAPH_MODES = {"decode": CUDAGraphMode.FULL, "prefill": CUDAGraphMode.PIECEWISE, "mixed": CUDAGraphMode.PIECEWISE}
PREFILL_GRAPHS = ("piecewise", "full")


def graph_mode_for(workload: str, prefill_graphs: str = "piecewise") -> CUDAGraphMode:
    """The graphs a workload's steps replay from: ``GRAPH_MODES``, or FULL for prefill with
    ``prefill_graphs="full"``. A FULL graph of prompts of one length holds no host-side lengths
    (the attention gathers the block table's width, see ``ubatch.attention.varlen``), so it stays
    right for any prompts of that length and context; no eager island runs between its kernels,
    where a PIECEWISE replay launches every collective and attention call from the host."""
    if prefill_graphs not in PREFILL_GRAPHS:
        raise ValueError(f"prefill_graphs must be one of {', '.join(PREFILL_GRAPHS)}, got {prefill_graphs!r}")
    if workload == "prefill" and prefill_graphs == "full":
        return CUDAGraphMode.FULL
    return GRAPH_MODES[workload]


def step_uniform_tokens(model: Any, step: Step) -> int:
    """Tokens per request of a step whose requests all have as many (what its FULL graphs are
    captured for: 1 in decode); 1 otherwise, where only PIECEWISE graphs apply."""
    return uniform_token_count(step.attn_metadata[model.layer_names[0]]) or 1


def measure_graphs(
    model: Any,
    step: Step,
    num_ubatches: int,
    *,
    mode: CUDAGraphMode,
    warmup: int,
    repeats: int,
    sm_partition: Any = None,
    chrome_trace: str | None = None,
) -> Measurement:
    """Graph-replayed baseline and ubatched step, with the eager unsplit step beside them."""
    device = model.device
    eager_baseline_ms = median_ms(unsplit_call(model, step), device, warmup=warmup, repeats=repeats)
    graphed = GraphedModel(
        model,
        capture_sizes=[step.num_tokens],
        max_blocks_per_req=_blocks_per_request(model, step),
        ubatch_counts=(1, num_ubatches),
        uniform_token_count=step_uniform_tokens(model, step),
        modes=(mode,),
        sm_partition=sm_partition,
    )
    try:
        graphed.capture()
        baseline, ubatched = (replay_call(graphed, step, n, mode) for n in (1, num_ubatches))
        capture_time_ms = {
            n: median_ms(fn, device, warmup=1, repeats=3) for n, fn in ((1, baseline), (num_ubatches, ubatched))
        }
        baseline_samples, ubatched_samples = interleaved_samples_ms(
            [baseline, ubatched], device, warmup=warmup, repeats=repeats
        )
        ranks = dist.group.WORLD if dist.is_initialized() else None  # each round's slowest rank
        queued = queued_rounds(baseline, ubatched, device, repeats=repeats, group=ranks)
        baseline_kernels = profile_kernels(baseline, device)
        kernels = profile_kernels(ubatched, device, chrome_trace=chrome_trace)
        link = untraced_link(model)  # its transfers are not in the traces: its own clock times them
        link_ms = None if link is None else [link_busy_ms(fn, device, link) for fn in (baseline, ubatched)]
    finally:
        graphed.release()
    compute_ms, comm_ms = kernel_costs(baseline_kernels)
    ubatched_busy = kernel_costs(kernels)
    hidden = hidden_kernel_fraction(kernels)
    transfer = gathered_transfer_ms(baseline_kernels), gathered_transfer_ms(kernels)
    if link_ms is not None:  # the traces hold no transfer: nothing to say what hid or waited
        comm_ms, ubatched_busy = link_ms[0], (ubatched_busy[0], link_ms[1])
        hidden, transfer = None, (None, None)
    return Measurement(
        statistics.median(baseline_samples),
        statistics.median(ubatched_samples),
        compute_ms,
        comm_ms,
        hidden,
        [],
        eager_baseline_ms=eager_baseline_ms,
        graphs=True,
        capture_time_ms=capture_time_ms,
        ubatched_busy_ms=ubatched_busy,
        transfer_ms=None if None in transfer else transfer,
        baseline_samples_ms=baseline_samples,
        ubatched_samples_ms=ubatched_samples,
        queued_rounds_ms=queued,
    )


def _blocks_per_request(model: Any, step: Step) -> int:
    return step.attn_metadata[model.layer_names[0]].block_table.shape[1]


def replay_call(
    graphed: GraphedModel, step: Step, num_ubatches: int, mode: CUDAGraphMode
) -> Callable[[], torch.Tensor]:
    """A call that replays the step's graph of ``num_ubatches``. A capture that failed leaves
    the step to run eagerly (with a warning); timing that as a replay would be wrong, so it raises."""
    md = step.attn_metadata[graphed.model.layer_names[0]]
    desc = graphed.plan(md.num_actual_tokens, md.num_reqs, uniform_token_count(md), num_ubatches=num_ubatches)
    if desc is None or desc.cg_mode != mode:
        raise RuntimeError(
            f"no {mode.name} graph of {md.num_actual_tokens} tokens in {num_ubatches} ubatch(es) "
            f"to replay (planned: {desc}); did its capture fail? See the warning above"
        )

    def replay() -> torch.Tensor:
        with torch.inference_mode():
            return graphed.replay(desc, step.input_ids, step.positions, md)

    return replay
