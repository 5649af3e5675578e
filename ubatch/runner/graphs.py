"""The CUDA graphs a runner serves with: one ``GraphedModel`` per serving mode, FULL graphs for
decode steps (unsplit or ubatched) and PIECEWISE for the rest; the graph a rank proposes to the
data-parallel vote for its batch alone, and the one it replays once the vote has fixed the
step's size, ubatch count and highest mode."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ubatch.context import CUDAGraphMode
from ubatch.cudagraph import BatchExecutionDescriptor, sizes_with_multiples
from ubatch.graphed import GraphedModel
from ubatch.models import Decoder
from ubatch.runner.modes import ServingMode


def make_graphs(
    model: Decoder,
    capture_sizes: Sequence[int] | None,
    serving: ServingMode,
    *,
    device: torch.device,
    num_speculative_tokens: int,
    max_blocks_per_req: int,
) -> GraphedModel | None:
    """One serving mode's graphs (None without ``capture_sizes``), captured later. With
    speculation a decode step verifies k + 1 tokens per request: FULL graphs are keyed on that
    spec length, at sizes rounded up to multiples of it."""
    if not capture_sizes:
        return None
    if device.type != "cuda":
        raise ValueError(f"cudagraph_capture_sizes needs a CUDA device, got {device}")
    per_request = 1 + num_speculative_tokens
    return GraphedModel(
        model,
        capture_sizes=sizes_with_multiples(capture_sizes, [per_request]),
        max_blocks_per_req=max_blocks_per_req,
        ubatch_counts=sorted({1, serving.mode.num_ubatches}),
        uniform_token_count=per_request,
        sm_partition=serving.sm_partition,
        single_batch_overlap=serving.single_batch,
    )


def propose_graph(graphs: GraphedModel | None, query_lens: list[int]) -> BatchExecutionDescriptor | None:
    """The graph this rank would replay for its batch alone (its size and mode go to the vote)."""
    if graphs is None or not query_lens:
        return None
    return graphs.plan(sum(query_lens), len(query_lens), _uniform(query_lens))


def plan_graph(
    graphs: GraphedModel, query_lens: list[int], *, num_ubatches: int, num_tokens_padded: int, max_mode: CUDAGraphMode
) -> BatchExecutionDescriptor | None:
    """The graph to replay for the step the vote decided (None: run it eagerly)."""
    return graphs.plan(
        sum(query_lens),
        len(query_lens),
        _uniform(query_lens),
        num_ubatches=num_ubatches,
        num_tokens_padded=num_tokens_padded,
        max_mode=max_mode,
    )


def _uniform(query_lens: list[int]) -> int | None:
    """Tokens per request when every request of the step has the same count, else None."""
    return query_lens[0] if query_lens and len(set(query_lens)) == 1 else None
