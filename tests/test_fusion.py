"""The fused glue: every function traces whole under torch.compile with dynamic shapes and gives
the plain function's values at two sizes; on CPU, and outside ``fused_glue()``, nothing is
compiled; on the GPU the fused model equals the plain one, eager and replayed from FULL graphs,
unsplit and split with joined experts.

Tolerance: CPU float32 traced with the eager backend, exact; GPU bf16, atol = rtol = 2e-2 (fused
kernels sum in another order).
"""

import contextlib

import pytest
import torch

from tests.test_ubatch_models import _forward
from ubatch.bench.workload import make_step
from ubatch.intercept import CollectiveInterceptor
from ubatch.models import ModelConfig, build_model, fusion
from ubatch.models.dispatch import dispatch_plan, static_tables
from ubatch.models.expert_compute import pad_expert_rows, sort_by_expert
from ubatch.models.rms_norm import add_rms_norm_eager, rms_norm_eager
from ubatch.models.rotary import rotate_neox_eager
from ubatch.models.router import route_top_k


def _inputs(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 32, generator=g)
    router = torch.randn(8, 32, generator=g)
    weights, ids = route_top_k(x, router, 2)
    expert = torch.randint(-1, 4, (3 * tokens,), generator=g)
    caps = (max(1, tokens // 2), max(1, tokens // 4))  # two ranks, two chunks of different capacities
    return {
        rms_norm_eager: (x, torch.rand(32, generator=g), 1e-6),
        add_rms_norm_eager: (x, torch.randn(tokens, 32, generator=g), torch.rand(32, generator=g), 1e-6),
        rotate_neox_eager: (x, torch.arange(tokens), torch.rand(4, generator=g), 8),
        dispatch_plan: (x, ids, weights, 4, 2, 2, caps, static_tables(list(caps), 2, torch.device("cpu"))),
        pad_expert_rows: (torch.randn(tokens, 32, generator=g), expert, 4, tokens),  # three experts per row
        sort_by_expert: (torch.randn(tokens, 32, generator=g), expert.view(tokens, 3), 4),
    }


def _defined(fn, result):
    """The parts of a result that hold defined values (the padded buffer's spare rows are left
    unwritten)."""
    result = result if isinstance(result, tuple) else (result,)
    if fn is pad_expert_rows:
        padded, slot, dropped = result
        rows = padded.flatten(0, 1)
        return slot, dropped, rows[slot[slot >= 0]]
    return result


@pytest.mark.parametrize(
    "name",
    [
        "rms_norm_eager",
        "add_rms_norm_eager",
        "rotate_neox_eager",
        "dispatch_plan",
        "pad_expert_rows",
        "sort_by_expert",
    ],
)
@pytest.mark.parametrize("in_ubatch_mode", [False, True])
@pytest.mark.parametrize("dynamic", [True, False])
def test_each_fused_function_traces_whole_with_dynamic_shapes(name, in_ubatch_mode, dynamic):
    """Also under the collective interceptor, the function mode every ubatch runs in (a Python
    Tensor method such as ``unflatten`` breaks the trace there), and compiled per shape
    (``fused_glue(dynamic=False)``)."""
    torch._dynamo.reset()
    fn = next(f for f in _inputs(4, 0) if f.__name__ == name)
    traced = torch.compile(fn.eager, backend="eager", fullgraph=True, dynamic=dynamic)
    for tokens in (6, 11):
        args = _inputs(tokens, tokens)[fn]
        with CollectiveInterceptor() if in_ubatch_mode else contextlib.nullcontext():
            got = traced(*args)
        for g, expected in zip(_defined(fn, got), _defined(fn, fn.eager(*args)), strict=True):
            torch.testing.assert_close(g, expected, atol=0, rtol=0)


def test_nothing_compiles_on_cpu_or_outside_fused_glue(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile was called")

    monkeypatch.setattr(torch, "compile", refuse)
    x, weight = torch.randn(3, 8), torch.rand(8)
    with fusion.fused_glue():
        torch.testing.assert_close(rms_norm_eager(x, weight, 1e-6), rms_norm_eager.eager(x, weight, 1e-6))
    if torch.cuda.is_available():
        rms_norm_eager(x.cuda(), weight.cuda(), 1e-6)


def test_fused_glue_compiles_once_with_dynamic_shapes_or_once_for_per_shape_use(monkeypatch):
    """One torch.compile per setting a process uses: dynamic=True, or dynamic=False (which dynamo
    then specialises per shape); never one per call."""
    made = []

    def fake_compile(fn, *, dynamic, fullgraph):
        made.append((dynamic, fullgraph))
        return lambda *args: ("compiled", dynamic)

    class OnCuda:
        is_cuda = True

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(fusion, "_triton_available", lambda: True)
    glue = fusion.fused(lambda x: "plain")
    assert glue(OnCuda()) == "plain", "outside fused_glue() nothing compiles"
    with fusion.fused_glue():
        assert glue(OnCuda()) == glue(OnCuda()) == ("compiled", True)
    with fusion.fused_glue(dynamic=False):
        assert glue(OnCuda()) == ("compiled", False)
    with fusion.fused_glue(False):
        assert glue(OnCuda()) == "plain"
    assert made == [(True, True), (False, True)]


@pytest.mark.cuda
@pytest.mark.parametrize("mode_name", ["unsplit", "split2+join", "pipeline2", "split2+join+pipeline2"])
def test_fused_model_equals_plain_model_eager_and_replayed(mode_name):
    from ubatch import CUDAGraphMode, split_batch
    from ubatch.graphed import GraphedModel
    from ubatch.overlap import OverlapMode, apply_mode
    from ubatch.wrapper import UBatchWrapper

    config = ModelConfig(
        num_experts=8,
        top_k=2,
        hidden_size=128,
        moe_intermediate_size=128,
        num_shared_experts=1,
        dtype=torch.bfloat16,
        capacity_factor=2.0,
    )
    model = build_model(config, device="cuda")
    mode = OverlapMode.parse(mode_name)
    step, _ = make_step(model, [1] * 16, [9] * 16, block_size=4)
    expected = _forward(model, model, step).clone()
    apply_mode(model, mode)
    slices = split_batch([1] * 16, mode.num_ubatches) if mode.num_ubatches > 1 else None
    runnable = UBatchWrapper(model, num_ubatches=mode.num_ubatches) if slices else model
    with fusion.fused_glue():
        fused_eager = _forward(runnable, model, step, slices).clone()
        graphed = GraphedModel(
            model,
            max_blocks_per_req=8,
            capture_sizes=[16],
            ubatch_counts=(mode.num_ubatches,),
            modes=(CUDAGraphMode.FULL,),
        )
        graphed.capture()
    try:
        md = step.attn_metadata[model.layer_names[0]]
        assert graphed.plan(16, 16, 1, num_ubatches=mode.num_ubatches) is not None, "the capture failed"
        replayed = graphed.run(step.input_ids, step.positions, md, num_ubatches=mode.num_ubatches).clone()
    finally:
        graphed.release()
    torch.testing.assert_close(fused_eager, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(replayed, expected, atol=2e-2, rtol=2e-2)
