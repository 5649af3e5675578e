"""ModelRunner: greedy generation equals naive full recompute (chunked prefill, mixed steps,
preemption), MoE overflow is loud, and bad input is rejected without losing other requests."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.reference import forward_sequences
from ubatch.models import ModelConfig, build_model
from ubatch.runner import Chunk, ModelRunner

PROMPT_LENGTHS = (3, 17, 40, 9, 1)


def prompts_for(config: ModelConfig, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def naive_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Re-run the whole sequence with a fresh cache every step and take the argmax."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        hidden = forward_sequences(model, [tokens], block_size=4)
        with torch.inference_mode():
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return tokens[len(prompt) :]


def record_schedules(runner: ModelRunner) -> list[list[tuple[bool, int, int]]]:
    """Wrap the runner's scheduler to keep (is decode, start, num tokens) of every chunk."""
    steps: list[list[tuple[bool, int, int]]] = []
    schedule = runner.schedule

    def recording() -> list[Chunk]:
        chunks = schedule()
        steps.append([(c.request.is_decoding, c.start, c.num_tokens) for c in chunks])
        return chunks

    runner.schedule = recording
    return steps


@pytest.fixture(scope="module", params=["tiny", "tiny-moe", "tiny-moe-shared"])
def model_and_reference(request):
    config = ModelConfig.preset(request.param)
    model = build_model(config, device="cpu")
    prompts = prompts_for(config)
    reference = [naive_greedy(model, p, 6) for p in prompts]
    return config, model, prompts, reference


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_matches_naive_recompute(model_and_reference, block_size):
    config, model, prompts, reference = model_and_reference
    runner = ModelRunner(
        model, config, device="cpu", num_kv_blocks=64, block_size=block_size, max_num_batched_tokens=16, max_num_seqs=8
    )
    steps = record_schedules(runner)
    assert runner.generate(prompts, 6) == reference
    # The small budget forced chunked-prefill continuations and steps mixing decode and prefill.
    assert any(not decoding and start > 0 for step in steps for decoding, start, _ in step)
    assert any({d for d, _, _ in step} == {True, False} for step in steps)
    assert runner.block_pool.num_free == 64


def test_preemption_by_recompute_keeps_outputs(model_and_reference, caplog):
    config, model, prompts, reference = model_and_reference
    # 12 blocks of 4 hold the longest request (40 + 6 tokens) alone, not all of them together.
    runner = ModelRunner(model, config, device="cpu", num_kv_blocks=12, block_size=4, max_num_batched_tokens=16)
    with caplog.at_level(logging.INFO, logger="ubatch.runner"):
        assert runner.generate(prompts, 6) == reference
    assert "preempting request" in caplog.text
    assert runner.block_pool.num_free == 12


def test_step_api_and_per_request_limits():
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    runner = ModelRunner(model, config, device="cpu", num_kv_blocks=32, block_size=4)
    first = runner.add_request([1, 2, 3], max_new_tokens=1)
    second = runner.add_request([4, 5], max_new_tokens=3)
    out = runner.step()
    assert set(out.new_tokens) == {first, second}
    assert out.finished == {first: [out.new_tokens[first]]}
    while runner.has_unfinished_requests():
        out = runner.step()
    assert len(out.finished[second]) == 3
    assert runner.step().new_tokens == {}
    assert [len(o) for o in runner.generate([[7], [8, 9]], [2, 5])] == [2, 5]


def test_warmup_leaves_the_runner_idle_and_its_outputs_unchanged(model_and_reference):
    config, model, prompts, reference = model_and_reference
    runner = ModelRunner(model, config, device="cpu", num_kv_blocks=32, block_size=4, max_num_batched_tokens=64)
    steps = record_schedules(runner)
    runner.warmup(num_requests=5, max_new_tokens=3)
    kinds = {(decode, start > 0) for step in steps for decode, start, _ in step}
    assert {(True, True), (False, False)} <= kinds, "decodes and whole prompts"
    assert any(len({decode for decode, _, _ in step}) == 2 for step in steps), "a step mixing both"
    assert not runner.has_unfinished_requests() and runner.block_pool.num_free == 32
    assert runner.spec_stats.num_draft_tokens == 0
    assert runner.generate(prompts, 6) == reference


