"""The most an overlap mode can gain on a step, from the weight bytes it reads again.

A split step's ubatches each read the weights every token needs (attention, norms, router, shared
experts, a dense MLP), and unless their expert stages are joined each ubatch reads every local
expert its own tokens reach, as does each token chunk of an expert stage; a joined stage also runs
the shared experts once (where they are not tensor-parallel, ``MoEFFN._joined_stage``). Own rows
first runs each expert stage as two GEMM calls, and chunked all-reduces run each row-parallel
projection as one GEMM per chunk: each call reads its weights. No schedule hides those bytes: even with every transfer
hidden and nothing else slower, the mode's step takes the unsplit step's compute plus their time at
the GPU's datasheet bandwidth (a read no kernel beats). ``efficiency_ceiling`` turns that floor into
the highest efficiency the mode can reach in the run that measured C, M and the unsplit step: where
it is below a target, no schedule of that mode meets the target there. Expected expert counts follow
``roofline``'s uniform router.
"""

from __future__ import annotations

from typing import Any

from ubatch.bench.roofline import Ceilings, even_parts, layer_weights, touched_experts
from ubatch.bench.schedule import ideal_speedup
from ubatch.models.config import ModelConfig
from ubatch.overlap import OverlapMode


def extra_weight_bytes(
    config: ModelConfig, mode: OverlapMode, num_tokens: int, *, ep_world: int = 1, tp_world: int = 1
) -> float:
    """Weight bytes one rank reads in ``mode`` beyond the unsplit step's one read of each weight,
    for a step of ``num_tokens`` tokens on that rank split into ``mode.num_ubatches`` equal parts."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < mode.num_ubatches:
        raise ValueError(f"num_tokens must be an int >= {mode.num_ubatches} (one per ubatch), got {num_tokens!r}")
    n, weights = mode.num_ubatches, layer_weights(config, tp_world)
    shared_joined = mode.join_experts and tp_world == 1  # then read once, in the joined stage
    per_ubatch = weights.attention + weights.norms + weights.mlp + weights.router
    per_ubatch += 0 if shared_joined else weights.shared
    chunked = weights.attention_out + weights.mlp_down  # row-parallel: one GEMM per all-reduce chunk
    extra = (n - 1) * per_ubatch + n * (mode.all_reduce_chunks - 1) * chunked
    if config.kind == "moe":
        stages = [num_tokens] if mode.join_experts else even_parts(num_tokens, n)
        chunks = [part for stage in stages for part in even_parts(stage, min(mode.token_chunks, stage))]
        reads = sum(touched_experts(config, tokens, ep_world) for tokens in chunks)
        if mode.local_first and ep_world > 1:
            reads *= 2  # own rows, then the other ranks' rows: two GEMM calls per stage
        extra += (reads - touched_experts(config, num_tokens, ep_world)) * weights.expert
    return config.num_layers * extra


def ceiling_fields(
    config: ModelConfig,
    mode: OverlapMode,
    num_tokens: int,
    *,
    compute_ms: float,
    comm_ms: float,
    unsplit_ms: float,
    ceilings: Ceilings | None,
    ep_world: int = 1,
    tp_world: int = 1,
) -> dict[str, Any]:
    """A report row's ``reread_ms`` (the extra weight bytes at the datasheet bandwidth of
    ``ceilings``, ``roofline.device_ceilings``) and ``efficiency_ceiling``: the efficiency of a step
    that takes ``compute_ms + reread_ms`` against the run's ``unsplit_ms`` and ideal (capped at 1).
    None for the unsplit step itself, without ceilings (a CPU, a GPU not measured here), and
    without communication (no ideal to approach)."""
    if mode == OverlapMode() or ceilings is None or not comm_ms > 0:
        return {"reread_ms": None, "efficiency_ceiling": None}
    reread_ms = extra_weight_bytes(config, mode, num_tokens, ep_world=ep_world, tp_world=tp_world)
    reread_ms /= ceilings.hbm_gbps_datasheet * 1e6
    ideal = ideal_speedup(compute_ms, comm_ms)
    best = min(ideal, unsplit_ms / (compute_ms + reread_ms))
    return {"reread_ms": round(reread_ms, 4), "efficiency_ceiling": round(min(1.0, (best - 1) / (ideal - 1)), 4)}
