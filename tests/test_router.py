"""Top-k routing (ubatch.models.router): the eager path against a float64 reference, the Triton
kernel (under Triton's CPU interpreter, and on CUDA) against the eager path, and on CUDA the
kernel's batch invariance (a row routes to the same bits in any batch cut).

Inputs keep each row's k-th and (k+1)-th probabilities apart (``separated``), so the float32
paths, which sum in other orders, pick the same experts; weights then agree to float32 rounding
(rtol 1e-5)."""

import pytest
import torch

from tests.interpreted import DONE, run_interpreted
from ubatch.models.router import route_top_k, route_top_k_eager


def separated(tokens: int, hidden: int, experts: int, top_k: int, seed: int):
    """x [tokens, hidden] (bf16) and a float32 router whose logits leave a gap of at least 1e-3
    in probability between each row's k-th and (k+1)-th expert (rows without one are redrawn)."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(experts, hidden, generator=g) / hidden**0.5
    x = torch.empty(0, hidden, dtype=torch.bfloat16)
    while len(x) < tokens:
        draw = torch.randn(4 * tokens + 8, hidden, generator=g).to(torch.bfloat16)
        probs = (draw.double() @ router.double().T).softmax(-1).sort(-1, descending=True).values
        gap = probs[:, top_k - 1] - (probs[:, top_k] if top_k < experts else 0)
        x = torch.cat([x, draw[gap > 1e-3]])
    return x[:tokens], router


def reference(x: torch.Tensor, router: torch.Tensor, top_k: int):
    probs = (x.double() @ router.double().T).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


CASES = [(17, 96, 8, 2), (40, 64, 64, 8), (5, 130, 5, 5), (0, 64, 8, 2)]  # (tokens, hidden, experts, top_k)


@pytest.mark.parametrize("tokens, hidden, experts, top_k", CASES)
def test_eager_routing_matches_the_reference(tokens, hidden, experts, top_k):
    x, router = separated(tokens, hidden, experts, top_k, seed=tokens)
    weights, ids = route_top_k(x, router, top_k)
    want_weights, want_ids = reference(x, router, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (tokens, top_k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.zeros(3, 8), torch.zeros(4, 6), 2), r"x \[tokens, hidden\].*x \(3, 8\), router \(4, 6\)"),
        ((torch.zeros(3, 8), torch.zeros(4, 8), 5), r"top_k must be in \[1, experts=4\], got 5"),
        ((torch.zeros(3, 8), torch.zeros(4, 8), 0), r"got 0"),
    ],
)
def test_bad_inputs_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        route_top_k(*args)


def test_kernel_under_the_interpreter_matches_the_eager_path():
    """Hidden sizes that are and are not a multiple of the kernel's block, experts below and above
    its minimum of 16 columns, every expert picked, no rows."""
    script = f"""
import torch
from tests.test_router import CASES, separated
from ubatch.models import router as routing

for tokens, hidden, experts, top_k in CASES:
    x, router = separated(tokens, hidden, experts, top_k, seed=tokens)
    weights, ids = routing.route_top_k_kernel(x, router, top_k)
    want_weights, want_ids = routing.route_top_k_eager(x, router, top_k)
    assert torch.equal(ids, want_ids), (tokens, ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
print("{DONE}")
"""
    run_interpreted(script)


@pytest.mark.cuda
def test_cuda_kernel_matches_eager_routes_any_cut_alike_and_replays_in_a_graph():
    x, router = (t.cuda() for t in separated(1024, 4096, 64, 8, seed=1))
    weights, ids = route_top_k(x, router, 8)
    want_weights, want_ids = route_top_k_eager(x, router, 8)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    for cut in (slice(0, 1), slice(3, 200), slice(512, 1024)):
        part_weights, part_ids = route_top_k(x[cut], router, 8)
        assert torch.equal(part_ids, ids[cut]) and torch.equal(part_weights, weights[cut])
    graph_weights, graph_ids = torch.empty_like(weights), torch.empty_like(ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, i = route_top_k(x, router, 8)
        graph_weights.copy_(w)
        graph_ids.copy_(i)
    x.copy_(x.flip(0))
    graph.replay()
    assert torch.equal(graph_ids, ids.flip(0)) and torch.equal(graph_weights, weights.flip(0))
