"""split_batch, split_attn_metadata and the metadata protocol: balanced, contiguous, complete,
loud on bad input."""

import ast
import dataclasses
import itertools
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ubatch.attention import AttentionMetadata, build_attention_metadata, split_attn_metadata
from ubatch.slicing import (
    UBatchSlice,
    check_slices,
    even_slices,
    register_metadata_splitter,
    split_batch,
    split_metadata,
)


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
        (([4, 4], 0), "num_ubatches must be between 1 and MAX_UBATCHES=16, got 0"),
        (([4] * 40, 17), "num_ubatches must be between 1 and MAX_UBATCHES=16, got 17"),
        (([4, 4], 10**6), "num_ubatches must be between 1 and MAX_UBATCHES=16, got 1000000"),
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


@pytest.mark.parametrize(
    "counts, message",
    [
        ([2.7, 3.9], r"num_scheduled_tokens\[0\] must be an int, got 2.7 \(float\)"),
        ([4, 4.0], r"num_scheduled_tokens\[1\] must be an int, got 4.0 \(float\)"),
        ([True, 3], r"num_scheduled_tokens\[0\] must be an int, got True"),
        (torch.tensor([2.0, 3.0]), r"num_scheduled_tokens\[0\] must be an int, got 2.0"),
        (torch.tensor([True, True]), r"num_scheduled_tokens\[0\] must be an int, got True"),
        (None, "num_scheduled_tokens must be a sequence of ints \\(tokens per request\\), got NoneType"),
        (8, "num_scheduled_tokens must be a sequence of ints .*, got int"),
        ("44", "num_scheduled_tokens must be a sequence of ints .*, got str"),
        (torch.tensor(8), "num_scheduled_tokens must be a sequence of ints .*, got Tensor"),
    ],
)
def test_token_counts_must_be_ints(counts, message):
    with pytest.raises(TypeError, match=message):
        split_batch(counts, 2)


@pytest.mark.parametrize("bad", [True, 2.0, "2", None])
def test_num_ubatches_must_be_an_int(bad):
    with pytest.raises(TypeError, match=f"num_ubatches must be an int, got {bad!r}"):
        split_batch([4, 4], bad)


def test_padded_count_must_be_an_int():
    with pytest.raises(TypeError, match=r"num_tokens_padded must be an int, got 9.5"):
        split_batch([4, 4], 2, 9.5)


def test_integer_scalars_of_numpy_and_torch_are_accepted():
    expected = split_batch([3, 5, 2], 2, 12)
    assert split_batch(np.array([3, 5, 2]), np.int64(2), np.int64(12)) == expected
    assert split_batch(torch.tensor([3, 5, 2]), 2, torch.tensor(12)) == expected
    assert split_batch([np.int32(3), torch.tensor(5), 2], 2, 12) == expected


@pytest.mark.parametrize(
    "request_slice, token_slice, error, message",
    [
        (slice(0, 4, 2), slice(0, 4), ValueError, r"request_slice=slice\(0, 4, 2\) has step 2"),
        (slice(0, 2), slice(0, 8, 2), ValueError, r"token_slice=slice\(0, 8, 2\) has step 2"),
        (slice(0, 2), slice(None, 4), ValueError, r"token_slice must be slice\(start, stop\) with ints"),
        (slice(0, 2), slice(4, 2), ValueError, r"0 <= start <= stop, got slice\(4, 2, None\)"),
        ((0, 2), slice(0, 2), TypeError, "UBatchSlice.request_slice must be a slice, got tuple"),
    ],
)
def test_a_ubatch_slice_is_plain_and_contiguous(request_slice, token_slice, error, message):
    with pytest.raises(error, match=message):
        UBatchSlice(request_slice, token_slice)
    assert UBatchSlice(slice(0, 2, 1), slice(0, 4)).num_tokens == 4


@pytest.mark.parametrize("bad", [2, None, "ab"])
def test_check_slices_needs_a_sequence_of_slices(bad):
    with pytest.raises(TypeError, match="ubatch_slices must be a sequence of UBatchSlice"):
        check_slices(bad)


