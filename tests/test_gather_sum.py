"""gather_sum: each output row the weighted float32 sum of the rows its index names, skipping
negative indices (whatever the source or the weight holds there), plus ``add``; the torch path
on CPU against a float64 reference, the Triton kernel against the torch path (interpreted on CPU
where triton is installed, and on a GPU, also replayed from a CUDA graph).

Tolerance: against the float64 reference, one rounding of the float32 sum to the output dtype
(half an ulp; float32: 1e-6 relative); kernel against torch path, one ulp (the float32 sums may
differ in their last bit, and round to neighbouring values)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.interpreted import run_interpreted
from ubatch.models.gather_sum import _gather_sum_torch, gather_sum

ROUNDING = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}
ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def reference(src, index, weight=None, add=None):
    out = torch.zeros(index.shape[0], src.shape[1], dtype=torch.float64)
    for i, row in enumerate(index.tolist()):
        for j, source in enumerate(row):
            if source >= 0:
                out[i] += src[source].double() * (1.0 if weight is None else float(weight[i, j]))
    if add is not None:
        out[: len(add)] += add.double()
    return out


def _case(rows, k, n, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(n, hidden, generator=g).to(dtype)
    index = torch.randint(-1, n, (rows, k), generator=g)
    weight = torch.rand(rows, k, generator=g)
    weight[index < 0] = float("nan")  # never read
    add = torch.randn(rows, hidden, generator=g).to(dtype)
    return src, index, weight, add


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 9),
    k=st.integers(1, 8),
    n=st.integers(1, 12),
    hidden=st.integers(1, 40),
    dtype=st.sampled_from(list(ROUNDING)),
    weighted=st.booleans(),
    added=st.booleans(),
    added_rows=st.integers(0, 9),
    seed=st.integers(0, 2**16),
)
def test_torch_path_matches_the_reference(rows, k, n, hidden, dtype, weighted, added, added_rows, seed):
    """With ``add`` of every row, or of the first ``added_rows`` only (the rest add 0)."""
    src, index, weight, add = _case(rows, k, n, hidden, dtype, seed)
    weight, add = (weight if weighted else None), (add[: min(rows, added_rows)] if added else None)
    got = gather_sum(src, index, weight, add)
    assert got.dtype == dtype and got.shape == (rows, hidden)
    expected = reference(src, index, weight, add)
    torch.testing.assert_close(got.double(), expected, rtol=ROUNDING[dtype], atol=ROUNDING[dtype])


def test_rows_a_negative_index_names_are_not_read():
    src = torch.tensor([[1.0, 2.0], [float("nan"), float("inf")]])
    index = torch.tensor([[0, -1], [-1, -1]])
    weight = torch.tensor([[2.0, float("nan")], [float("nan"), 1.0]])
    torch.testing.assert_close(gather_sum(src, index, weight), torch.tensor([[2.0, 4.0], [0.0, 0.0]]))


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((torch.zeros(3), torch.zeros(2, 1, dtype=torch.int64)), ValueError, "src \\[n, hidden\\]"),
        ((torch.zeros(3, 2), torch.zeros(2, 1, dtype=torch.int32)), TypeError, "int64"),
        ((torch.zeros(3, 2), torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 2)), ValueError, "weight"),
        ((torch.zeros(3, 2), torch.zeros(2, 1, dtype=torch.int64), None, torch.zeros(3, 2)), ValueError, "add"),
        ((torch.zeros(3, 2), torch.zeros(2, 1, dtype=torch.int64), None, None, torch.zeros(2, 3)), ValueError, "out"),
        (
            (torch.zeros(3, 2), torch.zeros(2, 1, dtype=torch.int64), None, None, torch.zeros(2, 2).t()),
            ValueError,
            "out",
        ),
    ],
)
def test_bad_inputs_name_the_problem(args, error, message):
    with pytest.raises(error, match=message):
        gather_sum(*args)


def test_out_may_be_the_add_to_accumulate_in_float32():
    """What the expert groups do: each group's bf16 outputs added into one float32 sum per row."""
    first, index, weight, _ = _case(6, 3, 10, 24, torch.bfloat16, 1)
    second, other, other_weight, _ = _case(6, 2, 10, 24, torch.bfloat16, 2)
    acc = torch.zeros(6, 24)
    assert gather_sum(first, index, weight, add=acc, out=acc) is acc
    gather_sum(second, other, other_weight, add=acc, out=acc)
    expected = reference(first, index, weight) + reference(second, other, other_weight)
    torch.testing.assert_close(acc.double(), expected, rtol=1e-6, atol=1e-6)


