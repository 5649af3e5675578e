"""ubatch-bench --modes: every overlap mode of one step side by side, in one run.

Per mode (``ubatch.overlap.OverlapMode``) the step is timed ``repeats`` times (median, min and
max), eagerly or replayed from CUDA graphs (FULL for decode, PIECEWISE otherwise), and compared
with the unsplit step of the same run:

- ``speedup``: unsplit median over the mode's median;
- ``compute_ms`` / ``comm_ms``: how long compute and communication were busy in the unsplit step
  (graphs: from its profiled kernels, where the link stand-in's host copies, its pacing
  included, count as communication; eager: the serial trace of ``ubatch.bench.measure``); the ideal is
  (C + M) / max(C, M) and ``efficiency`` (speedup - 1) / (ideal - 1);
- ``queued_ms`` / ``queued_speedup``: the same with ``QUEUED_STEPS`` steps issued one after
  another without waiting between them, as a serving loop that does not wait for each step's
  output issues them: the host's time to launch a step (a FULL graph's launch alone took 0.4-0.5
  ms on an H100) then hides under the step before, where a drained run pays it every step; the
  ideal above counts kernel time only, so the queued figures are the ones it bounds;
- ``auto``: the mode the policy picks from a short timing of every mode right after capture (what
  a runner can afford at start-up; close calls timed again, see ``sweep_modes``), beside the best
  measured mode.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.bench.ceiling import ceiling_fields
from ubatch.bench.graphs import graph_mode_for, replay_call, step_uniform_tokens
from ubatch.bench.kernels import attention_share, kernel_costs, profile_kernels
from ubatch.bench.link_clock import link_busy_ms, untraced_link
from ubatch.bench.measure import (
    EagerRuns,
    drain,
    paired_rounds,
    queued_rounds,
    slowest_rank_ms,
    step_forward,
)
from ubatch.bench.roofline import device_ceilings, roofline_fields, shard_worlds
from ubatch.bench.schedule import DEFAULT_ATTENTION_SHARE, ideal_speedup, mode_step_ms
from ubatch.bench.workload import Step
from ubatch.context import CUDAGraphMode
from ubatch.graphed import GraphedModel
from ubatch.models.dispatch import balanced_chunk_rows
from ubatch.overlap import OverlapMode, apply_mode, moe_layers, supported
from ubatch.policy import ModePolicy
from ubatch.sm import SMPartition
from ubatch.wrapper import UBatchWrapper

QUICK_REPEATS = 3  # the short timing the mode policy picks from
RUNOFF_MARGIN = 0.05  # short timings this close to the fastest are timed again
RUNOFF_ROUNDS = 2  # each close mode ends with 1 + RUNOFF_ROUNDS short timings, their median kept
PAIRED_ROUNDS = 3  # a pick that is not the measured best is timed against it this often, back to back
COST_REPLAYS = 3  # profiled replays of the unsplit step whose median C and M the ideal takes


@dataclass(frozen=True)
class Timing:
    """A run's wall time over repeats; ``host_ms`` is the median time the host took to issue one
    run (return from the call, before its device work is waited for): a step whose ``host_ms``
    nears its ``median_ms`` is bound by its launches, not by the GPU."""

    median_ms: float
    min_ms: float
    max_ms: float
    host_ms: float | None = None

    @classmethod
    def of(cls, samples_ms: Sequence[float], host_samples_ms: Sequence[float] | None = None) -> Timing:
        host = statistics.median(host_samples_ms) if host_samples_ms else None
        return cls(statistics.median(samples_ms), min(samples_ms), max(samples_ms), host)

    @property
    def spread(self) -> float:
        """(max - min) / median: how far one repeat can stray."""
        return (self.max_ms - self.min_ms) / self.median_ms if self.median_ms > 0 else 0.0


def sample_ms(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> Timing:
    """Wall time of ``fn`` over ``repeats`` runs, the device drained around each run."""
    for _ in range(warmup):
        fn()
    samples, issued = [], []
    for _ in range(repeats):
        drain(device)
        t0 = time.perf_counter()
        fn()
        issued.append((time.perf_counter() - t0) * 1e3)
        drain(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return Timing.of(samples, issued)


def mode_partition(mode: OverlapMode, default: Any, device: Any, made: dict[int, SMPartition]) -> Any:
    """The SM partition ``mode`` runs under: its own green one (``@greenK``; one per K, made
    once into ``made``), else ``default``; None for a mode that does not run as ubatches."""
    if not mode.runs_as_ubatches:
        return None
    if mode.comm_sms is None:
        return default
    if mode.comm_sms not in made:
        made[mode.comm_sms] = SMPartition("green", mode.comm_sms, device)
    return made[mode.comm_sms]


def partition_fields(partition: Any) -> dict[str, Any]:
    """A report row's ``sm_partition`` and ``comm_sms`` for a mode run under ``partition``."""
    if partition is None:
        return {"sm_partition": "none", "comm_sms": None}
    mode = partition.effective_mode
    return {"sm_partition": mode, "comm_sms": None if mode == "none" else partition.comm_sms_for()}


