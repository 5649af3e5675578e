"""A split policy calibrated on the model itself, for a serving runner
(``ModelRunner(split_policy=calibrated_policy(model))``): the calibration ``ubatch-bench --policy
auto`` runs, on synthetic prefill steps of the given sizes, unsplit and in two ubatches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ubatch.bench.measure import measure
from ubatch.bench.workload import make_step
from ubatch.policy import SplitPolicy, calibrate_from_samples


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
            full, rest = divmod(tokens, prompt_len)
            step, _ = make_step(model, [prompt_len] * full + ([rest] if rest else []), seed=seed)
            samples[tokens] = measure(
                model, step, 2, warmup=warmup, repeats=repeats, sm_partition=sm_partition
            ).calibration_sample()
    finally:
        for name, layer in model.attention_layers.items():
            layer.kv_cache = bound[name]
    costs = calibrate_from_samples(samples, stages=2 * model.config.num_layers)
    return SplitPolicy(costs, candidates=(1, num_ubatches))