def test_warmup_rejects_bad_arguments(tiny_runner):
    with pytest.raises(ValueError, match="num_requests must be an integer >= 1, got 0"):
        tiny_runner.warmup(num_requests=0)
    with pytest.raises(ValueError, match=r"max_new_tokens=40 leaves no room for a prompt"):
        tiny_runner.warmup(max_new_tokens=40)


def test_moe_overflow_raises():
    config = ModelConfig.preset("tiny-moe", capacity_factor=0.25)
    model = build_model(config, device="cpu")
    runner = ModelRunner(model, config, device="cpu", num_kv_blocks=32, block_size=4)
    with pytest.raises(RuntimeError, match=r"MoE capacity overflow .*layers\.0\.moe: \d+"):
        runner.generate(prompts_for(config, (20, 12)), 2)
    assert all(int(c) == 0 for c in model.overflow_counters().values())


@pytest.fixture(scope="module")
def tiny_runner():
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    return ModelRunner(model, config, device="cpu", num_kv_blocks=8, block_size=4)


@pytest.mark.parametrize(
    ("prompt", "max_new_tokens", "match"),
    [
        ([], 4, r"prompt_token_ids is empty"),
        ([1, 128], 4, r"prompt token 128 at index 1 is out of range \[0, 128\)"),
        ([-1], 4, r"prompt token -1 at index 0 is out of range"),
        ([1, 2], 0, r"max_new_tokens must be an integer >= 1, got 0"),
        ([1] * 30, 3, r"prompt of 30 tokens \+ max_new_tokens=3 needs 9 blocks of 4, the cache has 8"),
    ],
)
def test_bad_requests_are_rejected_without_losing_others(tiny_runner, prompt, max_new_tokens, match):
    kept = tiny_runner.add_request([5, 6], max_new_tokens=2)
    with pytest.raises(ValueError, match=match):
        tiny_runner.add_request(prompt, max_new_tokens)
    finished = {}
    while tiny_runner.has_unfinished_requests():
        finished.update(tiny_runner.step().finished)
    assert list(finished) == [kept] and len(finished[kept]) == 2


def test_bad_runner_arguments(tiny_runner):
    config = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match=r"num_kv_blocks must be an integer >= 1, got 0"):
        ModelRunner(tiny_runner.model, config, device="cpu", num_kv_blocks=0)
    with pytest.raises(ValueError, match=r"max_new_tokens has 1 entries for 2 prompts"):
        tiny_runner.generate([[1], [2]], [3])
    tiny_runner.add_request([1], 1)
    with pytest.raises(ValueError, match=r"generate\(\) needs an idle runner, but 1 requests"):
        tiny_runner.generate([[1]], 1)
    tiny_runner.step()
    with pytest.raises(ValueError, match=r"timeout_s must be positive, got 0"):
        ModelRunner(tiny_runner.model, config, device="cpu", num_kv_blocks=4, timeout_s=0)
    with pytest.raises(ValueError, match="dp_group was given but torch.distributed is not initialized"):
        ModelRunner(tiny_runner.model, config, device="cpu", num_kv_blocks=4, dp_group=object())
    with pytest.raises(ValueError, match="this runner has no cudagraph_capture_sizes"):
        tiny_runner.capture_graphs()


@pytest.mark.parametrize(
    ("prompt", "max_new_tokens", "match"),
    [
        ([1.0, 2], 3, r"prompt token at index 0 must be an integer, got 1.0 \(float\)"),
        ([1, True], 3, r"prompt token at index 1 is a bool \(True\), not a token id"),
        ("abc", 3, r"prompt_token_ids must be a sequence of token ids, got str"),
    ],
)
def test_token_ids_of_the_wrong_type_are_type_errors(tiny_runner, prompt, max_new_tokens, match):
    with pytest.raises(TypeError, match=match):
        tiny_runner.add_request(prompt, max_new_tokens)
    assert not tiny_runner.has_unfinished_requests()


def test_token_ids_may_be_any_integer_type(tiny_runner):
    import numpy as np

    (output,) = tiny_runner.generate([[np.int64(3), torch.tensor(4), 5]], 2)
    assert output == tiny_runner.generate([[3, 4, 5]], 2)[0]


