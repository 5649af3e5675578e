"""CUDA graphs on the GPU: replay equals eager (FULL decode unsplit and ubatched, PIECEWISE
mixed and prefill), after the inputs change; PIECEWISE capture never runs attention on dummy
inputs; a failed capture leaves the process usable; FULL ubatched EP MoE over NCCL.

Tolerance on CUDA float32: atol = rtol = 1e-4.
"""

import logging
import random

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.test_cudagraph import SpyBackend
from tests.test_ubatch_models import MODELS
from ubatch import CUDAGraphMode
from ubatch.bench.workload import make_step
from ubatch.cudagraph import BatchExecutionDescriptor, CudaGraphManager
from ubatch.graphed import GraphedModel
from ubatch.models import ModelConfig, build_model
from ubatch.sm import SMPartition

TOL = dict(atol=1e-4, rtol=1e-4)
BLOCK, MAX_BLOCKS = 4, 8


def _check_steps(model, graphed, shapes, num_ubatches, expect_mode, cache, seed):
    rng = random.Random(seed)
    for trial, (query_lens, context_lens) in enumerate(shapes(rng)):
        step, _ = make_step(model, query_lens, context_lens, block_size=BLOCK, cache=cache, seed=seed + trial)
        md = step.attn_metadata[model.layer_names[0]]
        uniform = md.max_query_len if md.max_query_len * md.num_reqs == md.num_actual_tokens else None
        desc = graphed.manager.dispatch(
            md.num_actual_tokens, num_reqs=md.num_reqs, uniform_token_count=uniform, num_ubatches=num_ubatches
        )
        assert desc is not None and desc.cg_mode == expect_mode, desc
        got = graphed.run(step.input_ids, step.positions, md, num_ubatches=num_ubatches).clone()
        expected = graphed.eager(step.input_ids, step.positions, md)
        torch.testing.assert_close(got, expected, **TOL)


def _decode_shapes(rng):
    return [([1] * r, [rng.randint(1, BLOCK * MAX_BLOCKS - 1) for _ in range(r)]) for r in (8, 5, 7, 16)]


def _mixed_shapes(rng):
    out = []
    for _ in range(4):
        n = rng.randint(2, 5)
        out.append(([rng.randint(1, 6) for _ in range(n)], [rng.choice([0, rng.randint(1, 12)]) for _ in range(n)]))
    return out


def _graphed(model_kind, **kwargs):
    model = build_model(ModelConfig(**MODELS[model_kind]), device="cuda")
    _, cache = make_step(model, [1] * 64, [BLOCK * MAX_BLOCKS - 1] * 64, block_size=BLOCK)
    graphed = GraphedModel(model, max_blocks_per_req=MAX_BLOCKS, **kwargs)
    graphed.capture()
    return model, graphed, cache


@pytest.mark.cuda
@pytest.mark.parametrize("num_ubatches", [1, 2, 3, 4])
@pytest.mark.parametrize("model_kind", list(MODELS))
def test_full_decode_replay_equals_eager(model_kind, num_ubatches):
    model, graphed, cache = _graphed(
        model_kind, capture_sizes=[8, 16], ubatch_counts=(num_ubatches,), modes=(CUDAGraphMode.FULL,)
    )
    _check_steps(model, graphed, _decode_shapes, num_ubatches, CUDAGraphMode.FULL, cache, seed=num_ubatches)


@pytest.mark.cuda
def test_full_ubatched_replay_on_a_green_sm_partition_equals_eager():
    partition = SMPartition("green", 16, "cuda")
    model, graphed, cache = _graphed(
        "moe", capture_sizes=[8, 16], ubatch_counts=(2,), modes=(CUDAGraphMode.FULL,), sm_partition=partition
    )
    assert partition.effective_mode == "green", partition.reason
    _check_steps(model, graphed, _decode_shapes, 2, CUDAGraphMode.FULL, cache, seed=11)


@pytest.mark.cuda
@pytest.mark.parametrize("model_kind", list(MODELS))
def test_piecewise_replay_equals_eager_for_mixed_and_prefill(model_kind):
    model, graphed, cache = _graphed(model_kind, capture_sizes=[32], modes=(CUDAGraphMode.PIECEWISE,))
    _check_steps(model, graphed, _mixed_shapes, 1, CUDAGraphMode.PIECEWISE, cache, seed=7)


