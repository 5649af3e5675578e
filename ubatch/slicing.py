"""Split a flattened batch into contiguous ubatches, and give each its own per-layer metadata.

A batch is a run of requests laid end to end along the token dimension. A split point may fall
inside a request: that request then appears in both neighbouring slices, and its second part is a
chunked-prefill continuation of the first (it attends to the first part's KV, which the scheduler
orders before it).

Metadata of any type is split through a small protocol (``split_metadata``): a splitter
registered for its type, or its own ``split(slices)`` method. The executor knows no metadata
type itself.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.scheduler import check_num_ubatches


@dataclass(frozen=True)
class UBatchSlice:
    """The requests and tokens of one ubatch, as slices of the parent batch: plain
    ``slice(start, stop)`` with ``0 <= start <= stop`` and no step."""

    request_slice: slice
    token_slice: slice

    def __post_init__(self) -> None:
        for name in ("request_slice", "token_slice"):
            value = getattr(self, name)
            if not isinstance(value, slice):
                raise TypeError(f"UBatchSlice.{name} must be a slice, got {type(value).__name__}")
            if value.step not in (None, 1):
                raise ValueError(f"UBatchSlice.{name}={value} has step {value.step}: ubatches are contiguous")
            bounds_are_ints = all(isinstance(b, int) and not isinstance(b, bool) for b in (value.start, value.stop))
            if not bounds_are_ints or not 0 <= value.start <= value.stop:
                raise ValueError(
                    f"UBatchSlice.{name} must be slice(start, stop) with ints 0 <= start <= stop, got {value}"
                )

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_reqs(self) -> int:
        return self.request_slice.stop - self.request_slice.start


def _as_int(value: object, name: str) -> int:
    """``value`` as an int; TypeError for anything else (bools and floats included: a float token
    count would be truncated without a word)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None


def _validate_counts(num_scheduled_tokens: Iterable[int]) -> list[int]:
    if isinstance(num_scheduled_tokens, torch.Tensor) and num_scheduled_tokens.dim() == 1:
        num_scheduled_tokens = num_scheduled_tokens.tolist()
    if isinstance(num_scheduled_tokens, (str, bytes, torch.Tensor)) or not isinstance(num_scheduled_tokens, Iterable):
        raise TypeError(
            f"num_scheduled_tokens must be a sequence of ints (tokens per request), "
            f"got {type(num_scheduled_tokens).__name__}"
        )
    counts = [_as_int(n, f"num_scheduled_tokens[{r}]") for r, n in enumerate(num_scheduled_tokens)]
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"num_scheduled_tokens must list >= 1 token per request, got {counts}")
    return counts


def split_batch(
    num_scheduled_tokens: Iterable[int],
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
    num_ubatches = check_num_ubatches(num_ubatches)
    counts = _validate_counts(num_scheduled_tokens)
    starts = [0, *itertools.accumulate(counts)]
    num_real = starts[-1]
    total = num_real if num_tokens_padded is None else _as_int(num_tokens_padded, "num_tokens_padded")
    if total < num_real:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} is less than the {num_real} scheduled tokens")
    if align_to_requests:
        if num_ubatches > len(counts):
            raise ValueError(f"cannot split {len(counts)} requests into {num_ubatches} request-aligned ubatches")
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


def even_slices(num_rows: int, num_parts: int) -> list[UBatchSlice]:
    """``num_rows`` rows in ``num_parts`` contiguous, in-order parts whose sizes differ by at most
    one, each row its own request (a batch dimension the wrapper splits itself)."""
    if not 1 <= num_parts <= num_rows:
        raise ValueError(f"cannot split {num_rows} rows into {num_parts} non-empty parts")
    points = [k * num_rows // num_parts for k in range(num_parts + 1)]
    return [UBatchSlice(slice(lo, hi), slice(lo, hi)) for lo, hi in itertools.pairwise(points)]


MetadataSplitter = Callable[[Any, Sequence[UBatchSlice]], Sequence[Any]]


_SPLITTERS: dict[type, MetadataSplitter] = {}
_NOT_METADATA_SPLIT = (str, bytes, bytearray, torch.Tensor)  # their split() means something else


def register_metadata_splitter(cls: type, splitter: MetadataSplitter) -> None:
    """Let ``UBatchWrapper`` split per-layer metadata of type ``cls`` (and its subclasses), for
    types one cannot give a ``split`` method: ``splitter(metadata, slices)`` returns one
    metadata per slice. A registered splitter takes precedence over a ``split`` method."""
    if not isinstance(cls, type):
        raise TypeError(f"register_metadata_splitter needs a type, got {cls!r}")
    if not callable(splitter):
        raise TypeError(f"the splitter for {cls.__name__} must be callable, got {type(splitter).__name__}")
    _SPLITTERS[cls] = splitter


def split_metadata(metadata: Any, slices: Sequence[UBatchSlice], *, name: str = "metadata") -> list[Any]:
    """One metadata object per slice, from the splitter registered for its type or its own
    ``split(slices)`` method; ``name`` says where the metadata came from in errors."""
    splitter = next((_SPLITTERS[c] for c in type(metadata).__mro__ if c in _SPLITTERS), None)
    if splitter is not None:
        parts = splitter(metadata, slices)
    elif not isinstance(metadata, _NOT_METADATA_SPLIT) and callable(getattr(metadata, "split", None)):
        parts = metadata.split(slices)
    else:
        kind = type(metadata).__name__
        raise TypeError(
            f"{name} is a {kind}, which UBatchWrapper cannot split: give {kind} a split(slices) -> list "
            f"method, register a splitter with ubatch.slicing.register_metadata_splitter({kind}, fn), "
            f"or pass the metadata as a per-ubatch list of dicts"
        )
    parts = list(parts)
    if len(parts) != len(slices):
        raise ValueError(
            f"splitting {name} ({type(metadata).__name__}) gave {len(parts)} parts for {len(slices)} slices"
        )
    return parts


def slices_total(slices: Sequence[UBatchSlice]) -> int:
    """The number of tokens (padding included) the slices cover."""
    return slices[-1].token_slice.stop


def check_slices(slices: Sequence[UBatchSlice]) -> None:
    """Raise ValueError unless the slices are contiguous, in order and non-empty."""
    if isinstance(slices, (str, bytes)) or not isinstance(slices, Sequence):
        raise TypeError(
            f"ubatch_slices must be a sequence of UBatchSlice (see split_batch), got {type(slices).__name__}"
        )
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
