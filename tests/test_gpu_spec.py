"""Speculative decoding on CUDA in float32: output equals plain greedy decoding of the target
token for token (dense and MoE, k = 1..4, ubatched verification or not), eager and with graphs;
with graphs the target replays FULL verification graphs keyed on k + 1 tokens per request and
the drafter replays graphs of its own (FULL draft steps and catch-ups after a verification,
PIECEWISE catch-ups of prompts)."""

import pytest
import torch

from tests.test_runner import prompts_for
from ubatch import CUDAGraphMode
from ubatch.models import ModelConfig, build_model
from ubatch.runner import ModelRunner

FULL, PIECEWISE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE
RUNNER = dict(device="cuda", num_kv_blocks=256, block_size=16, max_num_batched_tokens=64)
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["small", "small-moe"])
def target(request):
    config = ModelConfig.preset(request.param, dtype=torch.float32)
    model = build_model(config, device="cuda")
    prompts = prompts_for(config, (5, 70, 33, 128))
    return config, model, prompts, ModelRunner(model, config, **RUNNER).generate(prompts, MAX_NEW_TOKENS)


def _recording(graphed):
    replayed = []
    replay = graphed.replay
    graphed.replay = lambda desc, *args: replayed.append(desc) or replay(desc, *args)
    return replayed


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("num_ubatches", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_generation_equals_plain_greedy(target, k, num_ubatches, graphs):
    config, model, prompts, reference = target
    draft = build_model(config.replace(num_layers=1), device="cuda")  # same seed: the target's first layer
    graph_args = dict(cudagraph_capture_sizes=[4, 8, 16, 32, 64], max_model_len=256) if graphs else {}
    runner = ModelRunner(
        model, config, **RUNNER, num_ubatches=num_ubatches, draft_model=draft, num_speculative_tokens=k, **graph_args
    )
    if graphs:
        runner.capture_graphs()
        target_replays, draft_replays = _recording(runner.graphs), _recording(runner.drafter.graphs)
    assert runner.generate(prompts, MAX_NEW_TOKENS) == reference
    assert runner.spec_stats.num_draft_tokens > 0 and runner.spec_stats.acceptance_rate < 1.0
    if graphs:
        verify = [d for d in target_replays if d.cg_mode == FULL]
        assert verify and all(d.uniform_token_count == k + 1 for d in verify), target_replays
        assert any(d.num_ubatches == num_ubatches for d in verify), target_replays
        assert {d.cg_mode for d in draft_replays} == {FULL, PIECEWISE}, draft_replays
        assert any(d.cg_mode == FULL and d.uniform_token_count == k + 1 for d in draft_replays), (
            "catch-ups after a verification are padded to k + 1 tokens and replay FULL"
        )
        runner.close()
        assert runner.graphs.plan(4, 4, 1) is None and runner.drafter.graphs.plan(4, 4, 1) is None


@pytest.mark.cuda
@pytest.mark.parametrize("num_ubatches", [1, 2])
def test_self_drafter_with_graphs_accepts_everything(target, num_ubatches):
    """The target drafting for itself: two graph managers over one model. Acceptance is 1.0 up
    to float32 rounding that differs between batch shapes (a near-tie may flip a draft)."""
    config, model, prompts, reference = target
    runner = ModelRunner(
        model,
        config,
        **RUNNER,
        num_ubatches=num_ubatches,
        draft_model=model,
        num_speculative_tokens=3,
        cudagraph_capture_sizes=[4, 8, 16, 32, 64],
        max_model_len=256,
    )
    runner.capture_graphs()
    assert runner.generate(prompts, MAX_NEW_TOKENS) == reference
    assert runner.spec_stats.acceptance_rate > 0.9
    runner.close()
