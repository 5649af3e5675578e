"""Overlap modes on the GPU: single-batch overlap and expert pipelining replayed from FULL and
PIECEWISE graphs equal the plain eager step in the same expert groups, float32 (masked experts)
and bf16 (grouped GEMM; in other groups a token's experts are summed in other bf16 partial rows,
an ulp apart, which can flip a near-tie of the next layer's router: CPU tests compare groups in
float32);
splits with joined expert stages, eager and replayed from FULL graphs, over no link and over the
link stand-in (whose transfers really run on the copy engines), own rows first and token chunks
over the link, prompts of one length replayed from FULL graphs,
and a tensor-parallel dense model's chunked all-reduces over the link, equal the unsplit eager step.

Tolerance: float32 atol = rtol = 1e-4; bf16 atol = rtol = 2e-2 (expert groups change the
grouped GEMM's row blocking).
"""

import random

import pytest
import torch

from tests.test_gpu_cudagraph import BLOCK, MAX_BLOCKS, _decode_shapes, _mixed_shapes
from tests.test_ubatch_models import _forward
from ubatch import CUDAGraphMode, split_batch
from ubatch.bench.workload import make_step
from ubatch.graphed import GraphedModel
from ubatch.link import HostLink
from ubatch.models import ModelConfig, build_model
from ubatch.overlap import OverlapMode, apply_mode
from ubatch.wrapper import UBatchWrapper

CONFIGS = {
    "float32": (
        dict(num_experts=8, top_k=2, moe_intermediate_size=48, num_shared_experts=1),
        dict(atol=1e-4, rtol=1e-4),
    ),
    "bf16": (
        dict(
            num_experts=8,
            top_k=2,
            hidden_size=128,
            moe_intermediate_size=128,
            num_shared_experts=1,
            dtype=torch.bfloat16,
        ),
        dict(atol=2e-2, rtol=2e-2),
    ),
}


@pytest.mark.cuda
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE])
@pytest.mark.parametrize("dtype", list(CONFIGS))
def test_single_batch_overlap_replay_equals_plain_eager(dtype, mode, chunks):
    config, tol = CONFIGS[dtype]
    model = build_model(ModelConfig(**config), device="cuda")
    for layer in model.moe_layers.values():
        layer.expert_chunks = chunks
    _, cache = make_step(model, [1] * 64, [BLOCK * MAX_BLOCKS - 1] * 64, block_size=BLOCK)
    sizes = [8, 16] if mode == CUDAGraphMode.FULL else [32]
    graphed = GraphedModel(
        model, max_blocks_per_req=MAX_BLOCKS, capture_sizes=sizes, modes=(mode,), single_batch_overlap=True
    )
    graphed.capture()
    plain = GraphedModel(model, max_blocks_per_req=MAX_BLOCKS, capture_sizes=[], modes=(mode,))
    shapes = _decode_shapes if mode == CUDAGraphMode.FULL else _mixed_shapes
    rng = random.Random(chunks)
    try:
        for trial, (query_lens, context_lens) in enumerate(shapes(rng)):
            step, _ = make_step(model, query_lens, context_lens, block_size=BLOCK, cache=cache, seed=trial)
            md = step.attn_metadata[model.layer_names[0]]
            assert graphed.plan(md.num_actual_tokens, md.num_reqs, None if mode == CUDAGraphMode.PIECEWISE else 1)
            got = graphed.run(step.input_ids, step.positions, md).clone()
            expected = plain.eager(step.input_ids, step.positions, md)
            torch.testing.assert_close(got, expected, **tol)
    finally:
        graphed.release()


