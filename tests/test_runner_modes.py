"""A ModelRunner serving in an overlap mode (``overlap_mode=``) generates exactly what the plain
model's naive greedy recompute does, for every kind of mode; bad modes and data-parallel ranks
given different modes are refused with the offending values named (CPU, float32)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.test_runner import naive_greedy, prompts_for
from ubatch.models import ModelConfig, build_model
from ubatch.overlap import OverlapMode
from ubatch.runner import ModelRunner

RUNNER = dict(device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)


@pytest.fixture(scope="module")
def moe_and_reference():
    config = ModelConfig.preset("tiny-deepseek")
    model = build_model(config, device="cpu")
    prompts = prompts_for(config, (3, 17, 9, 1))
    return config, model, prompts, [naive_greedy(model, p, 5) for p in prompts]


@pytest.mark.parametrize(
    "mode", ["overlap", "pipeline2", "split2", "split2+join", "split3+join+pipeline2", "split2@green8"]
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
        assert runner.generate(prompts, 5) == reference
    finally:
        ModelRunner(model, config, **RUNNER)  # the plain runner puts the model back to unsplit


def test_a_bad_overlap_mode_is_refused_naming_it():
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    with pytest.raises(ValueError, match="mode pipeline2 needs a MoE model"):
        ModelRunner(model, config, overlap_mode="pipeline2", **RUNNER)
    with pytest.raises(ValueError, match="num_ubatches=3 disagrees with overlap_mode=split2"):
        ModelRunner(model, config, overlap_mode="split2", num_ubatches=3, **RUNNER)
    with pytest.raises(ValueError, match="unknown overlap mode 'fast'"):
        ModelRunner(model, config, overlap_mode="fast", **RUNNER)
    with pytest.raises(TypeError, match="overlap_mode must be an OverlapMode, its name or None, got int"):
        ModelRunner(model, config, overlap_mode=2, **RUNNER)
    assert ModelRunner(model, config, overlap_mode="split2", num_ubatches=2, **RUNNER).num_ubatches == 2


def _ranks_in_different_modes(rank: int, world: int) -> None:
    config = ModelConfig.preset("tiny-deepseek")
    model = build_model(config, device="cpu", ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="same overlap_mode .* rank 0: pipeline2, rank 1: split2"):
        ModelRunner(model, config, dp_group=dist.group.WORLD, overlap_mode=["pipeline2", "split2"][rank], **RUNNER)


def test_data_parallel_ranks_in_different_modes_are_refused_on_every_rank():
    run_distributed(_ranks_in_different_modes, 2)