def test_even_slices_split_rows_as_evenly_as_possible():
    assert [s.num_tokens for s in even_slices(5, 3)] == [1, 2, 2]
    assert [s.token_slice for s in even_slices(4, 2)] == [slice(0, 2), slice(2, 4)]
    assert all(s.request_slice == s.token_slice for s in even_slices(7, 4))
    with pytest.raises(ValueError, match="cannot split 1 rows into 2 non-empty parts"):
        even_slices(1, 2)


def _two_request_metadata():
    return build_attention_metadata(
        [3, 5], [5, 5], torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.arange(8, dtype=torch.int64)
    )


def test_a_request_slice_beyond_the_metadata_is_named():
    slices = [UBatchSlice(slice(0, 1), slice(0, 3)), UBatchSlice(slice(1, 4), slice(3, 8))]
    with pytest.raises(
        ValueError,
        match=r"ubatch slice 1 has request_slice=slice\(1, 4, None\), beyond the "
        r"metadata's 2 requests",
    ):
        split_attn_metadata(_two_request_metadata(), slices)


def test_attention_metadata_splits_itself_through_the_protocol():
    md = _two_request_metadata()
    slices = split_batch([3, 5], 2)
    by_method = split_metadata(md, slices)
    assert all(isinstance(part, AttentionMetadata) for part in by_method)
    for a, b in zip(by_method, split_attn_metadata(md, slices)):
        assert a.query_start_loc_cpu.tolist() == b.query_start_loc_cpu.tolist()
        assert a.seq_lens_cpu.tolist() == b.seq_lens_cpu.tolist()


@dataclasses.dataclass
class _OwnMetadata:
    rows: range

    def split(self, slices):
        return [_OwnMetadata(self.rows[s.token_slice]) for s in slices]


class _ForeignMetadata:
    """A type one cannot edit: split by a registered function."""

    def __init__(self, tokens):
        self.tokens = tokens


class _ForeignSubclass(_ForeignMetadata):
    pass


def test_metadata_with_a_split_method_or_a_registered_splitter_is_split():
    slices = split_batch([2, 2, 2], 3)
    assert [m.rows for m in split_metadata(_OwnMetadata(range(6)), slices)] == [range(0, 2), range(2, 4), range(4, 6)]
    register_metadata_splitter(_ForeignMetadata, lambda md, ss: [md.tokens[s.token_slice] for s in ss])
    assert split_metadata(_ForeignSubclass([1, 2, 3, 4, 5, 6]), slices) == [[1, 2], [3, 4], [5, 6]]


@pytest.mark.parametrize("metadata", ["a string", torch.zeros(4), object(), 3])
def test_metadata_nobody_can_split_says_how_to_make_it_splittable(metadata):
    kind = type(metadata).__name__
    with pytest.raises(
        TypeError,
        match=f"layer0 is a {kind}, which UBatchWrapper cannot split: give {kind} a "
        f"split\\(slices\\) -> list method, register a splitter with "
        f"ubatch.slicing.register_metadata_splitter",
    ):
        split_metadata(metadata, split_batch([2, 2], 2), name="layer0")


def test_a_splitter_must_give_one_part_per_slice():
    class Short:
        def split(self, slices):
            return [self]

    with pytest.raises(ValueError, match="splitting md \\(Short\\) gave 1 parts for 2 slices"):
        split_metadata(Short(), split_batch([2, 2], 2), name="md")
    with pytest.raises(TypeError, match="register_metadata_splitter needs a type"):
        register_metadata_splitter("Short", lambda md, ss: [])
    with pytest.raises(TypeError, match="the splitter for Short must be callable"):
        register_metadata_splitter(Short, None)


@pytest.mark.parametrize("module", ["scheduler", "comm", "slicing", "arguments", "wrapper"])
def test_the_executor_does_not_import_the_attention_package(module):
    source = pathlib.Path(__file__).parent.parent / "ubatch" / f"{module}.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert not any(name == "ubatch.attention" or name.startswith("ubatch.attention.") for name in imported)
