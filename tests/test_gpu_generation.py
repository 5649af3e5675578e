"""Greedy generation on CUDA in float32 equals naive full recompute token for token (the bf16
variant in test_runner.py can only bound near-ties)."""

import pytest
import torch

from tests.test_runner import naive_greedy, prompts_for
from ubatch.models import ModelConfig, build_model
from ubatch.runner import ModelRunner


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["small", "small-moe"])
def test_cuda_float32_greedy_equals_naive_recompute(preset):
    config = ModelConfig.preset(preset, dtype=torch.float32)
    model = build_model(config, device="cuda")
    prompts = prompts_for(config, (5, 70, 33, 128))
    runner = ModelRunner(model, config, device="cuda", num_kv_blocks=256, block_size=16,
                         max_num_batched_tokens=64)
    outputs = runner.generate(prompts, 12)
    assert outputs == [naive_greedy(model, p, 12) for p in prompts]