def eager_call(model: Any, step: Step, mode: OverlapMode, sm_partition: Any = None) -> Callable[[], Any]:
    """A call that runs ``step`` eagerly in ``mode`` (expert chunks applied for the call)."""
    runnable = (
        UBatchWrapper(model, num_ubatches=mode.num_ubatches, device=model.device, sm_partition=sm_partition)
        if mode.runs_as_ubatches
        else model
    )
    slices = step.slices(mode.num_ubatches) if mode.runs_as_ubatches else None

    def run() -> Any:
        with mode_in_force(model, mode):
            return step_forward(runnable, model, step, slices)

    return run


@contextmanager
def mode_in_force(model: Any, mode: OverlapMode) -> Iterator[None]:
    """``mode`` applied to ``model`` in the ``with`` body, the unsplit mode put back after it."""
    apply_mode(model, mode)
    try:
        yield
    finally:
        apply_mode(model, OverlapMode())


class GraphedMode:
    """One mode's graph of the step, captured on entry and released on exit."""

    def __init__(
        self, model: Any, step: Step, mode: OverlapMode, graph_mode: CUDAGraphMode, sm_partition: Any = None
    ) -> None:
        self.model, self.step, self.mode, self.graph_mode = model, step, mode, graph_mode
        blocks = step.attn_metadata[model.layer_names[0]].block_table.shape[1]
        apply_mode(model, mode)
        self.graphed = GraphedModel(
            model,
            capture_sizes=[step.num_tokens],
            max_blocks_per_req=blocks,
            ubatch_counts=(mode.num_ubatches,),
            uniform_token_count=step_uniform_tokens(model, step),
            modes=(graph_mode,),
            sm_partition=sm_partition,
            single_batch_overlap=mode.runs_as_ubatches,
        )

    def __enter__(self) -> Callable[[], Any]:
        try:
            self.graphed.capture()
            return replay_call(self.graphed, self.step, self.mode.num_ubatches, self.graph_mode)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.graphed.release()
        apply_mode(self.model, OverlapMode())
        torch.cuda.empty_cache()  # a released graph's private pool stays reserved, out of the next capture's reach


