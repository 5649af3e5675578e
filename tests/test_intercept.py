"""Collectives a model issues itself (torch.distributed, functional collectives) overlap
inside ubatches: the wrapped model equals the unwrapped one, and its layers run interleaved
across ubatches, which only happens if every collective yielded. Outside a ubatched call
nothing is intercepted."""

import gc
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed import all_reduce as bound_all_reduce  # bound before any interception
from torch.overrides import _get_current_function_mode_stack

from tests.dist_utils import run_distributed
from ubatch import UBatchWrapper, comm, current_ubatch_id, set_forward_context, split_batch
from ubatch.intercept import CollectiveInterceptor
from ubatch.scheduler import UBatchScheduler
from ubatch.teardown import import_before_init

# Spawned ranks import this module before init_process_group. Functional collectives import
# torch.distributed.nn lazily, which would pin the default group for the life of the process
# (ubatch.teardown): import it first.
import_before_init()

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, FFN, ROWS = 16, 32, 6
TOL = dict(rtol=1e-5, atol=1e-5)  # float32; TP and EP only change the order of the sums


def _run_split(wrapped, x, n, **kwargs):
    """Input rows (dim 0) as the split unit."""
    with set_forward_context(None, ubatch_slices=split_batch([1] * x.shape[0], n)):
        return wrapped(x, **kwargs)


def _record_order(layers):
    order = []
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda _m, _a, index=index: order.append((current_ubatch_id(), index)))
    return order


def _interleaved(n, num_layers):
    return [(u, layer) for layer in range(num_layers) for u in range(n)]


def _load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- (a) a plain tensor-parallel module, its sum over ranks written in each way a model may -----------


def _sum_all_reduce(p, world):
    dist.all_reduce(p)
    return p


def _sum_bound_all_reduce(p, world):
    bound_all_reduce(p)
    return p


def _sum_async_all_reduce(p, world):
    work = dist.all_reduce(p, async_op=True)
    work.wait()
    return p


def _sum_reduce_scatter_all_gather(p, world):
    flat = p.reshape(-1)
    part = flat.new_empty(flat.numel() // world)
    dist.reduce_scatter_tensor(part, flat)
    out = torch.empty_like(flat)
    dist.all_gather_into_tensor(out, part)
    return out.view_as(p)


def _sum_functional_all_reduce(p, world):
    return funcol.all_reduce(p, "sum", dist.group.WORLD) * 1  # used: the async tensor is waited


def _sum_functional_reduce_scatter_all_gather(p, world):
    reduce_scatter = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)
    all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
    part = reduce_scatter(p.reshape(-1), "sum", 0, dist.group.WORLD)
    return all_gather(part, 0, dist.group.WORLD).view_as(p) * 1


C10D_SUMS = [_sum_all_reduce, _sum_bound_all_reduce, _sum_async_all_reduce, _sum_reduce_scatter_all_gather]
FUNCTIONAL_SUMS = [_sum_functional_all_reduce, _sum_functional_reduce_scatter_all_gather]


class _TPLayer(nn.Module):
    def __init__(self, up, down, rank, world, reduce):
        super().__init__()
        cols = slice(rank * FFN // world, (rank + 1) * FFN // world)
        self.up, self.down = nn.Parameter(up[cols].clone()), nn.Parameter(down[:, cols].clone())
        self.world, self.reduce = world, reduce

    def forward(self, x):
        return x + self.reduce(F.linear(F.gelu(F.linear(x, self.up)), self.down), self.world)


def _tp_weights(num_layers):
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(FFN, HIDDEN, generator=gen), torch.randn(HIDDEN, FFN, generator=gen) / FFN)
        for _ in range(num_layers)
    ]


def _dense(x, weights):
    for up, down in weights:
        x = x + F.linear(F.gelu(F.linear(x, up)), down)
    return x


def _tp_module_overlaps(rank, world, sums, device_type="cpu"):
    _check_tp_module(rank, world, sums, device_type)
    _free_cycles()


def _check_tp_module(rank, world, sums, device_type):
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    weights = _tp_weights(len(sums))
    model = nn.Sequential(*[_TPLayer(up, down, rank, world, s) for (up, down), s in zip(weights, sums)]).to(device)
    order = _record_order(model)
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(expected, _dense(x, [(u.to(device), d.to(device)) for u, d in weights]), **TOL)
        for n in (2, 3):
            order.clear()
            got = _run_split(UBatchWrapper(model, num_ubatches=n, device=device), x, n)
            torch.testing.assert_close(got, expected, **TOL)
            assert order == _interleaved(n, len(sums)), order
    # a ubatch that yielded inside an autograd Function (DTensor's redistribute) leaves forward AD as it was
    assert torch._C._is_fwd_grad_enabled()


def _free_cycles():
    """Let go of what torch keeps of the process group, before the teardown check that no group
    outlives ``destroy_process_group``: DTensor's global redistribute-planner cache holds each
    DeviceMesh (and so its group) it planned for, unwrapped use too."""
    from torch.distributed.tensor import _redistribute

    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    gc.collect()


def test_torch_distributed_collectives_of_a_plain_module_overlap():
    run_distributed(_tp_module_overlaps, 2, C10D_SUMS)


def test_functional_collectives_and_dtensor_redistribute_overlap():
    run_distributed(_tp_module_overlaps, 2, FUNCTIONAL_SUMS)


@pytest.mark.multigpu
def test_intercepted_collectives_overlap_over_nccl():
    run_distributed(_tp_module_overlaps, 2, C10D_SUMS[:3] + FUNCTIONAL_SUMS, "cuda", backend="nccl")


