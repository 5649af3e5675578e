"""Split a flattened batch into contiguous ubatches, and give each its own attention metadata.

A batch is a run of requests laid end to end along the token dimension. A split point may fall
inside a request: that request then appears in both neighbouring slices, and its second part is a
chunked-prefill continuation of the first (it attends to the first part's KV, which the scheduler
orders before it).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ubatch.attention import AttentionMetadata, build_attention_metadata


@dataclass(frozen=True)
class UBatchSlice:
    """The requests and tokens of one ubatch, as slices of the parent batch."""

    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_reqs(self) -> int:
        return self.request_slice.stop - self.request_slice.start


def _validate_counts(num_scheduled_tokens: Sequence[int]) -> list[int]:
    counts = [int(n) for n in num_scheduled_tokens]
    bad = [n for n in counts if n < 1]
    if not counts or bad:
        raise ValueError(
            f"num_scheduled_tokens must list >= 1 token per request, got {list(num_scheduled_tokens)}"
        )
    return counts


def split_batch(
    num_scheduled_tokens: Sequence[int],
    num_ubatches: int,
    num_tokens_padded: int | None = None,
    *,
    align_to_requests: bool = False,
) -> list[UBatchSlice]:
    """Split a batch into ``num_ubatches`` contiguous, in-order slices covering every token once.

    Split points divide the padded total evenly (so every DP rank splits alike and ubatch sizes
    match graph sizes); padding tokens lie at the end, in the last slice. With
    ``align_to_requests`` each split point moves to the nearest request boundary, so no request
    straddles two ubatches (what uniform speculative verification needs).
    """
    if not isinstance(num_ubatches, int) or num_ubatches < 1:
        raise ValueError(f"num_ubatches must be an int >= 1, got {num_ubatches!r}")
    counts = _validate_counts(num_scheduled_tokens)
    starts = [0, *itertools.accumulate(counts)]
    num_real = starts[-1]
    total = num_real if num_tokens_padded is None else int(num_tokens_padded)
    if total < num_real:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} is less than the {num_real} scheduled tokens")
    if align_to_requests:
        if num_ubatches > len(counts):
            raise ValueError(
                f"cannot split {len(counts)} requests into {num_ubatches} request-aligned ubatches"
            )
        points = _request_aligned_points(starts, total, num_ubatches)
    else:
        points = [k * total // num_ubatches for k in range(num_ubatches + 1)]
    slices = []
    for i, (lo, hi) in enumerate(itertools.pairwise(points)):
        if lo >= min(hi, num_real):
            raise ValueError(
                f"ubatch {i} of {num_ubatches} would hold no real token (tokens {lo}..{hi} of "
                f"{num_real} real, {total} padded)"
            )
        first_req = bisect.bisect_right(starts, lo) - 1
        last_req = bisect.bisect_left(starts, min(hi, num_real)) - 1
        slices.append(UBatchSlice(slice(first_req, last_req + 1), slice(lo, hi)))
    return slices


def _request_aligned_points(starts: list[int], total: int, num_ubatches: int) -> list[int]:
    """Split points on request boundaries, each the boundary nearest the even split."""
    boundaries = starts[1:-1]
    points = [0]
    for k in range(1, num_ubatches):
        target = k * starts[-1] / num_ubatches
        lo = bisect.bisect_left(boundaries, points[-1] + 1)
        hi = len(boundaries) - (num_ubatches - k)
        candidates = boundaries[lo : hi + 1]
        points.append(min(candidates, key=lambda b: (abs(b - target), b)))
    points.append(total)
    return points


def split_attn_metadata(metadata: AttentionMetadata, slices: Sequence[UBatchSlice]) -> list[AttentionMetadata]:
    """One AttentionMetadata per slice.

    A request cut by a split point keeps, in the earlier slice, a context that ends with that
    slice's last token; its later part sees the whole context, the earlier part's KV included.
    """
    query_start = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    device = metadata.query_start_loc.device
    out = []
    for s in slices:
        t0, t1 = s.token_slice.start, s.token_slice.stop
        query_lens, ctx_lens = [], []
        for r in range(s.request_slice.start, s.request_slice.stop):
            q0, q1 = max(query_start[r], t0), min(query_start[r + 1], t1)
            query_lens.append(q1 - q0)
            ctx_lens.append(seq_lens[r] - (query_start[r + 1] - q1))
        out.append(
            build_attention_metadata(
                query_lens,
                ctx_lens,
                metadata.block_table[s.request_slice],
                metadata.slot_mapping[t0:t1],
                device=device,
                causal=metadata.causal,
            )
        )
    return out


def slices_total(slices: Sequence[UBatchSlice]) -> int:
    """The number of tokens (padding included) the slices cover."""
    return slices[-1].token_slice.stop


def check_slices(slices: Sequence[UBatchSlice]) -> None:
    """Raise ValueError unless the slices are contiguous, in order and non-empty."""
    expected = 0
    for i, s in enumerate(slices):
        if not isinstance(s, UBatchSlice):
            raise TypeError(f"ubatch_slices[{i}] must be a UBatchSlice, got {type(s).__name__}")
        if s.token_slice.start != expected or s.num_tokens < 1:
            raise ValueError(
                f"ubatch_slices must be contiguous, in order and non-empty; slice {i} covers tokens "
                f"{s.token_slice.start}..{s.token_slice.stop} but should start at {expected}"
            )
        expected = s.token_slice.stop


def is_tensor_batched(value: object, total: int) -> bool:
    """Whether ``value`` is a tensor whose leading dimension is the batch's token count."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == total