def test_rows_past_the_add_start_from_zero_whatever_out_held():
    """A later expert group's sum over rows of which only the first ones hold earlier groups'
    sums: the new rows need no zeros first."""
    src, index, weight, _ = _case(6, 3, 10, 24, torch.float32, 3)
    acc = torch.full((6, 24), float("nan"))
    acc[:2] = 1.0
    gather_sum(src, index, weight, add=acc[:2], out=acc)
    expected = reference(src, index, weight)
    expected[:2] += 1.0
    torch.testing.assert_close(acc.double(), expected, rtol=1e-6, atol=1e-6)


def test_triton_kernel_interpreted():
    """The kernel under Triton's CPU interpreter against the torch path: every dtype, weighted or
    not, with and without ``add``, a strided source and weight, a hidden size past one block."""
    script = """
import torch
from ubatch.models import gather_sum as m
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for rows, k, n, hidden in ((5, 3, 7, 8), (4, 8, 9, 1100), (0, 2, 3, 5)):
        wide = torch.randn(n, hidden + 6).to(dtype)
        index = torch.randint(-1, n, (rows, k))
        weight = torch.rand(rows, k)
        weight[index < 0] = float("nan")
        strided_weight = torch.rand(rows, k + 3)[:, 2 : 2 + k]  # as the weight columns of dispatch rows
        strided_weight[index < 0] = float("nan")
        add = torch.randn(rows, hidden).to(dtype)
        for src in (wide[:, :hidden].contiguous(), wide[:, 3 : 3 + hidden]):
            for w in (None, weight, strided_weight):
                for a in (None, add, add[: rows // 2]):
                    got = torch.empty(rows, hidden, dtype=dtype)
                    m._gather_sum_triton(src, index, w, a, got)
                    want = m._gather_sum_torch(src, index, w, a).to(dtype)
                    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-5)
        # accumulating in place: out is add, in float32
        acc = torch.randn(rows, hidden)
        want = m._gather_sum_torch(src, index, weight, acc)
        m._gather_sum_triton(src, index, weight, acc, acc)
        torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-6)
        # in place with rows that have nothing to add: they keep their sums
        sparse = torch.where(torch.arange(rows)[:, None] % 2 == 0, -1, index)
        acc = torch.randn(rows, hidden)
        want = m._gather_sum_torch(src, sparse, weight, acc)
        m._gather_sum_triton(src, sparse, weight, acc, acc)
        torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-6)
        # the first rows accumulated in place, the rest new whatever they held
        want = m._gather_sum_torch(src, index, weight, acc[: rows // 2])
        acc[rows // 2 :] = float("nan")
        m._gather_sum_triton(src, index, weight, acc[: rows // 2], acc)
        torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-6)
print("interpreted kernel ok")
"""
    run_interpreted(script)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_the_torch_path_and_replays_from_a_graph(dtype):
    src, index, weight, add = (t.cuda() for t in _case(300, 8, 700, 4096, dtype, 0))

    def torch_path(add):
        return _gather_sum_torch(src, index, weight, add).to(dtype)

    got = gather_sum(src, index, weight, add)
    torch.testing.assert_close(got, torch_path(add), rtol=ULP[dtype], atol=1e-5)
    strided = torch.full((len(weight), 11), float("nan"), device="cuda")
    strided[:, 2:10] = weight
    torch.testing.assert_close(gather_sum(src, index, strided[:, 2:10], add), got, rtol=0, atol=0)
    acc = add.float()
    want = _gather_sum_torch(src, index, weight, acc)
    gather_sum(src, index, weight, add=acc, out=acc)  # in place, in float32
    torch.testing.assert_close(acc, want, rtol=2e-6, atol=1e-5)
    want = _gather_sum_torch(src, index, weight, acc[:100])
    acc[100:] = float("nan")
    gather_sum(src, index, weight, add=acc[:100], out=acc)  # rows past the add start from zero
    torch.testing.assert_close(acc, want, rtol=2e-6, atol=1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gather_sum(src, index, weight, add)
    src.mul_(2)
    graph.replay()
    torch.testing.assert_close(captured, torch_path(add), rtol=ULP[dtype], atol=1e-5)
