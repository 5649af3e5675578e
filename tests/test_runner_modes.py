"""A ModelRunner serving in an overlap mode (``overlap_mode=``), or in the mode a ModePolicy picks
per step, generates exactly what the plain model's naive greedy recompute does, expert- and
tensor-parallel ranks too; data-parallel ranks pick the same mode every step; bad modes, and
ranks given different modes or policies, are refused with the offending values named (CPU,
float32)."""

from __future__ import annotations

import weakref

import pytest
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.test_runner import naive_greedy, prompts_for
from ubatch.models import ModelConfig, build_model
from ubatch.overlap import OverlapMode, tensor_parallel_projections
from ubatch.policy import ModePolicy
from ubatch.runner import ModelRunner

RUNNER = dict(device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)


@pytest.fixture(scope="module")
def moe_and_reference():
    config = ModelConfig.preset("tiny-deepseek")
    model = build_model(config, device="cpu")
    prompts = prompts_for(config, (3, 17, 9, 1))
    return config, model, prompts, [naive_greedy(model, p, 5) for p in prompts]


@pytest.mark.parametrize(
    "mode",
    ["overlap", "pipeline2", "split2", "split2+join", "split3+join+pipeline2", "split2@green8", "split2+tokens2"],
)
def test_generation_in_every_overlap_mode_equals_naive_recompute(moe_and_reference, mode):
    config, model, prompts, reference = moe_and_reference
    runner = ModelRunner(model, config, overlap_mode=mode, **RUNNER)
    try:
        assert (
            runner.overlap_mode == OverlapMode.parse(mode) and runner.num_ubatches == runner.overlap_mode.num_ubatches
        )
        layers = list(model.moe_layers.values())
        assert all(layer.expert_chunks == runner.overlap_mode.expert_chunks for layer in layers)
        assert all(layer.join_ubatches == runner.overlap_mode.join_experts for layer in layers)
        assert all(layer.token_chunks == runner.overlap_mode.token_chunks for layer in layers)
        assert runner.generate(prompts, 5) == reference
    finally:
        ModelRunner(model, config, **RUNNER)  # the plain runner puts the model back to unsplit


def test_a_bad_overlap_mode_is_refused_naming_it():
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    with pytest.raises(ValueError, match="mode pipeline2 needs a MoE model"):
        ModelRunner(model, config, overlap_mode="pipeline2", **RUNNER)
    with pytest.raises(ValueError, match="mode tokens2 needs a MoE model"):
        ModelRunner(model, config, overlap_mode="tokens2", **RUNNER)
    with pytest.raises(ValueError, match="num_ubatches=3 disagrees with overlap_mode=split2"):
        ModelRunner(model, config, overlap_mode="split2", num_ubatches=3, **RUNNER)
    with pytest.raises(ValueError, match="unknown overlap mode 'fast'"):
        ModelRunner(model, config, overlap_mode="fast", **RUNNER)
    with pytest.raises(TypeError, match="overlap_mode must be an OverlapMode, its name, a ModePolicy or None, got int"):
        ModelRunner(model, config, overlap_mode=2, **RUNNER)
    assert ModelRunner(model, config, overlap_mode="split2", num_ubatches=2, **RUNNER).num_ubatches == 2


def _ranks_in_different_modes(rank: int, world: int) -> None:
    config = ModelConfig.preset("tiny-deepseek")
    model = build_model(config, device="cpu", ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="same overlap_mode .* rank 0: pipeline2, rank 1: split2"):
        ModelRunner(model, config, dp_group=dist.group.WORLD, overlap_mode=["pipeline2", "split2"][rank], **RUNNER)


def test_data_parallel_ranks_in_different_modes_are_refused_on_every_rank():
    run_distributed(_ranks_in_different_modes, 2)


POLICY = ModePolicy(
    {
        "unsplit": {1: 10.0, 64: 10.0},
        "pipeline2": {1: 5.0, 64: 50.0},  # the fastest below 8 tokens
        "split2+join": {1: 50.0, 64: 5.0},  # the fastest above 57
    }
)


def _modes_of_every_step(runner: ModelRunner) -> list[str]:
    modes: list[str] = []
    step = type(runner).step
    owner = weakref.ref(runner)  # a strong reference would make a cycle that holds the process groups

    def recording():
        out = step(owner())
        modes.append(out.overlap_mode)
        return out

    runner.step = recording
    return modes


def test_a_mode_policy_serves_each_step_in_the_mode_it_picks(moe_and_reference):
    config, model, _, _ = moe_and_reference
    prompts = prompts_for(config, (40, 3, 50, 9))
    reference = [naive_greedy(model, p, 4) for p in prompts]
    runner = ModelRunner(model, config, overlap_mode=POLICY, **dict(RUNNER, max_num_batched_tokens=64))
    try:
        modes = _modes_of_every_step(runner)
        assert runner.generate(prompts, 4) == reference
        assert {"pipeline2", "split2+join"} <= set(modes[:-1]), modes  # a 64-token prefill step, small decodes
        assert modes[0] == "split2+join" and modes[-2] == "pipeline2"
    finally:
        ModelRunner(model, config, **RUNNER)


