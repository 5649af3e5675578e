"""split_batch and split_attn_metadata: balanced, contiguous, complete, loud on bad input."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ubatch.attention import build_attention_metadata
from ubatch.slicing import UBatchSlice, check_slices, split_attn_metadata, split_batch


def _covered_tokens_per_request(counts, slices):
    starts = [0, *itertools.accumulate(counts)]
    seen = [0] * len(counts)
    for s in slices:
        for r in range(s.request_slice.start, s.request_slice.stop):
            lo = max(starts[r], s.token_slice.start)
            hi = min(starts[r + 1], s.token_slice.stop)
            assert hi > lo, f"request {r} listed in slice {s} holds none of its tokens"
            seen[r] += hi - lo
    return seen


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    n=st.integers(1, 4),
    pad=st.integers(0, 7),
)
def test_split_is_balanced_contiguous_and_complete(counts, n, pad):
    total_real = sum(counts)
    padded = total_real + pad
    points = [k * padded // n for k in range(n + 1)]
    expected_sizes = [hi - lo for lo, hi in itertools.pairwise(points)]
    if any(lo >= min(hi, total_real) for lo, hi in itertools.pairwise(points)):
        with pytest.raises(ValueError, match="no real token"):
            split_batch(counts, n, padded)
        return
    slices = split_batch(counts, n, padded)
    check_slices(slices)
    assert [s.num_tokens for s in slices] == expected_sizes
    assert slices[-1].token_slice.stop == padded
    assert _covered_tokens_per_request(counts, slices) == counts
    assert slices[0].request_slice.start == 0 and slices[-1].request_slice.stop == len(counts)
    for a, b in itertools.pairwise(slices):
        assert b.request_slice.start in (a.request_slice.stop, a.request_slice.stop - 1)


def test_straddling_request_appears_in_both_slices():
    slices = split_batch([3, 5], 2)
    assert slices == [UBatchSlice(slice(0, 2), slice(0, 4)), UBatchSlice(slice(1, 2), slice(4, 8))]


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(1, 20), min_size=2, max_size=10), n=st.integers(2, 4), pad=st.integers(0, 5))
def test_request_aligned_split_never_straddles(counts, n, pad):
    if n > len(counts):
        with pytest.raises(ValueError, match="request-aligned"):
            split_batch(counts, n, align_to_requests=True)
        return
    slices = split_batch(counts, n, sum(counts) + pad, align_to_requests=True)
    check_slices(slices)
    starts = set(itertools.accumulate(counts))
    assert all(s.token_slice.stop in starts for s in slices[:-1])
    assert [s.num_reqs for s in slices] and sum(s.num_reqs for s in slices) == len(counts)


@pytest.mark.parametrize(
    "args, message",
    [
        (([4, 4], 0), "num_ubatches must be an int >= 1, got 0"),
        (([], 2), "num_scheduled_tokens"),
        (([3, 0], 2), r"num_scheduled_tokens.*\[3, 0\]"),
        (([1], 2), "ubatch 0 of 2 would hold no real token"),
        (([2, 2], 2, 3), "num_tokens_padded=3 is less than the 4"),
        (([1, 1], 2, 8), "ubatch 1 of 2 would hold no real token"),
    ],
)
def test_impossible_splits_raise(args, message):
    with pytest.raises(ValueError, match=message):
        split_batch(*args)


def test_check_slices_rejects_gaps():
    with pytest.raises(ValueError, match="contiguous"):
        check_slices([UBatchSlice(slice(0, 1), slice(0, 2)), UBatchSlice(slice(1, 2), slice(3, 5))])
    with pytest.raises(TypeError, match="UBatchSlice"):
        check_slices([slice(0, 2)])


def test_split_attn_metadata_continuation_sees_whole_context():
    # request 0: 3 new tokens after 2 cached; request 1: 5 new tokens (prefill)
    query_lens, seq_lens = [3, 5], [5, 5]
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    slot_mapping = torch.arange(8, dtype=torch.int64)
    md = build_attention_metadata(query_lens, seq_lens, block_table, slot_mapping)
    first, second = split_attn_metadata(md, split_batch(query_lens, 2))
    assert first.query_start_loc_cpu.tolist() == [0, 3, 4]
    assert first.seq_lens_cpu.tolist() == [5, 1]
    assert second.query_start_loc_cpu.tolist() == [0, 4]
    assert second.seq_lens_cpu.tolist() == [5]
    assert torch.equal(second.block_table, block_table[1:])
    assert torch.equal(second.slot_mapping, slot_mapping[4:])
    assert (first.max_query_len, first.max_seq_len, second.max_query_len) == (3, 5, 4)
