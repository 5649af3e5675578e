"""RMSNorm and the residual add before it (ubatch.models.rms_norm): the eager path and the Triton
kernel (under Triton's CPU interpreter, and on CUDA) against a float64 reference.

Tolerance: float32 1e-5; bf16 one rounding of the output (2^-7 relative); the residual sum, which
both paths round once from float32, exactly (on CUDA and eagerly; the interpreter rounds toward
zero, so there one rounding)."""

import pytest
import torch

from tests.interpreted import DONE, run_interpreted
from ubatch.models.rms_norm import add_rms_norm, add_rms_norm_eager, rms_norm


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _case(rows: int, hidden: int, dtype: torch.dtype, seed: int):
    """x a slice of wider rows (strided, as a view of a larger buffer), a residual, a weight."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden + 5, generator=g) * 3).to(dtype)[:, :hidden]
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = torch.randn(hidden, generator=g).to(dtype)
    return x, delta, weight


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_norms_match_the_reference(dtype):
    x, delta, weight = _case(9, 48, dtype, seed=0)
    out = rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), reference(x, weight, 1e-5), **_tolerance(dtype))
    total, normed = add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed.double(), reference(x + delta, weight, 1e-5), **_tolerance(dtype))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: rms_norm(torch.zeros(3, 8), torch.zeros(4), 1e-6), r"weight must be \[hidden\].*\(4,\), x \(3, 8\)"),
        (
            lambda: add_rms_norm(torch.zeros(3, 8), torch.zeros(3, 4), torch.zeros(8), 1e-6),
            r"delta must match x \(\(3, 8\)",
        ),
        (
            lambda: add_rms_norm(torch.zeros(3, 8), torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(8), 1e-6),
            "torch.bfloat16",
        ),
    ],
)
def test_bad_shapes_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_kernel_under_the_interpreter_matches_the_reference():
    """Widths that are and are not a power of two, float32 and bf16, strided rows, no rows."""
    script = f"""
import torch
from tests.test_rms_norm import _case, _tolerance, reference
from ubatch.models import rms_norm

for rows, hidden, dtype in [(5, 64, torch.bfloat16), (3, 96, torch.float32), (4, 200, torch.bfloat16),
                            (0, 64, torch.bfloat16)]:
    x, delta, weight = _case(rows, hidden, dtype, seed=rows + hidden)
    normed = rms_norm._norm_triton(x, None, weight, 1e-6)[1]
    assert normed.dtype == dtype and normed.shape == x.shape, (normed.dtype, normed.shape)
    torch.testing.assert_close(normed.double(), reference(x, weight, 1e-6), **_tolerance(dtype))
    total, normed = rms_norm._norm_triton(x, delta, weight, 1e-6)
    # the interpreter rounds float32 to bf16 toward zero (the GPU to nearest): one rounding apart
    torch.testing.assert_close(total, x + delta, rtol=0 if dtype == torch.float32 else 2**-7, atol=0)
    torch.testing.assert_close(normed.double(), reference(x + delta, weight, 1e-6), **_tolerance(dtype))
print("{DONE}")
"""
    run_interpreted(script)


@pytest.mark.cuda
def test_cuda_kernel_matches_the_eager_norm_and_replays_in_a_graph():
    x, delta, weight = (t.cuda() for t in _case(64, 4096, torch.bfloat16, seed=3))
    total, normed = add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed.double(), reference(x + delta, weight, 1e-6), **_tolerance(torch.bfloat16))
    eager = add_rms_norm_eager(x, delta, weight, 1e-6)[1].float()  # at most one rounding apart
    assert (normed.float() - eager).abs().le(eager.abs() * 2**-7 + 1e-6).all()
    out = torch.empty_like(normed)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(rms_norm(x, weight, 1e-6))
    x.mul_(0.5)
    graph.replay()
    torch.testing.assert_close(out.double(), reference(x, weight, 1e-6), **_tolerance(torch.bfloat16))
