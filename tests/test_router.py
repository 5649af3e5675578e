"""The router's top-k: a row's logits, experts and weights are the same bits whatever batch holds it
(eager on the CPU, the Triton kernels under the interpreter and on CUDA), they match a float64
reference, ties go to the lower expert id, and bad input is refused by name."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.interpreted import DONE, run_interpreted
from ubatch.models.router import route_top_k, router_logits


def _case(rows: int, hidden: int, experts: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    router = torch.randn(experts, hidden, generator=g) / hidden**0.5
    return x.to(device), router.to(device)


def check_against_reference(x: torch.Tensor, router: torch.Tensor, top_k: int, weights, ids) -> None:
    """ids are the float64 logits' top k wherever the k-th and the next differ by more than float32
    noise (and in order where consecutive picks do), weights their softmax."""
    logits = x.double() @ router.double().T
    ordered, expected = logits.sort(dim=-1, descending=True)
    gaps = ordered[:, :-1] - ordered[:, 1:]
    clear = gaps[:, :top_k].min(dim=-1).values > 1e-4 * logits.abs().amax(dim=-1).clamp(min=1)
    assert clear.float().mean() > 0.9, "the case has too many near-ties to check against"
    assert torch.equal(ids[clear].cpu(), expected[clear, :top_k].cpu())
    reference = ordered[:, :top_k].softmax(dim=-1)
    torch.testing.assert_close(weights[clear].double(), reference[clear], atol=1e-5, rtol=1e-5)


def check_batch_invariance(x: torch.Tensor, router: torch.Tensor, top_k: int, cuts) -> None:
    """Every cut [a, b) of the batch gives its rows the full batch's weights and ids bit for bit."""
    weights, ids = route_top_k(x, router, top_k)
    for a, b in cuts:
        part_weights, part_ids = route_top_k(x[a:b], router, top_k)
        assert torch.equal(part_ids, ids[a:b]), (a, b)
        assert torch.equal(part_weights, weights[a:b]), (a, b)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 150),
    hidden=st.sampled_from([16, 70, 256, 300]),
    experts=st.integers(2, 40),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_a_rows_routing_does_not_depend_on_its_batch(rows, hidden, experts, seed, data):
    x, router = _case(rows, hidden, experts, torch.bfloat16, seed)
    top_k = data.draw(st.integers(1, min(8, experts)))
    a = data.draw(st.integers(0, rows - 1))
    b = data.draw(st.integers(a + 1, rows))
    check_batch_invariance(x, router, top_k, [(a, b), (a, a + 1)])
    assert torch.equal(router_logits(x[a:b], router), router_logits(x, router)[a:b])


def test_eager_routing_matches_a_float64_reference():
    x, router = _case(400, 512, 64, torch.bfloat16, seed=1)
    weights, ids = route_top_k(x, router, 8)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (400, 8)
    check_against_reference(x, router, 8, weights, ids)
    assert route_top_k(x[:0], router, 8)[1].shape == (0, 8)
    check_batch_invariance(x, router.bfloat16(), 8, [(0, 1), (3, 77)])  # a bf16 router's logits in float32 too


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, r: route_top_k(x, r.int(), 2), TypeError, "floating point, got torch.float32 and torch.int32"),
        (lambda x, r: route_top_k(x[:, :8], r, 2), ValueError, r"x \(5, 8\), router \(4, 16\)"),
        (lambda x, r: route_top_k(x[0], r, 2), ValueError, r"x \(16,\)"),
        (lambda x, r: route_top_k(x, r, 5), ValueError, "1..4 .* got 5"),
        (lambda x, r: route_top_k(x, r, 0), ValueError, "got 0"),
        (lambda x, r: route_top_k(x, r, True), ValueError, "got True"),
    ],
)
def test_bad_input_is_refused_by_name(call, error, match):
    x, router = _case(5, 16, 4, torch.float32, seed=0)
    with pytest.raises(error, match=match):
        call(x, router)


def test_kernels_under_the_interpreter_match_the_reference_and_each_batch():
    """float32 and bf16 rows, hidden widths off the program's slice and tile, experts above and
    below tl.dot's 16, ties, a NaN row and no rows."""
    script = f"""
import torch
from tests.test_router import _case, check_against_reference, check_batch_invariance
from ubatch.models import router as routing

routing.triton_available = lambda device: True  # the interpreter runs the kernels on CPU tensors
for rows, hidden, experts, top_k, dtype in [(70, 300, 20, 4, torch.float32), (40, 64, 8, 2, torch.bfloat16),
                                            (33, 520, 3, 3, torch.float32)]:
    x, router = _case(rows, hidden, experts, dtype, seed=rows)
    check_batch_invariance(x, router.to(dtype), top_k, [(0, 1), (3, rows - 2)])
    weights, ids = routing.route_top_k(x, router, top_k)
    check_against_reference(x, router, top_k, weights, ids)
    check_batch_invariance(x, router, top_k, [(0, 1), (5, 6), (3, rows - 2), (1, rows)])

x, router = _case(6, 32, 5, torch.float32, seed=0)
router[3] = router[1]  # experts 1 and 3 tie on every row
x[4] = float("nan")
weights, ids = routing.route_top_k(x, router, 5)
picked_1, picked_3 = (ids == 1).nonzero()[:, 1], (ids == 3).nonzero()[:, 1]
assert (picked_1 < picked_3).all(), ids  # a tie goes to the lower id
assert sorted(ids[4].tolist()) == [0, 1, 2, 3, 4], ids[4]  # distinct experts even for a NaN row
assert routing.route_top_k(x[:0], router, 2)[0].shape == (0, 2)
print("{DONE}")
"""
    run_interpreted(script)


@pytest.mark.cuda
def test_cuda_routing_is_batch_invariant_matches_the_reference_and_replays():
    x, router = _case(4096, 4096, 64, torch.bfloat16, seed=2, device="cuda")
    weights, ids = route_top_k(x, router, 8)
    check_against_reference(x, router, 8, weights, ids)
    check_batch_invariance(x, router, 8, [(0, 1), (7, 8), (0, 256), (100, 1124), (1, 4096), (2048, 4096)])
    out_weights, out_ids = torch.empty_like(weights[:256]), torch.empty_like(ids[:256])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = route_top_k(x[:256], router, 8)
        out_weights.copy_(captured[0])
        out_ids.copy_(captured[1])
    x[:256] = x[256:512]
    graph.replay()
    assert torch.equal(out_ids, ids[256:512]) and torch.equal(out_weights, weights[256:512])