def sweep_modes(
    model: Any,
    step: Step,
    modes: Sequence[OverlapMode],
    *,
    graph_mode: CUDAGraphMode | None,
    warmup: int,
    repeats: int,
    sm_partition: Any = None,
    chrome_trace: str | None = None,
    group: Any = None,
) -> dict[str, Any]:
    """Time every mode of ``step`` (``modes[0]`` must be unsplit) and the unsplit step's C and M;
    under graphs, ``chrome_trace`` keeps torch.profiler's trace of one replay of ``modes[1]``
    (what overlapped: its kernels and the link's copies, per stream). Ubatched modes run under
    ``sm_partition`` unless they name their own (``@greenK``).

    Besides the measured figures, each mode gets a short timing right after capture and the same
    ``warmup`` as theirs (``capture_time_ms``, what the policy picks from: a PIECEWISE split's
    first replays after capture once read 8% slower than its later ones); the modes whose short
    timings lie within ``RUNOFF_MARGIN`` of the fastest are timed again, captured anew, in
    alternating order (``runoff``), since ``QUICK_REPEATS`` repeats cannot tell them apart.

    Ranks whose steps run collectives together must time the same modes in the same order: give
    them ``group`` (the ranks' process group), and every short timing is the slowest rank's, so
    they agree on the runoff and on the pick.

    The baseline stays captured through the sweep, and every other mode is also timed against it
    back to back, round by round (``paired_speedups``), which the 1-3% a mode's cost moves between
    timed blocks cannot blur. Under graphs the baseline is timed again after every other mode, and
    that timing is the one the rows' ``speedup`` compares against (``first_baseline_ms`` keeps the
    first): on an H200 the graphs a process captures first replayed their kernels 0.4 us closer
    together than once a ubatch's streams had run (``scripts/probe_graph_launch.py``), an edge only
    the baseline, captured first, would get."""
    if modes[0] != OverlapMode():
        raise ValueError(f"the first mode must be unsplit (the baseline), got {modes[0].name}")
    device = model.device
    timings: dict[str, Timing] = {}
    quick: dict[str, list[float]] = {}
    dropped: dict[str, float | None] = {}
    partitions: dict[str, dict[str, Any]] = {}
    made: dict[int, SMPartition] = {}
    paired: dict[str, list[float]] = {}
    queued: dict[str, list[tuple[float, float]]] = {}
    with ExitStack() as baseline_scope:
        baseline = None
        for mode in modes:
            partition = mode_partition(mode, sm_partition, device, made)
            partitions[mode.name] = partition_fields(partition)
            with ExitStack() as mode_scope:
                scope = mode_scope if baseline is not None else baseline_scope  # the baseline stays
                fn = in_mode(model, mode, scope.enter_context(mode_call(model, step, mode, graph_mode, partition)))
                quick[mode.name] = [sample_ms(fn, device, warmup=warmup, repeats=QUICK_REPEATS).median_ms]
                timings[mode.name] = sample_ms(fn, device, warmup=0, repeats=repeats)  # warm from the short timing
                dropped[mode.name] = dropped_share(model, fn, step)
                if baseline is None:
                    baseline = fn
                    if graph_mode is not None:
                        compute_ms, comm_ms, comm_samples, share = unsplit_costs(fn, device, untraced_link(model))
                else:
                    paired[mode.name] = paired_speedups(baseline, fn, device, repeats=repeats, group=group)
                    queued[mode.name] = queued_rounds(baseline, fn, device, repeats=repeats, group=group)
                    if graph_mode is not None and chrome_trace and mode == modes[1]:
                        profile_kernels(fn, device, chrome_trace=chrome_trace)
        first = slowest_rank_ms({name: ms[0] for name, ms in quick.items()}, group)
        runoff = [m for m in modes if m.name in close_calls(first)]
        if len(runoff) > 1:
            for round_ in range(RUNOFF_ROUNDS):
                for mode in runoff if round_ % 2 else reversed(runoff):
                    partition = mode_partition(mode, sm_partition, device, made)
                    with mode_call(model, step, mode, graph_mode, partition) as fn:
                        fn = in_mode(model, mode, fn)
                        quick[mode.name].append(sample_ms(fn, device, warmup=warmup, repeats=QUICK_REPEATS).median_ms)
        first_baseline_ms = None
        if graph_mode is not None and len(modes) > 1:
            first_baseline_ms = timings[modes[0].name].median_ms
            timings[modes[0].name] = sample_ms(baseline, device, warmup=warmup, repeats=repeats)
    if graph_mode is None:
        compute_ms, comm_ms = EagerRuns(model, step, 1).serial_costs()
        comm_samples, share = [comm_ms], None
    return {
        "timings": timings,
        "first_baseline_ms": first_baseline_ms,
        "capture_time_ms": slowest_rank_ms({name: statistics.median(ms) for name, ms in quick.items()}, group),
        "runoff": [m.name for m in runoff] if len(runoff) > 1 else [],
        "compute_ms": compute_ms,
        "comm_ms": comm_ms,
        "comm_ms_samples": comm_samples,
        "attention_share": share,
        "dropped_fraction": dropped,
        "partitions": partitions,
        "paired_speedups": paired,
        "queued_rounds": queued,
    }


