"""grouped_gemm: each group of sorted rows times its expert's weight, as ``torch._grouped_mm``.

The kernel runs under Triton's CPU interpreter where Triton is installed (CI has none, and skips),
and on the GPU in the ``cuda`` tests: against ``torch._grouped_mm`` over random group sizes, empty
groups included, at each block choice, and replayed from a CUDA graph with the group ends changed
between replays. The argument check runs everywhere.
"""

import pytest
import torch

from tests.interpreted import run_interpreted
from ubatch.models import grouped_gemm

CHECK = """
import torch
from ubatch.models import grouped_gemm


def cases(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    for groups, rows, n, k in [(1, 40, 48, 32), (3, 70, 40, 48), (5, 33, 64, 40), (4, 0, 16, 16), (2, 9, 16, 16)]:
        x = torch.randn(rows + 7, k, generator=g).to(dtype)
        w = torch.randn(groups, n, k, generator=g).to(dtype)
        pick = torch.randint(0, groups, (rows,), generator=g)
        pick[pick == 1] = 0  # group 1 (where there is one) gets no rows
        ends = torch.bincount(pick, minlength=groups).cumsum(0).to(torch.int32)
        yield x.to(device), w.to(device), ends.to(device)


def check(x, w, ends, blocks):
    out = grouped_gemm._launch(x, w, ends, blocks)
    start = 0
    for e, end in enumerate(ends.tolist()):
        expected = x[start:end].double() @ w[e].double().T
        torch.testing.assert_close(out[start:end].double(), expected, atol=1e-2, rtol=1e-2)
        start = end
    return start
"""


def test_kernel_interpreted():
    """Every group's rows against float64 matmuls, uneven K (masked steps) and even, fp16 and fp32."""
    run_interpreted(
        CHECK
        + """
checked = 0
for dtype in (torch.float16, torch.float32):
    for case in cases("cpu", dtype, 0):
        for blocks in ((16, 16, 16, 1, 1), (16, 32, 32, 1, 1)):
            checked += check(*case, blocks)
assert checked > 0
print("interpreted kernel ok")
""",
        timeout=600,
    )


def test_grouped_gemm_names_what_it_does_not_take():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"rows \(4, 32\) torch.float32 on cpu"):
        grouped_gemm.grouped_gemm(x, torch.randn(2, 8, 32), torch.tensor([2, 4], dtype=torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("blocks", [None, (64, 64, 64, 4, 4), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3)])
def test_matches_torch_grouped_mm(blocks):
    """Random group sizes over a buffer with padding rows past the last end: the rows below it
    equal ``torch._grouped_mm``'s to bf16 rounding (the sums run in float32 in both)."""
    g = torch.Generator().manual_seed(1)
    for groups, rows, n, k in [(1, 300, 512, 256), (4, 700, 384, 512), (8, 129, 256, 1024), (3, 0, 128, 128)]:
        x = torch.randn(rows + 64, k, generator=g).to("cuda", torch.bfloat16)
        w = (torch.randn(groups, n, k, generator=g) * 0.05).to("cuda", torch.bfloat16)
        ends = torch.bincount(torch.randint(0, groups, (rows,), generator=g), minlength=groups).cumsum(0)
        ends = ends.to("cuda", torch.int32)
        expected = torch._grouped_mm(x, w.transpose(1, 2), offs=ends)[:rows]
        got = grouped_gemm.grouped_gemm(x, w, ends, blocks)[:rows]
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_replays_from_a_graph_with_new_group_ends():
    """The tile each program takes comes from the ends on the device: a captured launch follows
    ends written between replays."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 256, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(4, 384, 256, generator=g) * 0.05).to("cuda", torch.bfloat16)
    ends = torch.tensor([100, 100, 250, 400], dtype=torch.int32, device="cuda")
    grouped_gemm.grouped_gemm(x, w, ends)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_gemm.grouped_gemm(x, w, ends)
    for new_ends in ([0, 10, 300, 512], [128, 256, 384, 500], [5, 5, 5, 5]):
        ends.copy_(torch.tensor(new_ends, dtype=torch.int32))
        graph.replay()
        last = new_ends[-1]
        expected = torch._grouped_mm(x, w.transpose(1, 2), offs=ends)[:last]
        torch.testing.assert_close(out[:last], expected, atol=2e-2, rtol=2e-2)


def test_pick_gemm_reads_the_environment_and_names_a_bad_value(monkeypatch):
    x, w, ends = torch.randn(4, 32), torch.randn(1, 8, 32), torch.tensor([4], dtype=torch.int32)
    for choice in ("auto", "triton", "torch"):
        monkeypatch.setenv(grouped_gemm.GEMM_ENV, choice)
        assert grouped_gemm.pick_gemm(x, w, ends) == "torch"  # the kernel takes no CPU tensors
    monkeypatch.setenv(grouped_gemm.GEMM_ENV, "cutlass")
    with pytest.raises(ValueError, match="UBATCH_EXPERT_GEMM must be one of auto, triton, torch, got 'cutlass'"):
        grouped_gemm.pick_gemm(x, w, ends)
