"""swiglu: silu(gate) * up in one pass, padding rows (at and past a device-side row count) zero or unwritten.

CPU tests cover the eager fallback and the argument checks; the Triton kernel runs under Triton's interpreter
where Triton is installed, and on the GPU in the ``cuda`` tests (against the fallback, under graph capture and
with host syncs turned into errors).
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.interpreted import run_interpreted
from ubatch.models.swiglu import swiglu, triton_available

ROOT = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One rounding of the float32 result to the output dtype, relative (half an ulp), plus float32's own error.
ROUNDING = {torch.float32: 1e-6, torch.bfloat16: 2**-8 + 1e-6, torch.float16: 2**-11 + 1e-6}
SUBNORMAL_HALF_STEP = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}


def reference(gate_up, num_valid=None, row_scale=None):
    """float64 silu(gate) * up (* row_scale), rows at and past ``num_valid`` zero."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    out = F.silu(gate) * up
    if row_scale is not None:
        out = out * row_scale.double()[:, None]
    if num_valid is not None:
        out[max(0, num_valid) :] = 0
    return out


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 33),
    inter=st.integers(1, 70),
    dtype=st.sampled_from(DTYPES),
    num_valid=st.one_of(st.none(), st.integers(-3, 36)),
    scaled=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_fallback_matches_reference(rows, inter, dtype, num_valid, scaled, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype)
    row_scale = torch.rand(rows, generator=gen) if scaled else None
    count = None if num_valid is None else torch.tensor(num_valid)
    out = swiglu(gate_up, count, row_scale=row_scale)
    assert out.shape == (rows, inter) and out.dtype == dtype
    expected = reference(gate_up, num_valid, row_scale)
    torch.testing.assert_close(out.double(), expected, rtol=ROUNDING[dtype], atol=SUBNORMAL_HALF_STEP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_equals_eager_silu_mul(dtype):
    """A drop-in for ``F.silu(gate) * up``: the eager expression rounds twice in a low-precision dtype, the
    fallback once, so they agree to two ulps (exactly in float32 up to float32 rounding)."""
    gate_up = torch.randn(64, 2 * 96).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(swiglu(gate_up), F.silu(gate) * up, rtol=2 * eps, atol=1e-5)


def test_padding_rows_are_zero_whatever_they_hold():
    gate_up = torch.randn(6, 8)
    gate_up[4:] = float("nan")
    out = swiglu(gate_up, torch.tensor([4], dtype=torch.int32))
    assert torch.equal(out[4:], torch.zeros(2, 4))
    torch.testing.assert_close(out[:4].double(), reference(gate_up[:4]))


@pytest.mark.parametrize("count,valid", [(0, 0), (-2, 0), (5, 5), (9, 6)])
def test_row_count_outside_the_rows_clamps(count, valid):
    gate_up = torch.randn(6, 10)
    out = swiglu(gate_up, torch.tensor(count, dtype=torch.int64))
    torch.testing.assert_close(out.double(), reference(gate_up, valid))


def test_row_scale_multiplies_each_row():
    gate_up, scale = torch.randn(5, 12), torch.tensor([0.5, 2.0, -1.0, 0.0, 3.0])
    torch.testing.assert_close(swiglu(gate_up, row_scale=scale), swiglu(gate_up) * scale[:, None])


def test_strided_input():
    """A view with a row stride wider than 2I (a slice of a wider projection) reads the right columns."""
    wide = torch.randn(7, 40)
    gate_up = wide[:, 4:28]
    torch.testing.assert_close(swiglu(gate_up).double(), reference(gate_up))


@pytest.mark.parametrize(
    "gate_up,count,scale,error,match",
    [
        (torch.randn(4, 7), None, None, ValueError, "even"),
        (torch.randn(8), None, None, ValueError, "2-D"),
        (torch.randn(2, 4, 8), None, None, ValueError, "2-D"),
        (torch.ones(4, 8, dtype=torch.int32), None, None, TypeError, "floating-point"),
        ([[1.0, 2.0]], None, None, TypeError, "torch.Tensor"),
        (torch.randn(4, 8), 3, None, TypeError, "tensor on the device"),
        (torch.randn(4, 8), torch.tensor(3.0), None, TypeError, "integer tensor"),
        (torch.randn(4, 8), torch.tensor(True), None, TypeError, "integer tensor"),
        (torch.randn(4, 8), torch.tensor([1, 2]), None, ValueError, "one element"),
        (torch.randn(4, 8), None, torch.ones(3), ValueError, r"shape \(4,\)"),
        (torch.randn(4, 8), None, torch.ones(4, dtype=torch.int64), TypeError, "floating-point"),
        (torch.randn(4, 8), None, [1.0] * 4, TypeError, "torch.Tensor"),
    ],
)
def test_bad_inputs(gate_up, count, scale, error, match):
    with pytest.raises(error, match=match):
        swiglu(gate_up, count, row_scale=scale)


def test_triton_kernel_interpreted():
    """The Triton kernel itself, run by Triton's CPU interpreter against the fallback: all dtypes, counts
    inside and outside the rows, scaled or not, zeroed or skipped padding, a strided input."""
    script = """
import torch
from ubatch.models import swiglu as m
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for rows, inter in ((5, 8), (7, 48), (3, 1100)):
        wide = torch.randn(rows, 2 * inter + 6).to(dtype)
        for gate_up in (wide[:, : 2 * inter].contiguous(), wide[:, 3 : 3 + 2 * inter]):
            for count in (None, 0, 3, rows + 4, -1):
                limit = None if count is None else torch.tensor(count, dtype=torch.int32)
                valid = rows if count is None else max(0, min(count, rows))
                for scale in (None, torch.rand(rows)):
                    for zero in (True, False):
                        got = m._swiglu_triton(gate_up, limit, scale, zero)
                        want = m._swiglu_eager(gate_up, limit, scale)
                        torch.testing.assert_close(got[:valid], want[:valid], rtol=2 ** -7, atol=1e-5)
                        if zero:
                            assert torch.equal(got[valid:], want[valid:])
print("interpreted kernel ok")
"""
    run_interpreted(script)


def test_bench_script_dry_run(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_swiglu", ROOT / "scripts" / "bench_swiglu.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_swiglu"] = bench  # dataclasses resolve their annotations through it
    spec.loader.exec_module(bench)
    out = tmp_path / "swiglu.json"
    rows = bench.main(["--dry-run", "--out", str(out)])
    assert [r.valid_rows * 2 for r in rows] == [r.rows for r in rows]
    assert {r.variant for r in rows} >= {"eager silu*mul", "kernel, padding skipped"}
    skipped = next(r for r in rows if r.variant == "kernel, padding skipped")
    assert skipped.gbytes == 3 * skipped.valid_rows * 64 * 2 / 1e9  # valid rows read (2I) and written (I), bf16
    assert len(json.loads(out.read_text())["rows"]) == len(rows)
    assert "kernel, padding zeroed" in capsys.readouterr().out


def _gpu_inputs(rows, inter, valid, *, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(rows, 2 * inter, generator=gen, device="cuda").to(torch.bfloat16)
    gate_up[valid:] = float("nan")  # padding: whatever the grouped GEMM left there
    return gate_up, torch.tensor([valid], dtype=torch.int32, device="cuda")


@pytest.mark.cuda
def test_gpu_uses_the_kernel():
    assert triton_available(torch.device("cuda")), "Triton is not importable on this GPU machine"


@pytest.mark.cuda
@pytest.mark.parametrize("rows,inter,valid", [(1, 16, 1), (37, 200, 20), (2048, 14336, 1024), (300, 2048, 0)])
def test_gpu_kernel_matches_fallback(rows, inter, valid):
    """bf16: the kernel and the fallback compute in float32 and round once; the kernel's exp is approximate,
    so a float32 result near a rounding boundary can round the other way: one bf16 ulp (2^-7 relative)."""
    from ubatch.models.swiglu import _swiglu_eager

    gate_up, count = _gpu_inputs(rows, inter, valid)
    scale = torch.rand(rows, device="cuda")
    for row_scale in (None, scale):
        got = swiglu(gate_up, count, row_scale=row_scale)
        want = _swiglu_eager(gate_up, count, row_scale)
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)
        assert torch.equal(got[valid:], torch.zeros_like(got[valid:]))
        exact = reference(gate_up, valid, row_scale)
        assert (got.double() - exact).norm() / max(exact.norm(), 1e-30) < 5e-3


@pytest.mark.cuda
def test_gpu_skipped_padding_is_left_unwritten():
    rows, inter, valid = 64, 256, 40
    gate_up, count = _gpu_inputs(rows, inter, valid)
    swiglu(gate_up, count)  # compile before the allocator trick below
    torch.full((rows, inter), 7.0, dtype=torch.bfloat16, device="cuda")  # freed: its block is reused next
    out = swiglu(gate_up, count, zero_padding=False)
    assert torch.equal(out[valid:], torch.full_like(out[valid:], 7.0))
    torch.testing.assert_close(out[:valid], swiglu(gate_up, count)[:valid])


@pytest.mark.cuda
def test_gpu_graph_replay_with_changing_row_count_and_no_host_sync():
    from ubatch.models.swiglu import _swiglu_eager

    rows, inter = 512, 1024
    gate_up, count = _gpu_inputs(rows, inter, rows)
    gate_up.copy_(torch.randn_like(gate_up))
    swiglu(gate_up, count)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = swiglu(gate_up, count)
    outputs, expected = [], []
    torch.cuda.set_sync_debug_mode("error")
    try:
        swiglu(gate_up, count)
        for valid in (rows, 300, 0, 1, 511):
            count.fill_(valid)
            graph.replay()
            outputs.append(out.clone())
            expected.append(_swiglu_eager(gate_up, count, None))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for valid, got, want in zip((rows, 300, 0, 1, 511), outputs, expected):
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)
        assert torch.equal(got[valid:], torch.zeros_like(got[valid:]))