# -- how often and where a ubatch yields --------------------------------------------------------------


def _yields_once_per_collective(rank, world):
    yields = []
    original = UBatchScheduler._yield_from

    def counting(self, state):
        yields.append(state.ubatch_id)
        original(self, state)

    UBatchScheduler._yield_from = counting
    events = []

    def explicit(x):
        comm.all_reduce(x)  # ubatch.comm's own torch.distributed call is not intercepted again
        return x

    def issued_async(x):
        work = dist.all_reduce(x, async_op=True)
        events.append((current_ubatch_id(), "issued"))
        work.wait()  # the yield is here, where the result is needed
        events.append((current_ubatch_id(), "waited"))
        assert work.wait() and work.is_completed()  # waiting again is free
        return x

    def broadcast(x):
        dist.broadcast(x, src=0)  # not intercepted: a plain blocking call, no yield
        return x

    x = torch.full((4, 2), float(rank + 1))
    for fn, per_ubatch, expected in [
        (explicit, 1, 3.0),
        (bound_all_reduce_fn, 1, 3.0),
        (issued_async, 1, 3.0),
        (functional, 1, 3.0),
        (broadcast, 0, 1.0),
    ]:
        yields.clear()
        events.clear()
        got = _run_split(UBatchWrapper(fn, num_ubatches=2, device="cpu"), x.clone(), 2)
        torch.testing.assert_close(got, torch.full((4, 2), expected))
        assert sorted(yields) == sorted([0, 1] * per_ubatch), (fn.__name__, yields)
    events.clear()
    _run_split(UBatchWrapper(issued_async, num_ubatches=2, device="cpu"), x.clone(), 2)
    assert events == [(0, "issued"), (1, "issued"), (0, "waited"), (1, "waited")]
    _free_cycles()


def bound_all_reduce_fn(x):
    bound_all_reduce(x)
    return x


def functional(x):
    return funcol.all_reduce(x, "sum", dist.group.WORLD) * 1


def test_each_collective_yields_once_and_async_ones_at_wait():
    run_distributed(_yields_once_per_collective, 2)


# -- outside a ubatched call nothing changes --------------------------------------------------------


def test_nothing_is_intercepted_outside_a_ubatched_call():
    packet = torch.ops._c10d_functional.all_reduce
    seen = []

    def task(x):
        seen.append(
            (
                torch.ops._c10d_functional.all_reduce is packet,
                any(isinstance(m, CollectiveInterceptor) for m in _get_current_function_mode_stack()),
            )
        )
        return x

    def failing(x):
        raise KeyError("boom")

    x = torch.ones(4, 2)
    assert _run_split(UBatchWrapper(task, num_ubatches=2, device="cpu"), x, 2).equal(x)
    assert seen == [(False, True), (False, True)]
    with pytest.raises(KeyError, match="boom"):
        _run_split(UBatchWrapper(failing, num_ubatches=2, device="cpu"), x, 2)
    assert torch.ops._c10d_functional.all_reduce is packet
    assert _get_current_function_mode_stack() == []
    assert UBatchWrapper(task, num_ubatches=2, device="cpu")(x).equal(x)  # no slices: a direct call
    assert seen[-1] == (True, False)


class _SumInsideAFunction(torch.autograd.Function):
    """A collective inside an autograd Function's forward, as DTensor's redistribute issues it."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x


def _forward_ad_restored(rank, world):
    wrapped = UBatchWrapper(lambda x: _SumInsideAFunction.apply(x), num_ubatches=2, device="cpu")
    x = torch.ones(4, 2)
    assert _run_split(wrapped, x.clone(), 2).equal(x)
    assert torch._C._is_fwd_grad_enabled()


def test_forward_ad_is_restored_after_ubatches_yield_inside_autograd_functions():
    # a spawned rank: a process group created and destroyed in the pytest process made a later
    # test's torch._C._get_sm_carveout_experimental() crash
    run_distributed(_forward_ad_restored, 1)


def test_a_collective_without_a_process_group_raises_as_it_does_outside():
    assert not dist.is_initialized()

    def task(x):
        dist.all_reduce(x)
        return x

    with pytest.raises(ValueError, match="process group"):
        dist.all_reduce(torch.ones(2))
    with pytest.raises(ValueError, match="process group"):
        _run_split(UBatchWrapper(task, num_ubatches=2, device="cpu"), torch.ones(4, 2), 2)


# -- (b) user expert-parallel code calling all_to_all_single ------------------------------------------


def _expert_parallel_overlaps(rank, world):
    example = _load_example("expert_parallel")
    model = example.build_model(rank, world).eval()
    order = _record_order(model)
    x = torch.randn(8, example.HIDDEN, generator=torch.Generator().manual_seed(1 + rank))
    with torch.no_grad():
        expected = model(x)
        for n in (2, 3):
            order.clear()
            got = _run_split(UBatchWrapper(model, num_ubatches=n, device="cpu"), x, n)
            torch.testing.assert_close(got, expected, **TOL)
            assert order == _interleaved(n, example.LAYERS), order


def test_user_expert_parallel_all_to_all_overlaps():
    run_distributed(_expert_parallel_overlaps, 2)


# DTensor's redistribute, and (d) a transformers Llama loaded with tp_plan="auto", run as
# examples/transformers_tp.py under torchrun (tests/test_examples.py): a DeviceMesh keeps the default
# group referenced past destroy_process_group, which the teardown check of these spawned ranks refuses.
