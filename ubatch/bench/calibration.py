"""Policies calibrated on the model itself, for a serving runner: a split policy
(``ModelRunner(split_policy=calibrated_policy(model))``, the calibration ``ubatch-bench --policy
auto`` runs on synthetic prefill steps, unsplit and in two ubatches), and a policy over overlap
modes (``ModelRunner(overlap_mode=calibrated_mode_policy(model, "pipeline2,split2"))``, every
mode timed at a few sizes, as ``ubatch-bench --modes`` times them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ubatch.bench.measure import measure, slowest_rank_ms
from ubatch.bench.modes import sweep_modes
from ubatch.bench.workload import Step, make_step
from ubatch.context import CUDAGraphMode
from ubatch.overlap import OverlapMode, parse_modes, supported
from ubatch.policy import ModePolicy, SplitPolicy, calibrate_from_samples

WORKLOADS = ("decode", "prefill")


def calibrated_policy(
    model: Any,
    *,
    sizes: Sequence[int] = (256, 2048),
    num_ubatches: int = 2,
    prompt_len: int = 512,
    sm_partition: Any = None,
    warmup: int = 3,
    repeats: int = 10,
    seed: int = 0,
) -> SplitPolicy:
    """Time ``sizes`` tokens of prompts of ``prompt_len`` (the last one shorter) unsplit and in
    two ubatches, and fit the policy that chooses between 1 and ``num_ubatches``.

    With expert or tensor parallelism the steps run collectives: call it on every rank at the
    same point, with the same sizes (and, for experts, a ``seed`` per rank, so each rank routes
    tokens of its own; tensor-parallel ranks need the same one). It borrows the attention layers
    for its own KV cache and gives them back the caches they had."""
    if isinstance(num_ubatches, bool) or not isinstance(num_ubatches, int) or num_ubatches < 2:
        raise ValueError(f"num_ubatches must be an integer >= 2, got {num_ubatches!r}")
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if len(set(sizes)) < 2 or min(sizes) < 2:
        raise ValueError(f"sizes must hold at least two token counts >= 2, got {list(sizes)}")
    bound = {name: layer.kv_cache for name, layer in model.attention_layers.items()}
    try:
        samples = {}
        for tokens in sorted(set(sizes)):
            step = _synthetic_step(model, "prefill", tokens, 0, prompt_len, seed)
            samples[tokens] = measure(
                model, step, 2, warmup=warmup, repeats=repeats, sm_partition=sm_partition
            ).calibration_sample()
    finally:
        for name, layer in model.attention_layers.items():
            layer.kv_cache = bound[name]
    costs = calibrate_from_samples(samples, stages=2 * model.config.num_layers)
    return SplitPolicy(costs, candidates=(1, num_ubatches))


def calibrated_mode_policy(
    model: Any,
    modes: str | Sequence[OverlapMode],
    *,
    sizes: Sequence[int] = (256, 1024),
    workload: str = "decode",
    context_len: int = 512,
    prompt_len: int = 512,
    graph_mode: CUDAGraphMode | None = None,
    warmup: int = 3,
    repeats: int = 10,
    seed: int = 0,
    group: Any = None,
    min_gain: float = 1.01,
) -> ModePolicy:
    """Time every mode of ``modes`` (names, comma-separated, or ``OverlapMode`` s; unsplit is
    always one) on synthetic ``workload`` steps of each of ``sizes`` tokens, eagerly or replayed
    from ``graph_mode`` graphs (the mode a runner serves them in: FULL for decode, PIECEWISE for
    prefill), and fit the ``ModePolicy`` that picks among them per step.

    With expert or tensor parallelism the steps run collectives: call it on every rank at the same
    point (expert-parallel ranks each with a ``seed`` of its own, tensor-parallel ones with one
    seed) and give ``group`` (a process group over CPU tensors, such as the runner's gloo
    ``dp_group``): every mode's time is then the slowest rank's, so every rank holds the same
    policy and picks alike, as the runner needs. It borrows the attention layers for its own KV
    cache and gives them back the caches they had."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if not sizes or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in sizes):
        raise ValueError(f"sizes must be token counts >= 1, got {list(sizes)}")
    if context_len < 0 or prompt_len < 1:
        raise ValueError(f"context_len must be >= 0 and prompt_len >= 1, got {context_len} and {prompt_len}")
    wanted = parse_modes(modes) if isinstance(modes, str) else list(dict.fromkeys([OverlapMode(), *modes]))
    runnable = supported(model, wanted)
    if len(runnable) < len(wanted):
        refused = [m.name for m in wanted if m not in runnable]
        raise ValueError(
            f"this model cannot run mode(s) {', '.join(refused)}: the MoE modes need MoE layers whose "
            f"experts the groups divide, allreduceK a tensor-parallel model"
        )
    bound = {name: layer.kv_cache for name, layer in model.attention_layers.items()}
    timings: dict[str, dict[int, float]] = {mode.name: {} for mode in wanted}
    sizes = sorted(set(sizes))
    try:
        for tokens in sizes:
            step = _synthetic_step(model, workload, tokens, context_len, prompt_len, seed)
            sweep = sweep_modes(model, step, wanted, graph_mode=graph_mode, warmup=warmup, repeats=repeats, group=group)
            for mode in wanted:
                timings[mode.name][tokens] = sweep["timings"][mode.name].median_ms
    finally:
        for name, layer in model.attention_layers.items():
            layer.kv_cache = bound[name]
    slowest = slowest_rank_ms({(m.name, t): timings[m.name][t] for m in wanted for t in sizes}, group)
    return ModePolicy({m.name: {t: slowest[m.name, t] for t in sizes} for m in wanted}, min_gain=min_gain)


def _synthetic_step(model: Any, workload: str, tokens: int, context_len: int, prompt_len: int, seed: int) -> Step:
    """``tokens`` decode requests of ``context_len`` cached tokens each, or prompts of
    ``prompt_len`` (the last one shorter) with nothing cached."""
    if workload == "decode":
        return make_step(model, [1] * tokens, [context_len] * tokens, seed=seed)[0]
    full, rest = divmod(tokens, prompt_len)
    return make_step(model, [prompt_len] * full + ([rest] if rest else []), seed=seed)[0]