@pytest.mark.cuda
@pytest.mark.parametrize("link", [False, True])
@pytest.mark.parametrize("mode_name", ["split2+join", "split2+join+pipeline2", "split3+join+pipeline4"])
@pytest.mark.parametrize("dtype", list(CONFIGS))
def test_joined_experts_eager_and_full_replay_equal_unsplit(dtype, mode_name, link):
    _check_split_mode(dtype, mode_name, link)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "mode_name, graph_mode",
    [
        ("local", CUDAGraphMode.FULL),
        ("split2+local", CUDAGraphMode.FULL),
        ("split2+join+pipeline2+local", CUDAGraphMode.FULL),
        ("split2+local", CUDAGraphMode.PIECEWISE),
        ("pipeline2+local", CUDAGraphMode.PIECEWISE),
    ],
)
@pytest.mark.parametrize("dtype", list(CONFIGS))
def test_own_rows_first_eager_and_replayed_equal_unsplit(dtype, mode_name, graph_mode):
    """Over the link only: without peers every row is a rank's own and the mode changes nothing."""
    _check_split_mode(dtype, mode_name, link=True, graph_mode=graph_mode)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "mode_name, graph_mode, world_size",
    [
        ("tokens2", CUDAGraphMode.FULL, 2),
        ("split2+tokens2", CUDAGraphMode.FULL, 8),
        ("tokens4+local", CUDAGraphMode.FULL, 2),
        ("tokens2", CUDAGraphMode.PIECEWISE, 8),
        ("split2+tokens2+local", CUDAGraphMode.PIECEWISE, 2),
    ],
)
@pytest.mark.parametrize("dtype", list(CONFIGS))
def test_token_chunks_over_the_link_eager_and_replayed_equal_unsplit(dtype, mode_name, graph_mode, world_size):
    """Token chunks through the experts, with a split and own rows first, as one rank of two
    and of eight (one expert per rank, where only token chunks can pipeline)."""
    _check_split_mode(dtype, mode_name, link=True, graph_mode=graph_mode, world_size=world_size)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "mode_name, graph_mode, world_size",
    [
        ("pipeline2", CUDAGraphMode.FULL, 2),
        ("pipeline4", CUDAGraphMode.FULL, 2),
        ("split2+pipeline2", CUDAGraphMode.FULL, 2),
        ("pipeline2", CUDAGraphMode.PIECEWISE, 2),
        ("tokens4", CUDAGraphMode.FULL, 8),
    ],
)
@pytest.mark.parametrize("dtype", list(CONFIGS))
def test_expert_stages_on_two_lanes_over_the_link_equal_unsplit(dtype, mode_name, graph_mode, world_size):
    """Odd expert groups and token runs compute on a second stream that waits for their own
    dispatch only (``gemm_lanes``): over the link a wait it missed would read rows not yet landed."""
    _check_split_mode(dtype, mode_name, link=True, graph_mode=graph_mode, world_size=world_size)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "mode_name, world_size", [("split2", 2), ("split2+tokens2", 8), ("tokens2", 8), ("pipeline2", 2), ("overlap", 2)]
)
@pytest.mark.parametrize("dtype", list(CONFIGS))
def test_uniform_prompts_replayed_from_full_graphs_equal_unsplit(dtype, mode_name, world_size):
    """Prefill of prompts of one length over random contexts, from a FULL graph (``ubatch-bench
    --prefill-graphs full``): causal attention over every slot at the block table's width, masked by
    device-side lengths, must equal the eager step whatever the contexts."""
    _check_split_mode(dtype, mode_name, link=True, graph_mode=CUDAGraphMode.FULL, world_size=world_size, prefill=True)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "mode_name, graph_mode",
    [
        ("allreduce2", CUDAGraphMode.FULL),
        ("split2+allreduce2", CUDAGraphMode.FULL),
        ("allreduce4", CUDAGraphMode.PIECEWISE),
    ],
)
def test_chunked_all_reduce_over_the_link_eager_and_replayed_equal_unsplit(mode_name, graph_mode):
    link = HostLink(2, bandwidth_gbps=20.0)
    link.prepare("cuda")
    model = build_model(ModelConfig.preset("small", dtype=torch.float32), device="cuda", tp_group=link)
    _check_mode(model, CONFIGS["float32"][1], mode_name, graph_mode)


@pytest.mark.cuda
@pytest.mark.parametrize("mode_name", ["overlap", "split2", "split3+join"])
def test_modes_over_an_eight_rank_link_eager_and_replayed_equal_unsplit(mode_name):
    """A rank of eight holds one of the eight experts and sends seven blocks per collective."""
    _check_split_mode("float32", mode_name, link=True, world_size=8)