def _ubatchable_mixed_shapes(rng):
    out = []
    for _ in range(4):
        n = rng.randint(3, 5)
        out.append(([rng.randint(4, 6) for _ in range(n)], [rng.choice([0, rng.randint(1, 12)]) for _ in range(n)]))
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
@pytest.mark.parametrize("model_kind", list(MODELS))
def test_ubatched_piecewise_replay_equals_eager(model_kind, num_ubatches):
    model, graphed, cache = _graphed(
        model_kind, capture_sizes=[16, 32], ubatch_counts=(num_ubatches,), modes=(CUDAGraphMode.PIECEWISE,)
    )
    _check_steps(model, graphed, _ubatchable_mixed_shapes, num_ubatches, CUDAGraphMode.PIECEWISE, cache, seed=5)


@pytest.mark.cuda
def test_piecewise_capture_skips_attention_and_replay_runs_it():
    spy = SpyBackend(fail_on_dummy=True)
    model = build_model(ModelConfig(**MODELS["moe"]), device="cuda", attn_backend=spy)
    _, cache = make_step(model, [1] * 16, [12] * 16, block_size=BLOCK)
    graphed = GraphedModel(model, capture_sizes=[16], max_blocks_per_req=MAX_BLOCKS, modes=(CUDAGraphMode.PIECEWISE,))
    graphed.capture()
    assert spy.calls == 0
    step, _ = make_step(model, [3, 5], [4, 0], block_size=BLOCK, cache=cache)
    md = step.attn_metadata[model.layer_names[0]]
    graphed.run(step.input_ids, step.positions, md)
    assert spy.calls == model.config.num_layers


@pytest.mark.cuda
def test_failed_capture_leaves_the_process_usable(caplog):
    manager = CudaGraphManager(device="cuda")

    def create(desc):
        def forward_fn(mode):
            x = torch.randn(64, device="cuda")
            if mode == CUDAGraphMode.FULL:
                x.sum().item()  # a host sync inside a capture fails it
            return x * 2

        return forward_fn

    with caplog.at_level(logging.WARNING):
        manager.capture(create, [BatchExecutionDescriptor(CUDAGraphMode.FULL, 64, uniform_token_count=1)])
    assert not manager.graphs and "run eagerly" in caplog.text
    a = torch.randn(256, 256, device="cuda")
    torch.testing.assert_close(a @ a, (a.double() @ a.double()).float(), atol=1e-2, rtol=1e-3)
    manager.capture(
        lambda d: lambda mode: torch.ones(64, device="cuda") * 3,
        [BatchExecutionDescriptor(CUDAGraphMode.FULL, 32, uniform_token_count=1)],
    )
    assert torch.equal(
        manager.replay(BatchExecutionDescriptor(CUDAGraphMode.FULL, 32, uniform_token_count=1)),
        torch.full((64,), 3.0, device="cuda"),
    )


def _nccl_full_ubatched(rank, world_size):
    model = build_model(ModelConfig(**MODELS["moe"]), device=torch.device("cuda", rank), ep_group=dist.group.WORLD)
    _, cache = make_step(model, [1] * 16, [BLOCK * MAX_BLOCKS - 1] * 16, block_size=BLOCK, seed=rank)
    graphed = GraphedModel(
        model, capture_sizes=[8], max_blocks_per_req=MAX_BLOCKS, ubatch_counts=(1, 2), modes=(CUDAGraphMode.FULL,)
    )
    graphed.capture()
    rng = random.Random(0)  # same shapes on both ranks: EP needs equal token counts
    for n in (1, 2):
        for trial in range(3):
            query_lens, context_lens = [1] * 8, [rng.randint(1, 30) for _ in range(8)]
            step, _ = make_step(model, query_lens, context_lens, block_size=BLOCK, cache=cache, seed=100 * rank + trial)
            md = step.attn_metadata[model.layer_names[0]]
            got = graphed.run(step.input_ids, step.positions, md, num_ubatches=n).clone()
            expected = graphed.eager(step.input_ids, step.positions, md)
            torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.multigpu
def test_full_ubatched_ep_moe_two_gpus_nccl():
    run_distributed(_nccl_full_ubatched, 2, backend="nccl", timeout_s=300)
