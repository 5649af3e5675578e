"""The rotary embedding (ubatch.models.rotary): the eager path and the Triton kernel (under Triton's
CPU interpreter, and on CUDA) against a float64 reference, on strided rows as a fused QKV
projection leaves them."""

import pytest
import torch

from tests.interpreted import DONE, run_interpreted
from ubatch.models.rotary import rotate_neox


def reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """float64 rotation of each head's halves; angles from float32 positions times inv_freq, as the
    implementations take them."""
    angles = (positions.float()[:, None] * inv_freq[None, :]).double()
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.double().view(x.shape[0], x.shape[1] // head_dim, head_dim).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(1)


def _case(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """A query-and-key slice of a wider fused projection (rows strided), positions up to 8191."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 3) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 8192, (tokens,), generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return qkv[:, : heads * head_dim], positions, inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_rotation_matches_the_reference(dtype):
    x, positions, inv_freq = _case(7, 5, 16, dtype, seed=1)
    out = rotate_neox(x, positions, inv_freq, 16)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.double(), reference(x, positions, inv_freq, 16), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.zeros(3, 10), torch.zeros(3), torch.zeros(2), 4), r"x must be \[tokens, heads \* head_dim\]"),
        ((torch.zeros(3, 12), torch.zeros(3), torch.zeros(2), 3), "an even head_dim 3"),
        ((torch.zeros(3, 8), torch.zeros(4), torch.zeros(2), 4), r"positions must be \[3\], got \(4,\)"),
        ((torch.zeros(3, 8), torch.zeros(3), torch.zeros(4), 4), r"inv_freq must be \[2\], got \(4,\)"),
    ],
)
def test_bad_shapes_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        rotate_neox(*args)


def test_kernel_under_the_interpreter_matches_the_reference():
    """Head counts that leave a program's last group of heads partly empty, head sizes whose half
    is not a power of two, float32 and bf16 inputs, no tokens."""
    script = f"""
import torch
from tests.test_rotary import _case, reference
from ubatch.models import rotary

for tokens, heads, head_dim, dtype in [(5, 40, 128, torch.bfloat16), (3, 3, 96, torch.float32),
                                       (4, 9, 16, torch.bfloat16), (0, 4, 64, torch.bfloat16)]:
    x, positions, inv_freq = _case(tokens, heads, head_dim, dtype, seed=tokens + heads)
    out = rotary._rotate_triton(x, positions, inv_freq, head_dim)
    assert out.dtype == dtype and out.shape == x.shape, (out.dtype, out.shape)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    expected = reference(x, positions, inv_freq, head_dim)
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    eager = rotary.rotate_neox_eager(x, positions, inv_freq, head_dim)
    if dtype == torch.bfloat16:  # one rounding apart at most where float32 rounding differs
        assert (out.float() - eager.float()).abs().le(eager.float().abs() * 2**-7 + 1e-6).all()
print("{DONE}")
"""
    run_interpreted(script)


@pytest.mark.cuda
def test_cuda_kernel_matches_the_reference_and_replays_in_a_graph():
    x, positions, inv_freq = (t.cuda() for t in _case(64, 40, 128, torch.bfloat16, seed=3))
    out = rotate_neox(x, positions, inv_freq, 128)
    torch.testing.assert_close(out.double(), reference(x, positions, inv_freq, 128), rtol=2**-7, atol=2**-7)
    graph, captured = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        captured = rotate_neox(x, positions, inv_freq, 128)
    positions.copy_(torch.randint(0, 8192, positions.shape, device="cuda"))
    graph.replay()
    torch.testing.assert_close(captured.double(), reference(x, positions, inv_freq, 128), rtol=2**-7, atol=2**-7)
