"""The down projection over rows sorted by expert (ubatch.models.counted_gemm): the Triton kernel
under Triton's CPU interpreter and on CUDA against a float64 reference per expert.

Tolerance: the kernel accumulates in float32 and rounds once to the output dtype, so each
element is within one bf16 rounding (2^-8 relative) of the float64 product plus float32 error.
The interpreted test runs in float16: Triton's interpreter (3.9) multiplies bf16 blocks as if
their bits were other numbers (outputs near 1e10), while it reads float16 right."""

import pytest
import torch

from tests.interpreted import DONE, run_interpreted
from ubatch.models import counted_gemm


def case(ends: list[int], rows: int, inner: int, cols: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    """x [rows, inner] and w [experts, cols, inner], and the experts' int32 end offsets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, generator=g).to(dtype)
    w = (torch.randn(len(ends), cols, inner, generator=g) / inner**0.5).to(dtype)
    return x, w, torch.tensor(ends, dtype=torch.int32)


def reference(x: torch.Tensor, w: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """Rows below the last end through their expert in float64; the rows past it are absent."""
    starts = [0, *ends[:-1]]
    return torch.cat([x[a:b].double() @ w[e].double().T for e, (a, b) in enumerate(zip(starts, ends))])


def assert_matches(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ends: list[int]) -> None:
    want = reference(x, w, ends)
    got = out[: ends[-1]].double()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert (got - want).abs().le(want.abs() * 2**-8 + 1e-3).all(), (got - want).abs().max()


CASES = [
    # (ends, rows, inner, cols): one expert with padding rows past its end; three experts with an
    # empty one and tiles that straddle experts; inner not a multiple of the K block, cols not of N
    ([37], 64, 64, 32),
    ([5, 5, 40], 48, 80, 48),
    ([16, 33, 33, 70], 80, 32, 40),
]


def test_kernel_under_the_interpreter_matches_the_reference():
    """Blocks of 16 rows, 32 columns and 16 of K, so tiles straddle experts and every loop turns."""
    script = f"""
import torch
from tests.test_counted_gemm import CASES, assert_matches, case
from ubatch.models import counted_gemm

for seed, (ends, rows, inner, cols) in enumerate(CASES):
    x, w, ends_t = case(ends, rows, inner, cols, seed, torch.float16)
    out = counted_gemm._launch(x, w, ends_t, (16, 32, 16, 4, 1))
    assert out.shape == (rows, cols) and out.dtype == torch.float16, (out.shape, out.dtype)
    assert_matches(out, x, w, ends)
print("{DONE}")
"""
    run_interpreted(script)


def test_inputs_it_cannot_take_are_refused_by_name():
    x, w, ends = case([4], 8, 16, 16, 0)
    with pytest.raises(ValueError, match=r"ends \(1,\) torch.int64"):
        counted_gemm.grouped_rows_matmul(x, w, ends.long())
    assert not counted_gemm.kernel_takes(x, w, ends)  # CPU: the callers keep their torch path


@pytest.mark.cuda
def test_cuda_kernel_matches_per_expert_gemms_and_replays_in_a_graph():
    """moe-bench's down projection (14336 -> 4096) for one expert and for four, then a graph
    captured once replays new end offsets; a row's bits do not depend on the other rows."""
    for ends in ([300], [100, 100, 260, 500]):
        x, w, ends_t = (t.cuda() for t in case(ends, 640, 14336, 4096, seed=len(ends)))
        out = counted_gemm.grouped_rows_matmul(x, w, ends_t)
        assert_matches(out, x, w, ends)
        alone = counted_gemm.grouped_rows_matmul(
            x[40:41].contiguous(), w[:1], torch.ones(1, dtype=torch.int32, device="cuda")
        )
        assert torch.equal(alone[0], out[40])
    out = torch.empty(640, 4096, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(counted_gemm.grouped_rows_matmul(x, w, ends_t))
    ends_t.copy_(torch.tensor([10, 200, 200, 640], dtype=torch.int32))
    graph.replay()
    assert_matches(out, x, w, [10, 200, 200, 640])