@pytest.mark.parametrize(
    ("prompts", "max_new_tokens", "match"),
    [
        ([[1, 2]], 2.0, r"max_new_tokens must be an int or a list of ints \(one per prompt\), got 2.0 \(float\)"),
        ([1, 2, 3], 2, r"prompts must be a list of token-id lists, but prompt 0 is 1 \(int\)"),
        ("hello", 2, r"prompts must be a list of token-id lists, got str"),
    ],
)
def test_generate_refuses_arguments_of_the_wrong_type(tiny_runner, prompts, max_new_tokens, match):
    with pytest.raises(TypeError, match=match):
        tiny_runner.generate(prompts, max_new_tokens)
    assert not tiny_runner.has_unfinished_requests()


def test_a_float_limit_per_request_is_refused_not_truncated(tiny_runner):
    for call in (lambda: tiny_runner.add_request([1, 2], 2.0), lambda: tiny_runner.generate([[1, 2]], [2.0])):
        with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1, got 2.0 \(float\)"):
            call()
    assert not tiny_runner.has_unfinished_requests()


def test_max_model_len_bounds_every_request_without_graphs():
    config = ModelConfig.preset("tiny")
    runner = ModelRunner(
        build_model(config, device="cpu"), config, device="cpu", num_kv_blocks=8, block_size=4, max_model_len=10
    )
    with pytest.raises(
        ValueError,
        match=r"request too long for max_model_len=10: prompt of 8 tokens \+ "
        r"max_new_tokens=3",
    ):
        runner.add_request([1] * 8, 3)
    assert len(runner.generate([[1] * 8], 2)[0]) == 2
    with pytest.raises(ValueError, match=r"max_model_len must be an integer >= 1, got 0"):
        ModelRunner(runner.model, config, device="cpu", num_kv_blocks=8, max_model_len=0)


def test_a_model_whose_vocabulary_differs_from_its_config_is_refused():
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    with pytest.raises(
        ValueError,
        match=r"vocabulary does not match its config: config.vocab_size=256, "
        r"model.config.vocab_size=128, the model's embed rows=128",
    ):
        ModelRunner(model, config.replace(vocab_size=256), device="cpu", num_kv_blocks=8)
    model.config = config.replace(vocab_size=256)  # a config that no longer describes the weights
    with pytest.raises(
        ValueError,
        match=r"model.config.vocab_size=256, the model's embed rows=128, "
        r"the model's lm_head rows=128",
    ):
        ModelRunner(model, model.config, device="cpu", num_kv_blocks=8)


# ----- CUDA (run on the GPU machine) ----------------------------------------------------------


def near_greedy_violations(model, prompt: list[int], output: list[int], tol: float) -> list[int]:
    """Steps where ``output`` picked a token more than ``tol`` below the recomputed max logit
    (bf16 kernels differ between batch shapes, so exact argmax ties may flip)."""
    hidden = forward_sequences(model, [prompt + output[:-1]])
    with torch.inference_mode():
        logits = model.compute_logits(hidden[len(prompt) - 1 :])
    chosen = logits.gather(1, torch.tensor(output, device=logits.device)[:, None]).squeeze(1)
    return torch.nonzero(chosen < logits.max(dim=1).values - tol).flatten().tolist()


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["small", "small-moe"])
def test_cuda_bf16_greedy_matches_naive_recompute(preset):
    config = ModelConfig.preset(preset, dtype=torch.bfloat16)
    model = build_model(config, device="cuda")
    prompts = prompts_for(config, (5, 70, 33, 128))
    runner = ModelRunner(model, config, device="cuda", num_kv_blocks=256, block_size=16, max_num_batched_tokens=64)
    outputs = runner.generate(prompts, 12)
    naive = [naive_greedy(model, p, 12) for p in prompts]
    for prompt, output, ref in zip(prompts, outputs, naive):
        assert near_greedy_violations(model, prompt, output, tol=0.1) == []
        # Identical up to the first near-tie, which both sides resolve within tolerance.
        assert output[0] == ref[0] or near_greedy_violations(model, prompt, ref[:1], tol=0.1) == []