def test_a_mode_policy_is_refused_with_a_ubatch_count_or_a_split_policy():
    config = ModelConfig.preset("tiny-deepseek")
    model = build_model(config, device="cpu")
    with pytest.raises(ValueError, match="num_ubatches=2 with a mode policy"):
        ModelRunner(model, config, overlap_mode=POLICY, num_ubatches=2, **RUNNER)
    split = ModePolicy({"unsplit": {1: 1.0}})
    with pytest.raises(ValueError, match="give a split_policy or a mode policy"):
        ModelRunner(model, config, overlap_mode=POLICY, split_policy=split, **RUNNER)
    with pytest.raises(ValueError, match="mode pipeline2 needs a MoE model"):
        ModelRunner(build_model(ModelConfig.preset("tiny"), device="cpu"), config, overlap_mode=POLICY, **RUNNER)


def _ranks_under_one_policy(rank: int, world: int) -> None:
    """Expert-parallel over two ranks with loads that differ per rank: every step both ranks pick
    the same mode (from the larger token count), and generate what one process holding every
    request does."""
    config = ModelConfig.preset("tiny-deepseek")
    options = dict(RUNNER, max_num_batched_tokens=64)
    reference_runner = ModelRunner(build_model(config, device="cpu"), config, **dict(options, num_kv_blocks=128))
    prompts = [prompts_for(config, (40, 30), seed=0), prompts_for(config, (5,), seed=1)]  # 64 tokens first
    reference = reference_runner.generate(sum(prompts, []), 4)
    runner = ModelRunner(
        build_model(config, device="cpu", ep_group=dist.group.WORLD),
        config,
        dp_group=dist.group.WORLD,
        overlap_mode=POLICY,
        **options,
    )
    modes = _modes_of_every_step(runner)
    first = sum(len(p) for p in prompts[:rank])
    assert runner.generate(prompts[rank], 4) == reference[first : first + len(prompts[rank])]
    every = [None] * world
    dist.all_gather_object(every, modes)
    assert every[0] == every[1] and {"pipeline2", "split2+join"} <= set(modes), every


def test_data_parallel_ranks_pick_the_same_mode_every_step():
    run_distributed(_ranks_under_one_policy, 2)


def _ranks_with_different_policies(rank: int, world: int) -> None:
    config = ModelConfig.preset("tiny-deepseek")
    model = build_model(config, device="cpu", ep_group=dist.group.WORLD)
    policy = POLICY if rank == 0 else ModePolicy({"unsplit": {1: 1.0}, "pipeline2": {1: 2.0}})
    with pytest.raises(ValueError, match="same overlap_mode .* rank 0: a mode policy over unsplit,pipeline2,split2"):
        ModelRunner(model, config, dp_group=dist.group.WORLD, overlap_mode=policy, **RUNNER)


def test_data_parallel_ranks_with_different_mode_policies_are_refused():
    run_distributed(_ranks_with_different_policies, 2)


def _ranks_in_one_mode(rank: int, world: int, mode: str) -> None:
    """Expert-parallel over two ranks in a mode whose effect needs peers (own rows first): each
    rank generates what one process holding every request does."""
    config = ModelConfig.preset("tiny-deepseek")
    options = dict(RUNNER, max_num_batched_tokens=64)
    reference_runner = ModelRunner(build_model(config, device="cpu"), config, **dict(options, num_kv_blocks=128))
    prompts = [prompts_for(config, (20, 7), seed=0), prompts_for(config, (11,), seed=1)]
    reference = reference_runner.generate(sum(prompts, []), 4)
    model = build_model(config, device="cpu", ep_group=dist.group.WORLD)
    runner = ModelRunner(model, config, dp_group=dist.group.WORLD, overlap_mode=mode, **options)
    assert all(layer.local_first for layer in model.moe_layers.values())
    first = sum(len(p) for p in prompts[:rank])
    assert runner.generate(prompts[rank], 4) == reference[first : first + len(prompts[rank])]


@pytest.mark.parametrize("mode", ["split2+local", "pipeline2+local"])
def test_expert_parallel_ranks_serving_own_rows_first_equal_one_process(mode):
    run_distributed(_ranks_in_one_mode, 2, mode)


def _tensor_parallel_ranks_in_one_mode(rank: int, world: int, mode: str) -> None:
    """Tensor-parallel over two ranks (one batch, each rank half the heads and MLP columns) in a
    chunked all-reduce mode: both ranks generate what the unsharded model's greedy recompute does."""
    config = ModelConfig.preset("tiny")
    prompts = prompts_for(config, (13, 4, 9))
    reference = [naive_greedy(build_model(config, device="cpu"), p, 4) for p in prompts]
    model = build_model(config, device="cpu", tp_group=dist.group.WORLD)
    runner = ModelRunner(model, config, overlap_mode=mode, **RUNNER)
    chunks = OverlapMode.parse(mode).all_reduce_chunks
    assert [m.all_reduce_chunks for m in tensor_parallel_projections(model)] == [chunks] * 2 * config.num_layers
    assert runner.generate(prompts, 4) == reference


@pytest.mark.parametrize("mode", ["allreduce2", "split2+allreduce2"])
def test_tensor_parallel_ranks_serving_chunked_all_reduces_equal_recompute(mode):
    run_distributed(_tensor_parallel_ranks_in_one_mode, 2, mode)