def _check_split_mode(
    dtype: str,
    mode_name: str,
    link: bool,
    graph_mode: CUDAGraphMode = CUDAGraphMode.FULL,
    world_size: int = 2,
    prefill: bool = False,
) -> None:
    config, tol = CONFIGS[dtype]
    ep_group = HostLink(world_size, bandwidth_gbps=20.0) if link else None
    if link:
        ep_group.prepare("cuda")
    model = build_model(ModelConfig(**config), device="cuda", ep_group=ep_group)
    _check_mode(model, tol, mode_name, graph_mode, prefill=prefill)


PROMPT = 8  # tokens of every prompt of a uniform prefill step


def _uniform_prefill_shapes(rng):
    """Four, three (padded to four) and four prompts of ``PROMPT`` tokens over random contexts."""
    return [([PROMPT] * n, [rng.randint(0, BLOCK * MAX_BLOCKS - PROMPT) for _ in range(n)]) for n in (4, 3, 4)]


def _replayable_sizes(shapes, graph_mode: CUDAGraphMode) -> list[int]:
    """Capture sizes that replay every shape, most of them padded, none leaving a ubatch of
    padding alone (such a step runs eagerly): FULL pads 5 and 7 decodes to 6 and 8 (N <= 3),
    PIECEWISE pads each shape by one token (N <= 2)."""
    if graph_mode == CUDAGraphMode.FULL:
        return [6, 8, 16]
    return sorted({sum(query_lens) + 1 for query_lens, _ in shapes})


def _check_mode(model, tol: dict, mode_name: str, graph_mode: CUDAGraphMode, prefill: bool = False) -> None:
    """``mode_name`` eager and replayed from ``graph_mode`` graphs equals the unsplit eager step
    (``prefill``: steps of uniform prompts, FULL graphs of four)."""
    mode = OverlapMode.parse(mode_name)
    _, cache = make_step(model, [1] * 64, [BLOCK * MAX_BLOCKS - 1] * 64, block_size=BLOCK)
    rng = random.Random(mode_name)
    if prefill:
        shapes, sizes, uniform = _uniform_prefill_shapes(rng), [4 * PROMPT], PROMPT
    else:
        shapes = (_decode_shapes if graph_mode == CUDAGraphMode.FULL else _mixed_shapes)(rng)
        sizes, uniform = _replayable_sizes(shapes, graph_mode), 1
    apply_mode(model, mode)
    graphed = GraphedModel(
        model,
        max_blocks_per_req=MAX_BLOCKS,
        capture_sizes=sizes,
        ubatch_counts=(mode.num_ubatches,),
        uniform_token_count=uniform,
        modes=(graph_mode,),
        single_batch_overlap=mode.num_ubatches == 1,
    )
    wrapper = UBatchWrapper(model, num_ubatches=mode.num_ubatches, device=model.device)
    graphed.capture()
    try:
        for trial, (query_lens, context_lens) in enumerate(shapes):
            step, _ = make_step(model, query_lens, context_lens, block_size=BLOCK, cache=cache, seed=trial)
            md = step.attn_metadata[model.layer_names[0]]
            apply_mode(model, mode)
            planned = uniform if graph_mode == CUDAGraphMode.FULL else None
            assert graphed.plan(md.num_actual_tokens, md.num_reqs, planned, num_ubatches=mode.num_ubatches)
            replayed = graphed.run(step.input_ids, step.positions, md, num_ubatches=mode.num_ubatches).clone()
            eager = _forward(wrapper, model, step, split_batch(query_lens, mode.num_ubatches)).clone()
            apply_mode(model, OverlapMode())
            expected = _forward(model, model, step)
            torch.testing.assert_close(eager, expected, **tol, msg=lambda m: f"{mode_name} eager: {m}")
            torch.testing.assert_close(replayed, expected, **tol, msg=lambda m: f"{mode_name} replayed: {m}")
    finally:
        graphed.release()
