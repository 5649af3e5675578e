"""The executor's schedule as a model: the best step time ubatching can reach from C and M.

A list-scheduling model of how the executor runs N ubatches: per layer, each ubatch computes its
attention block (``A``), runs a collective (dispatch, or an all-reduce), computes its experts or
MLP (``E``) and runs a second collective (combine, or an all-reduce), each collective after the
compute that feeds it and before the compute that reads it. Compute runs on one lane in the order
the host issues it (round-robin over ubatches, as the scheduler does), collectives on one comm
lane in the same order. Costs scale linearly with the ubatch's share of tokens and nothing slows
down when overlapped unless ``comm_stretch`` says so, so the result is a bound: what is left
between it and a measured step is overlap slowdown, fill and drain the model misses, and noise.

``joined_step_ms`` models the joined expert stages and expert groups the same way (one GEMM
per expert group over every ubatch's rows), for bounds on those modes.

Reports carry it twice: with plain collectives (what the schedule alone allows) and with the
row's measured ``comm_stretch`` (what the schedule allows once the collectives run as slowly
as they did), so a row's gap to its ideal splits into schedule, stretch and the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from ubatch.overlap import OverlapMode

DEFAULT_ATTENTION_SHARE = 0.2  # share of compute before a layer's first collective (assumed, not measured)


def ideal_speedup(compute_ms: float, comm_ms: float) -> float:
    """(C + M) / max(C, M): the unsplit step's time over that of perfect overlap of its compute and
    communication; 1 where both are zero."""
    longer = max(compute_ms, comm_ms)
    return (compute_ms + comm_ms) / longer if longer > 0 else 1.0


def step_ms(
    num_ubatches: int,
    layers: int,
    compute_ms: float,
    comm_ms: float,
    attention_share: float,
    comm_stretch: float = 1.0,
    local_share: float = 0.0,
    token_chunks: int = 1,
) -> float:
    """Makespan of one step in ``num_ubatches`` ubatches under the model above; with more than one
    ubatch or token chunk each collective takes ``comm_stretch`` times its share of ``comm_ms``.
    ``local_share``: the share of each ubatch's expert work that may start before its dispatch
    lands (own rows first, ``+local``: 1/W of the rows with W ranks); the second GEMM call it costs
    is not modelled. ``token_chunks`` (``tokensK``): each ubatch starts one dispatch per chunk of
    its tokens, then per chunk runs that chunk's expert work and combine, the ubatches taking
    turns per chunk; the expert weights each chunk reads again are not modelled (in prefill the
    GEMMs are compute-bound)."""
    if not 0 <= local_share <= 1:
        raise ValueError(f"local_share must be in [0, 1], got {local_share}")
    if isinstance(token_chunks, bool) or not isinstance(token_chunks, int) or token_chunks < 1:
        raise ValueError(f"token_chunks must be a positive int, got {token_chunks!r}")
    attention = compute_ms * attention_share / layers / num_ubatches
    experts = compute_ms * (1 - attention_share) / layers / num_ubatches / token_chunks
    own = experts * local_share
    stretch = comm_stretch if num_ubatches > 1 or token_chunks > 1 else 1.0
    collective = stretch * comm_ms / 2 / layers / num_ubatches / token_chunks  # both collectives carry the same rows
    compute_free = comm_free = 0.0
    ready = [0.0] * num_ubatches  # when each ubatch's last collective delivered its result
    for _ in range(layers):
        landed = [[0.0] * token_chunks for _ in range(num_ubatches)]
        for u in range(num_ubatches):
            compute_free = max(compute_free, ready[u]) + attention
            for c in range(token_chunks):
                comm_free = max(comm_free, compute_free) + collective
                landed[u][c] = comm_free
            compute_free += own  # the first chunk's own rows, issued right after the dispatches start
        for c in range(token_chunks):
            for u in range(num_ubatches):
                compute_free += own if c else 0.0  # a later chunk's own rows, before its dispatch is waited
                compute_free = max(compute_free, landed[u][c]) + experts - own
                comm_free = max(comm_free, compute_free) + collective
                ready[u] = comm_free
    return max(compute_free, *ready)


def joined_step_ms(
    num_ubatches: int,
    expert_chunks: int,
    layers: int,
    compute_ms: float,
    comm_ms: float,
    attention_share: float,
    *,
    group_cost_ms: float = 0.0,
    ubatch_cost_ms: float = 0.0,
    comm_stretch: float = 1.0,
    shares: list[float] | None = None,
    chunk_shares: Sequence[float] | None = None,
) -> float:
    """Makespan of one step with joined expert stages (``splitN+join+pipelineK``; N = 1 is plain
    expert pipelining, K = 1 one expert stage) under the same model: each ubatch's attention and
    its ``expert_chunks`` dispatches, then per expert group one GEMM over every ubatch's rows (its
    share of the experts' compute, plus ``group_cost_ms`` per layer for every group past the
    first: smaller GEMMs, more launches) and every ubatch's combine of that group. In a split,
    each ubatch's attention also costs ``ubatch_cost_ms`` per layer (its own launches of every
    small kernel). Where the step's transfers are cut (more than one ubatch or group), each takes
    ``comm_stretch`` times its share of ``comm_ms``: a transfer in pieces pays each piece's
    latency. ``shares``: each ubatch's share of the tokens (default: equal). ``chunk_shares``: each
    group's share of the dispatched rows (default: equal). A row travels in the chunk of its
    earliest group on the rank and returns in that of its latest, so with fine-grained experts the
    first dispatch and the last combine are the largest (``MoEFFN.capacity``: the combine's chunks
    take the dispatch's sizes in reverse), and both are exposed."""
    shares = [1 / num_ubatches] * num_ubatches if shares is None else shares
    if len(shares) != num_ubatches or abs(sum(shares) - 1) > 1e-9 or min(shares) <= 0:
        raise ValueError(f"shares must be {num_ubatches} positive numbers summing to 1, got {shares}")
    chunk_shares = [1 / expert_chunks] * expert_chunks if chunk_shares is None else list(chunk_shares)
    if len(chunk_shares) != expert_chunks or abs(sum(chunk_shares) - 1) > 1e-9 or min(chunk_shares) < 0:
        raise ValueError(f"chunk_shares must be {expert_chunks} non-negative numbers summing to 1, got {chunk_shares}")
    attention = compute_ms * attention_share / layers
    experts = compute_ms * (1 - attention_share) / layers / expert_chunks
    experts += group_cost_ms if expert_chunks > 1 else 0.0
    stretch = comm_stretch if num_ubatches > 1 or expert_chunks > 1 else 1.0
    collective = stretch * comm_ms / 2 / layers  # one dispatch (or combine) of the whole step
    compute_free = comm_free = 0.0
    ready = [0.0] * num_ubatches  # when each ubatch's last combine delivered its rows
    for _ in range(layers):
        arrived = [0.0] * expert_chunks  # when every ubatch's rows of a group have landed
        for u, share in enumerate(shares):
            compute_free = max(compute_free, ready[u]) + attention * share
            compute_free += ubatch_cost_ms if num_ubatches > 1 else 0.0
            for g in range(expert_chunks):
                comm_free = max(comm_free, compute_free) + collective * share * chunk_shares[g]
                arrived[g] = comm_free
        for g in range(expert_chunks):
            compute_free = max(compute_free, arrived[g]) + experts
            for u, share in enumerate(shares):
                comm_free = max(comm_free, compute_free) + collective * share * chunk_shares[-1 - g]
                ready[u] = comm_free
    return max(compute_free, *ready)


def schedule_estimates(
    compute_ms: float,
    comm_ms: float,
    comm_stretch: float | None,
    *,
    num_ubatches: int,
    layers: int,
    attention_share: float = DEFAULT_ATTENTION_SHARE,
) -> dict[str, float | None]:
    """A report row's ``schedule_model_ms`` (plain collectives) and ``schedule_model_stretched_ms``
    (collectives stretched as measured; None where the stretch is not measured)."""

    def model(stretch: float) -> float:
        return round(step_ms(num_ubatches, layers, compute_ms, comm_ms, attention_share, stretch), 4)

    return {
        "schedule_model_ms": model(1.0),
        "schedule_model_stretched_ms": None if comm_stretch is None else model(comm_stretch),
    }


def mode_step_ms(
    mode: OverlapMode,
    *,
    layers: int,
    compute_ms: float,
    comm_ms: float,
    attention_share: float = DEFAULT_ATTENTION_SHARE,
    ep_world: int = 1,
    chunk_shares: Sequence[float] | None = None,
) -> float | None:
    """The model's step time for ``mode`` from the unsplit step's C and M: splits, token chunks
    and own rows first through ``step_ms`` (own rows are 1/``ep_world`` of each stage's rows),
    expert groups (joined or not split) through ``joined_step_ms`` (``chunk_shares``: each
    group's share of the rows, default equal). None for what the model does
    not describe: single-batch overlap (what runs under its dispatch is model-specific), chunked
    all-reduces, expert groups of a split whose stages are not joined, and expert groups or joined
    stages with own rows first (the joined model has none; neither takes token chunks)."""
    if mode == OverlapMode():
        return compute_ms + comm_ms
    if mode.all_reduce_chunks > 1:
        return None
    if mode.expert_chunks > 1 or mode.join_experts:
        split_not_joined = mode.num_ubatches > 1 and not mode.join_experts
        if split_not_joined or mode.local_first:
            return None
        return joined_step_ms(
            mode.num_ubatches,
            mode.expert_chunks,
            layers,
            compute_ms,
            comm_ms,
            attention_share,
            chunk_shares=chunk_shares,
        )
    if mode.num_ubatches == 1 and mode.token_chunks == 1 and not mode.local_first:
        return None
    local_share = 1 / ep_world if mode.local_first else 0.0
    return step_ms(
        mode.num_ubatches,
        layers,
        compute_ms,
        comm_ms,
        attention_share,
        local_share=local_share,
        token_chunks=mode.token_chunks,
    )