def unsplit_costs(
    fn: Callable[[], Any], device: Any, link: Any = None
) -> tuple[float, float, list[float], float | None]:
    """(C ms, M ms, each replay's M, the attention share) of the unsplit step: the medians over
    ``COST_REPLAYS`` profiled replays. One replay's M is one sample of the link's rate, and the
    ideal, the efficiency and ``scripts/sweep_at_ratio.py``'s M / C all rest on it (run 16: M
    23.1 and 27.4 ms at one setting in two processes); over a ``link`` whose transfers a profiler
    does not see (``link_clock.untraced_link``), each M is the link's own clock over a replay. The
    share (``kernels.attention_share``) is None where a replay's collectives do not pair up (none
    without communication, or none in the trace)."""
    replays = [profile_kernels(fn, device) for _ in range(COST_REPLAYS)]
    costs = [kernel_costs(kernels) for kernels in replays]
    shares = [attention_share(kernels) for kernels in replays]
    if link is None:
        comm = [m for _, m in costs]
    else:
        comm = [link_busy_ms(fn, device, link) for _ in range(COST_REPLAYS)]
    share = None if None in shares else statistics.median(shares)
    return statistics.median(c for c, _ in costs), statistics.median(comm), comm, share


def in_mode(model: Any, mode: OverlapMode, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with ``mode`` put in force before each call: the baseline's graph stays alive beside
    every other mode's, and a PIECEWISE replay's eager islands read the model's expert groups."""

    def call() -> Any:
        apply_mode(model, mode)
        return fn()

    return call


def paired_speedups(
    baseline: Callable[[], Any], fn: Callable[[], Any], device: Any, *, repeats: int, group: Any = None
) -> list[float]:
    """Baseline over mode, one ratio per round of ``repeats``, the two runs of a round back to back
    (``paired_rounds``): a stretch of load on the machine falls on both runs of a round, so the
    ratios stray far less than two medians taken seconds apart (1.6-2.7% between two timings of
    one baseline on an H200)."""
    return [base / mode for base, mode in paired_rounds(baseline, fn, device, repeats=repeats, group=group)]


def close_calls(quick_ms: dict[str, float], margin: float = RUNOFF_MARGIN) -> list[str]:
    """The modes whose short timing lies within ``margin`` of the fastest one's."""
    fastest = min(quick_ms.values())
    return [name for name, ms in quick_ms.items() if ms <= fastest * (1 + margin)]


@contextmanager
def mode_call(
    model: Any, step: Step, mode: OverlapMode, graph_mode: CUDAGraphMode | None, partition: Any
) -> Iterator[Callable[[], Any]]:
    """A call that runs ``step`` in ``mode``: replayed from a graph captured for the block (and
    released after it), or eagerly without ``graph_mode``."""
    if graph_mode is None:
        yield eager_call(model, step, mode, partition)
        return
    with GraphedMode(model, step, mode, graph_mode, partition) as fn:
        yield fn


def dropped_share(model: Any, fn: Callable[[], Any], step: Step) -> float | None:
    """Share of one call's (token, expert) assignments dropped for lack of capacity (this rank),
    or None for a model that cannot drop any (no MoE layer with a finite capacity)."""
    layers = [layer for layer in moe_layers(model) if layer.capacity_factor is not None]
    if not layers:
        return None
    for layer in layers:
        layer.overflow_count.zero_()
    fn()
    dropped = sum(int(layer.overflow_count) for layer in layers)
    for layer in layers:
        layer.overflow_count.zero_()
    return dropped / (step.num_tokens * layers[0].top_k * len(layers))


def mode_rows(sweep: dict[str, Any], modes: Sequence[OverlapMode]) -> list[dict[str, Any]]:
    """One report row per mode, every figure against the same run's unsplit step and ideal."""
    base, first = sweep["timings"]["unsplit"], sweep.get("first_baseline_ms")
    paired = sweep.get("paired_speedups", {})
    queued = sweep.get("queued_rounds", {})
    c, m = sweep["compute_ms"], sweep["comm_ms"]
    ideal = ideal_speedup(c, m)
    queued_base = [base for rounds in queued.values() for base, _ in rounds]
    samples = sweep.get("comm_ms_samples")
    comm_range = [round(min(samples), 4), round(max(samples), 4)] if samples else None
    rows = []
    for mode in modes:
        t = sweep["timings"][mode.name]
        speedup = base.median_ms / t.median_ms
        # The ratio of two medians strays by about the two spreads together.
        spread = base.spread + t.spread
        rows.append(
            {
                "mode": mode.name,
                "num_ubatches": mode.num_ubatches,
                "expert_chunks": mode.expert_chunks,
                "token_chunks": mode.token_chunks,
                "join_experts": mode.join_experts,
                "single_batch": mode.single_batch,
                **sweep["partitions"][mode.name],
                "median_ms": round(t.median_ms, 4),
                "min_ms": round(t.min_ms, 4),
                "max_ms": round(t.max_ms, 4),
                "host_ms": None if t.host_ms is None else round(t.host_ms, 4),
                "speedup": round(speedup, 4),
                "speedup_spread": round(speedup * spread, 4),
                "compute_ms": round(c, 4),
                "comm_ms": round(m, 4),
                "comm_ms_range": comm_range,
                "ideal_speedup": round(ideal, 4),
                "efficiency": None if ideal <= 1 + 1e-9 else round((speedup - 1) / (ideal - 1), 4),
                "above_ideal": speedup > ideal * (1 + spread),
                "dropped_fraction": sweep["dropped_fraction"].get(mode.name),
                "baseline_first_ms": None if first is None else round(first, 4),
                **paired_fields(paired.get(mode.name), ideal),
                **queued_fields(queued.get(mode.name), queued_base if mode == modes[0] else None, ideal),
            }
        )
    return rows


def queued_fields(
    rounds: Sequence[tuple[float, float]] | None, baseline_ms: Sequence[float] | None, ideal: float
) -> dict[str, Any]:
    """``queued_ms`` (the median round's per-step time, steps queued: ``QUEUED_STEPS``), and for a
    mode but the baseline, its speedup over the baseline round by round as ``paired_fields``
    gives it (``queued_speedup``, ``queued_speedup_iqr``, ``queued_efficiency``); the baseline's
    ``queued_ms`` is the median over every mode's rounds (``baseline_ms``). All None where nothing
    was queued (the baseline alone)."""
    if rounds:
        paired = paired_fields([base / mode for base, mode in rounds], ideal)
        own_ms = [mode for _, mode in rounds]
    else:
        paired = paired_fields(None, ideal)
        own_ms = list(baseline_ms or [])
    return {
        "queued_ms": round(statistics.median(own_ms), 4) if own_ms else None,
        **{key.replace("paired", "queued"): value for key, value in paired.items()},
    }


def paired_fields(speedups: Sequence[float] | None, ideal: float) -> dict[str, Any]:
    """``paired_speedup`` (the median round's baseline over mode), the middle half of the rounds
    around it (``paired_speedup_iqr``) and the efficiency it gives; None for the baseline."""
    if not speedups:
        return {"paired_speedup": None, "paired_speedup_iqr": None, "paired_efficiency": None}
    median = statistics.median(speedups)
    q1, _, q3 = statistics.quantiles(speedups, n=4, method="inclusive") if len(speedups) > 1 else [median] * 3
    return {
        "paired_speedup": round(median, 4),
        "paired_speedup_iqr": [round(q1, 4), round(q3, 4)],
        "paired_efficiency": None if ideal <= 1 + 1e-9 else round((median - 1) / (ideal - 1), 4),
    }


def payload_ratio(model: Any, step: Step, mode: OverlapMode) -> float:
    """Rows ``mode``'s dispatches send in one MoE layer over the rows the unsplit step's sends
    (``MoEFFN.static_rows`` of each ubatch: its capacity per call shape, padded for its own
    fullest block); 1 where the link pays for no padding (no MoE layer, or one that charges its
    real rows: no capacity factor, or a link that sizes transfers on the GPU)."""
    layer = next(iter(moe_layers(model)), None)
    if layer is None or layer.charges_real_rows:
        return 1.0

    def rows(m: OverlapMode) -> int:
        with mode_in_force(model, m):
            return sum(layer.static_rows(s.token_slice.stop - s.token_slice.start) for s in step.slices(m.num_ubatches))

    return rows(mode) / rows(OverlapMode())


def chunk_shares(model: Any, step: Step, mode: OverlapMode) -> list[float] | None:
    """Each expert group's share of the rows ``mode``'s first ubatch dispatches (``MoEFFN.capacity``
    per chunk; where the link is charged real rows, what a uniform router sends), for the
    schedule model; None where the mode has no expert groups or the model no MoE layer."""
    layer = next(iter(moe_layers(model)), None)
    if layer is None or mode.expert_chunks == 1:
        return None
    first = step.slices(mode.num_ubatches)[0].token_slice
    num_tokens = first.stop - first.start
    if layer.charges_real_rows:
        experts = layer.num_local_experts * layer.ep_world
        rows = balanced_chunk_rows(num_tokens, experts, layer.top_k, layer.ep_world, mode.expert_chunks)
    else:
        with mode_in_force(model, mode):
            rows = layer.capacity(num_tokens)
    total = sum(rows)
    return [r / total for r in rows] if total > 0 else None


def model_fields(
    mode: OverlapMode,
    *,
    compute_ms: float,
    comm_ms: float,
    payload_ratio: float = 1.0,
    reread_ms: float | None = None,
    **model: Any,
) -> dict[str, Any]:
    """A report row's ``schedule_model_ms`` (``ubatch.bench.schedule.mode_step_ms``: the step time
    the schedule allows ``mode`` from the run's C and its M times the mode's ``payload_ratio``
    (the padding its smaller dispatches send), nothing slower when overlapped, no split tax) and
    the efficiency it gives against the run's ideal (``schedule_model_efficiency``), and the same
    with the weights the mode reads again charged to its compute (``schedule_model_taxed_ms`` /
    ``_efficiency``, from the ceiling's ``reread_ms``): the split's tax no schedule hides, which
    the plain model leaves out and which ranks modes differently. None where the model does not
    describe the mode, an efficiency only where there is communication to hide, and no taxed
    figures without ``reread_ms``."""
    ideal = ideal_speedup(compute_ms, comm_ms)

    def step_and_efficiency(compute: float) -> tuple[float | None, float | None]:
        ms = mode_step_ms(mode, compute_ms=compute, comm_ms=comm_ms * payload_ratio, **model)
        if ms is None or not ms > 0 or ideal <= 1 + 1e-9:
            return ms, None
        return ms, round(((compute_ms + comm_ms) / ms - 1) / (ideal - 1), 4)

    ms, efficiency = step_and_efficiency(compute_ms)
    taxed_ms, taxed_efficiency = (None, None) if reread_ms is None else step_and_efficiency(compute_ms + reread_ms)
    return {
        "payload_ratio": round(payload_ratio, 4),
        "schedule_model_ms": None if ms is None else round(ms, 4),
        "schedule_model_efficiency": efficiency,
        "schedule_model_taxed_ms": None if taxed_ms is None else round(taxed_ms, 4),
        "schedule_model_taxed_efficiency": taxed_efficiency,
    }


def model_attention_share(given: float | None, measured: float | None) -> float:
    """The attention share the schedule model takes: ``--attention-share`` where given, else the
    unsplit replay's (``kernels.attention_share``), else ``DEFAULT_ATTENTION_SHARE`` (no
    communication to find the layers' collectives by, or eager steps)."""
    if given is not None:
        return given
    return DEFAULT_ATTENTION_SHARE if measured is None else measured


def auto_point(sweep: dict[str, Any], modes: Sequence[OverlapMode], num_tokens: int) -> dict[str, Any]:
    """The policy's pick from the post-capture timings beside the best measured mode."""
    policy = ModePolicy({mode.name: {num_tokens: sweep["capture_time_ms"][mode.name]} for mode in modes})
    choice = policy.decide(num_tokens)
    measured = {name: t.median_ms for name, t in sweep["timings"].items()}
    best = min(measured, key=measured.get)
    return {
        "choice": choice,
        "best": best,
        "auto_ms": round(measured[choice], 4),
        "best_ms": round(measured[best], 4),
        "auto_vs_best": round(measured[best] / measured[choice], 4),
        "capture_time_ms": {name: round(ms, 4) for name, ms in sweep["capture_time_ms"].items()},
        "runoff": sweep["runoff"],
    }


def paired_check(
    model: Any,
    step: Step,
    modes: Sequence[OverlapMode],
    sweep: dict[str, Any],
    choice: str,
    *,
    graph_mode: CUDAGraphMode | None,
    warmup: int,
    repeats: int,
    sm_partition: Any = None,
    group: Any = None,
) -> dict[str, Any] | None:
    """Where the policy's ``choice`` is not the measured best, the two timed again back to back:
    ``PAIRED_ROUNDS`` rounds, each capturing and timing both (in alternating order), and the
    median over rounds of best / choice. A sweep times each mode in its own block, minutes apart
    from some others, so a stretch of host noise that falls on one block (seen on the GPU machine
    right after its test suite: host issue times up to 1.5x) moves that mode's median alone; the
    two timings of one round share whatever loads the machine then. None where the choice is the
    best. Under torchrun the best and every timing are the slowest rank's, so every rank runs the
    same rounds."""
    measured = slowest_rank_ms({name: t.median_ms for name, t in sweep["timings"].items()}, group)
    best = min(measured, key=measured.get)
    if best == choice:
        return None
    by_name = {mode.name: mode for mode in modes}
    pair = [by_name[choice], by_name[best]]
    made: dict[int, SMPartition] = {}
    ratios = []
    for round_ in range(PAIRED_ROUNDS):
        ms = {}
        for mode in pair if round_ % 2 == 0 else pair[::-1]:
            partition = mode_partition(mode, sm_partition, model.device, made)
            with mode_call(model, step, mode, graph_mode, partition) as fn:
                ms[mode.name] = sample_ms(fn, model.device, warmup=warmup, repeats=repeats).median_ms
        ms = slowest_rank_ms(ms, group)
        ratios.append(ms[best] / ms[choice])
    return {"against": best, "rounds": PAIRED_ROUNDS, "auto_vs_best": round(statistics.median(ratios), 4)}


def modes_report(
    model: Any, config: Any, args: Any, step_at: Callable[[int], Step], *, sm_partition: Any = None, group: Any = None
) -> dict[str, Any]:
    """``ubatch-bench --modes``: every supported mode at every ``--tokens`` size, each row with the
    unsplit step's roofline (``ubatch.bench.roofline``), and the policy's pick per size."""
    modes = supported(model, args.modes)
    skipped = [m.name for m in args.modes if m not in modes]
    graph_mode = graph_mode_for(args.workload, args.prefill_graphs) if args.graphs else None
    ep_world, tp_world = shard_worlds(model)
    ceilings = device_ceilings(model.device)
    by_name = {mode.name: mode for mode in modes}
    results, points = [], []
    for tokens in args.tokens:
        step = step_at(tokens)
        sweep = sweep_modes(
            model,
            step,
            modes,
            graph_mode=graph_mode,
            warmup=args.warmup,
            repeats=args.repeats,
            sm_partition=sm_partition,
            chrome_trace=args.chrome_trace if tokens == args.tokens[0] else None,
            group=group,
        )
        md = step.attn_metadata[model.layer_names[0]]
        for row in mode_rows(sweep, modes):
            ceiling = ceiling_fields(
                config,
                by_name[row["mode"]],
                tokens,
                compute_ms=sweep["compute_ms"],
                comm_ms=sweep["comm_ms"],
                unsplit_ms=sweep["timings"]["unsplit"].median_ms,
                ceilings=ceilings,
                ep_world=ep_world,
                tp_world=tp_world,
            )
            results.append(
                {
                    "model": args.preset,
                    "workload": args.workload,
                    "tokens_per_rank": tokens,
                    "graphs": graph_mode is not None,
                    "label": args.label,
                    **row,
                    **roofline_fields(
                        config,
                        md,
                        row["median_ms"],
                        ceilings=ceilings,
                        ep_world=ep_world,
                        tp_world=tp_world,
                        queued_ms=row["queued_ms"],
                    ),
                    **model_fields(
                        by_name[row["mode"]],
                        layers=config.num_layers,
                        compute_ms=sweep["compute_ms"],
                        comm_ms=sweep["comm_ms"],
                        payload_ratio=payload_ratio(model, step, by_name[row["mode"]]),
                        reread_ms=ceiling["reread_ms"],
                        chunk_shares=chunk_shares(model, step, by_name[row["mode"]]),
                        attention_share=model_attention_share(args.attention_share, sweep["attention_share"]),
                        ep_world=ep_world,
                    ),
                    "attention_share_measured": None
                    if sweep["attention_share"] is None
                    else round(sweep["attention_share"], 4),
                    **ceiling,
                }
            )
        point = auto_point(sweep, modes, tokens)
        point["paired"] = paired_check(
            model,
            step,
            modes,
            sweep,
            point["choice"],
            graph_mode=graph_mode,
            warmup=args.warmup,
            repeats=args.repeats,
            sm_partition=sm_partition,
            group=group,
        )
        points.append({"tokens_per_rank": tokens, **point})
    return {
        "results": results,
        "skipped_modes": skipped,
        "auto": {
            "note": "the policy picks from a short timing of every mode right after capture, close calls timed "
            "again; a pick that is not the measured best is timed against it back to back (paired)",
            "points": points,
        },
    }
