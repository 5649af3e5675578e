"""Ubatched reference models equal the unsplit model: N = 2, 3, 4; prefill, decode, mixed steps
with straddling requests and padding (and, through hypothesis, any batch in 1-4 ubatches); one
process and expert / tensor parallel over gloo.

Tolerance: float32 on CPU, atol = rtol = 1e-5 (a straddling request's attention is computed in
two parts, and GEMMs of other row counts may block their sums differently).
"""

import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from tests.builtin_flash_fake import fake_builtin_flash_enabled
from tests.dist_utils import run_distributed
from ubatch.bench.measure import step_forward
from ubatch.bench.workload import make_step
from ubatch.models import ModelConfig, build_model
from ubatch.wrapper import UBatchWrapper

TOL = dict(atol=1e-5, rtol=1e-5)
MODELS = {
    "dense": dict(),
    "moe": dict(num_experts=4, top_k=2, moe_intermediate_size=48, num_shared_experts=1),
}


def _shape(kind: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """(query_lens, context_lens) of a random step of the given kind."""
    n = rng.randint(4, 7)
    if kind == "prefill":
        return [rng.randint(1, 12) for _ in range(n)], [0] * n
    if kind == "decode":
        return [1] * n, [rng.randint(1, 20) for _ in range(n)]
    queries = [rng.choice([1, rng.randint(2, 9)]) for _ in range(n)]
    return queries, [rng.choice([0, rng.randint(1, 15)]) for _ in range(n)]


_forward = step_forward  # the bench's own forward in a step's context


def check_ubatched_equals_unsplit(model, kind: str, seed: int, num_ubatches: int, pad: int = 0, tol=TOL) -> None:
    rng = random.Random(seed)
    query_lens, context_lens = _shape(kind, rng)
    step, cache = make_step(
        model,
        query_lens,
        context_lens,
        block_size=rng.choice([4, 16]),
        num_tokens_padded=sum(query_lens) + pad,
        seed=seed,
    )
    before = {name: cache[name].clone() for name in model.layer_names}
    expected = _forward(model, model, step)
    expected_cache = {name: cache[name].clone() for name in model.layer_names}
    for name in model.layer_names:
        cache[name].copy_(before[name])
    wrapper = UBatchWrapper(model, num_ubatches=4, device=model.device)
    got = _forward(wrapper, model, step, step.slices(num_ubatches))
    real = sum(query_lens)
    torch.testing.assert_close(got[:real], expected[:real], **tol)
    for name in model.layer_names:
        torch.testing.assert_close(cache[name], expected_cache[name], **tol)


@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
@pytest.mark.parametrize("model_kind", list(MODELS))
def test_ubatched_equals_unsplit_one_process(model_kind, num_ubatches, kind):
    model = build_model(ModelConfig(**MODELS[model_kind]), device="cpu")
    for seed in range(3):
        check_ubatched_equals_unsplit(model, kind, seed, num_ubatches, pad=seed % 2)


_REQUEST = st.tuples(st.integers(1, 12), st.sampled_from([0, 0, 1, 3, 16, 17, 40]))  # (query, cached context)


@pytest.fixture(scope="module")
def moe_model():
    return build_model(ModelConfig(**MODELS["moe"]), device="cpu")


@settings(max_examples=30, deadline=None)
@given(
    requests=st.lists(_REQUEST, min_size=1, max_size=8),
    num_ubatches=st.integers(1, 4),
    pad=st.integers(0, 3),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_ubatched_moe_equals_unsplit_on_any_batch(moe_model, requests, num_ubatches, pad, block_size, seed):
    """Any mix of prompts, continuations and decodes, with padding, in 1-4 ubatches; a split that
    would leave a ubatch without a real token is refused, and that is the only refusal."""
    model = moe_model
    query_lens, context_lens = map(list, zip(*requests))
    step, cache = make_step(
        model, query_lens, context_lens, block_size=block_size, num_tokens_padded=sum(query_lens) + pad, seed=seed
    )
    try:
        slices = step.slices(num_ubatches)
    except ValueError as exc:
        assert "would hold no real token" in str(exc)
        reject()
    before = {name: cache[name].clone() for name in model.layer_names}
    expected = _forward(model, model, step)
    for name in model.layer_names:
        cache[name].copy_(before[name])
    got = _forward(UBatchWrapper(model, num_ubatches=4, device=model.device), model, step, slices)
    torch.testing.assert_close(got[: sum(query_lens)], expected[: sum(query_lens)], **TOL)


@settings(max_examples=30, deadline=None)
@given(
    requests=st.lists(_REQUEST, min_size=1, max_size=8),
    num_ubatches=st.integers(1, 4),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_ubatched_moe_on_the_varlen_flash_path_equals_unsplit_sdpa(moe_model, requests, num_ubatches, block_size, seed):
    """The torch backend's varlen flash path (a CPU stand-in for the kernel) over the ubatches'
    own metadata, straddling requests included, against the unsplit model on the SDPA runs."""
    model = moe_model
    query_lens, context_lens = map(list, zip(*requests))
    step, cache = make_step(model, query_lens, context_lens, block_size=block_size, seed=seed)
    try:
        slices = step.slices(num_ubatches)
    except ValueError:
        reject()
    before = {name: cache[name].clone() for name in model.layer_names}
    expected = _forward(model, model, step)
    for name in model.layer_names:
        cache[name].copy_(before[name])
    with fake_builtin_flash_enabled() as calls:
        got = _forward(UBatchWrapper(model, num_ubatches=4, device=model.device), model, step, slices)
    assert len(calls) >= len(slices) * model.config.num_layers  # every layer of every ubatch
    torch.testing.assert_close(got[: sum(query_lens)], expected[: sum(query_lens)], **TOL)


def parallel_body(rank, world_size, model_kind, device="cpu", tol=TOL):
    """Run on every rank: the EP (MoE) or TP (dense) model, ubatched vs unsplit."""
    torch.manual_seed(0)
    group = dist.group.WORLD
    config = ModelConfig(**MODELS[model_kind])
    device = torch.device(device, rank) if device == "cuda" else torch.device(device)
    if model_kind == "moe":
        model = build_model(config, device=device, ep_group=group)
    else:
        model = build_model(config, device=device, tp_group=group)
    for num_ubatches in (2, 3, 4):
        for i, kind in enumerate(["prefill", "decode", "mixed"]):
            # Expert parallelism: every rank has its own tokens (same count); TP: the same tokens.
            seed = 10 * i + (rank if model_kind == "moe" else 0)
            rng_shape_seed = 10 * i
            rng = random.Random(rng_shape_seed)
            query_lens, context_lens = _shape(kind, rng)
            step, cache = make_step(model, query_lens, context_lens, seed=seed)
            before = {name: cache[name].clone() for name in model.layer_names}
            expected = _forward(model, model, step)
            for name in model.layer_names:
                cache[name].copy_(before[name])
            wrapper = UBatchWrapper(model, num_ubatches=4, device=device)
            got = _forward(wrapper, model, step, step.slices(num_ubatches))
            torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("model_kind", list(MODELS))
def test_ubatched_equals_unsplit_two_ranks_gloo(model_kind):
    run_distributed(parallel_body, 2, model_kind)
