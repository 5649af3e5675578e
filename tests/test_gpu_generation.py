"""Greedy generation on CUDA in float32 equals naive full recompute token for token (the bf16
variant in test_runner.py can only bound near-ties)."""

import pytest
import torch

from tests.test_runner import naive_greedy, prompts_for
from ubatch import CUDAGraphMode
from ubatch.models import ModelConfig, build_model
from ubatch.policy import ModePolicy
from ubatch.runner import ModelRunner


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["small", "small-moe"])
def test_cuda_float32_greedy_equals_naive_recompute(preset):
    config = ModelConfig.preset(preset, dtype=torch.float32)
    model = build_model(config, device="cuda")
    prompts = prompts_for(config, (5, 70, 33, 128))
    runner = ModelRunner(model, config, device="cuda", num_kv_blocks=256, block_size=16, max_num_batched_tokens=64)
    outputs = runner.generate(prompts, 12)
    assert outputs == [naive_greedy(model, p, 12) for p in prompts]


def _graph_runner(model, config, **kwargs) -> ModelRunner:
    """A runner with graphs captured at 4-64 tokens."""
    runner = ModelRunner(
        model,
        config,
        device="cuda",
        num_kv_blocks=256,
        block_size=16,
        max_num_batched_tokens=64,
        cudagraph_capture_sizes=[4, 8, 16, 32, 64],
        max_model_len=256,
        **kwargs,
    )
    runner.capture_graphs()
    return runner


def _record_replays(graphs) -> list:
    """The descriptors ``graphs`` replays from now on, in order."""
    replayed = []
    replay = graphs.replay
    graphs.replay = lambda desc, *args: replayed.append(desc) or replay(desc, *args)
    return replayed


@pytest.mark.cuda
@pytest.mark.parametrize("num_ubatches", [1, 2])
@pytest.mark.parametrize("preset", ["small", "small-moe"])
def test_cuda_graph_runner_generation_equals_naive_recompute(preset, num_ubatches):
    config = ModelConfig.preset(preset, dtype=torch.float32)
    model = build_model(config, device="cuda")
    prompts = prompts_for(config, (5, 70, 33, 128))
    runner = _graph_runner(model, config, num_ubatches=num_ubatches)
    replayed = _record_replays(runner.graphs)
    assert runner.generate(prompts, 12) == [naive_greedy(model, p, 12) for p in prompts]
    for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
        assert any(d.cg_mode == mode and d.num_ubatches == num_ubatches for d in replayed), (mode, replayed)
    runner.close()
    replayed.clear()
    assert runner.generate(prompts, 3) == [naive_greedy(model, p, 3) for p in prompts]
    assert not replayed, "a closed runner runs eagerly"


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["overlap", "pipeline2", "split2+join"])
def test_cuda_graph_runner_in_an_overlap_mode_equals_naive_recompute(mode):
    """FULL decode graphs captured in the mode replay (joined experts run eagerly where a
    PIECEWISE capture refuses them)."""
    config = ModelConfig.preset("small-moe", dtype=torch.float32)
    model = build_model(config, device="cuda")
    prompts = prompts_for(config, (5, 70, 33, 128))
    runner = _graph_runner(model, config, overlap_mode=mode)
    replayed = _record_replays(runner.graphs)
    try:
        assert runner.generate(prompts, 12) == [naive_greedy(model, p, 12) for p in prompts]
        assert any(d.cg_mode == CUDAGraphMode.FULL for d in replayed), replayed
    finally:
        runner.close()


@pytest.mark.cuda
def test_cuda_graph_runner_under_a_mode_policy_equals_naive_recompute():
    """Each mode captures graphs of its own; decode steps (few tokens) replay pipeline2's, the
    large prefill steps split2's (PIECEWISE)."""
    config = ModelConfig.preset("small-moe", dtype=torch.float32)
    model = build_model(config, device="cuda")
    prompts = prompts_for(config, (5, 70, 33, 128))
    policy = ModePolicy({"unsplit": {1: 10.0, 64: 10.0}, "pipeline2": {1: 5.0, 64: 50.0}, "split2": {1: 50.0, 64: 5.0}})
    runner = _graph_runner(model, config, overlap_mode=policy)
    per_mode = [_record_replays(serving.graphs) for serving in runner._serving.values()]
    try:
        assert runner.generate(prompts, 12) == [naive_greedy(model, p, 12) for p in prompts]
        assert any(d.cg_mode == CUDAGraphMode.FULL for replayed in per_mode for d in replayed), per_mode
    finally:
        runner.close()
