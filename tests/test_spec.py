"""Speculative decoding (eager, CPU): greedy output equals plain greedy decoding token for token
(dense and MoE, k = 1..4, partial and full acceptance, with and without ubatched verification,
chunked prefill, mixed steps, KV pressure); skip_attention reaches every drafter forward; bad
input is rejected."""

from __future__ import annotations

import logging

import pytest
import torch

from ubatch.attention import TorchBackend
from ubatch.context import CUDAGraphMode, get_forward_context
from ubatch.models import ModelConfig, build_model
from ubatch.runner import ModelRunner
from ubatch.spec import DraftModel, DraftRequest, accept_greedy

PROMPT_LENGTHS = (3, 17, 40, 9, 1)
MAX_NEW_TOKENS = 10
FULL, PIECEWISE, NONE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE
RUNNER_ARGS = dict(device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)


def prompts_for(config: ModelConfig) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def target(request):
    """The target model, its prompts and its plain greedy outputs."""
    config = ModelConfig.preset(request.param)
    model = build_model(config, device="cpu")
    prompts = prompts_for(config)
    reference = ModelRunner(model, config, **RUNNER_ARGS).generate(prompts, MAX_NEW_TOKENS)
    return config, model, prompts, reference


def spec_runner(config, model, draft, k, **overrides) -> ModelRunner:
    return ModelRunner(model, config, **{**RUNNER_ARGS, **overrides}, draft_model=draft, num_speculative_tokens=k)


def record_steps(runner: ModelRunner) -> list[list[tuple[bool, int]]]:
    """Keep (is a prefill chunk, number of drafts) of every chunk of every step."""
    steps: list[list[tuple[bool, int]]] = []
    propose = runner.propose_drafts

    def recording(chunks):
        chunks = propose(chunks)
        steps.append([(not c.request.is_decoding, len(c.draft_token_ids)) for c in chunks])
        return chunks

    runner.propose_drafts = recording
    return steps


@pytest.mark.parametrize("num_ubatches", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_truncated_drafter_matches_plain_greedy(target, k, num_ubatches):
    config, model, prompts, reference = target
    draft = build_model(config.replace(num_layers=1), device="cpu")  # same seed: the first layer
    runner = spec_runner(config, model, draft, k, num_ubatches=num_ubatches)
    steps = record_steps(runner)
    assert runner.generate(prompts, MAX_NEW_TOKENS) == reference
    assert 0.0 < runner.spec_stats.acceptance_rate < 1.0
    assert any(n == k for step in steps for _, n in step)
    assert any(any(p for p, _ in step) and any(n for _, n in step) for step in steps), "no mixed step"


@pytest.mark.parametrize("num_ubatches", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_self_drafter_accepts_everything(target, k, num_ubatches):
    config, model, prompts, reference = target
    runner = spec_runner(config, model, model, k, num_ubatches=num_ubatches)  # the target object itself
    assert runner.generate(prompts, MAX_NEW_TOKENS) == reference
    assert runner.spec_stats.num_draft_tokens > 0
    assert runner.spec_stats.acceptance_rate == 1.0


def test_step_output_reports_tokens_and_acceptance(target):
    config, model, prompts, reference = target
    runner = spec_runner(config, model, model, 3)
    ids = [runner.add_request(p, MAX_NEW_TOKENS) for p in prompts]
    generated = {i: [] for i in ids}
    drafts = accepted = 0
    while runner.has_unfinished_requests():
        out = runner.step()
        for i, tokens in out.new_token_ids.items():
            assert out.new_tokens[i] == tokens[-1]
            generated[i] += tokens
        drafts, accepted = drafts + out.num_draft_tokens, accepted + out.num_accepted_tokens
    assert [generated[i] for i in ids] == reference
    assert (drafts, accepted) == (runner.spec_stats.num_draft_tokens, runner.spec_stats.num_accepted_tokens)
    assert max(len(t) for t in generated.values()) == MAX_NEW_TOKENS


def test_ubatched_verification_splits_on_request_boundaries(target):
    config, model, prompts, reference = target
    draft = build_model(config.replace(num_layers=1), device="cpu")
    runner = spec_runner(config, model, draft, 3, num_ubatches=2, max_num_batched_tokens=64)
    splits = []
    split = runner._split

    def recording(chunks, num_ubatches, num_tokens):
        slices = split(chunks, num_ubatches, num_tokens)
        splits.append(([c.query_len for c in chunks], slices))
        return slices

    runner._split = recording
    assert runner.generate(prompts, MAX_NEW_TOKENS) == reference
    decode_splits = [(lens, s) for lens, s in splits if len(set(lens)) == 1 and lens[0] == 4 and len(lens) >= 2]
    assert decode_splits, "no pure-decode verification step was ubatched"
    for _lens, slices in decode_splits:
        assert len(slices) == 2
        for s in slices:  # every ubatch uniform: k + 1 tokens per request
            assert s.num_tokens == 4 * s.num_reqs


def test_kv_pressure_preempts_and_keeps_outputs(target, caplog):
    config, model, prompts, reference = target
    draft = build_model(config.replace(num_layers=1), device="cpu")
    runner = spec_runner(config, model, draft, 4, num_kv_blocks=14, max_num_batched_tokens=32)
    with caplog.at_level(logging.INFO, logger="ubatch.runner"):
        assert runner.generate(prompts, MAX_NEW_TOKENS) == reference
    assert "preempting" in caplog.text
    assert runner.block_pool.num_free == 14


class SpyBackend(TorchBackend):
    """The torch backend, counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, q, kv_cache, metadata, scale):
        self.calls += 1
        return super().forward(q, kv_cache, metadata, scale)


@pytest.mark.parametrize("skip_attention", [True, False])
def test_skip_attention_reaches_every_drafter_forward(skip_attention):
    config = ModelConfig.preset("tiny")
    spy = SpyBackend()
    draft = build_model(config, device="cpu", attn_backend=spy)
    seen = []
    for layer in draft.attention_layers.values():
        layer.register_forward_pre_hook(lambda *_: seen.append(get_forward_context().skip_attention))
    drafter = DraftModel(draft, num_kv_blocks=8, block_size=4)
    requests = [DraftRequest(0, [1, 2, 3, 4, 5], [0, 1, 2], 3), DraftRequest(1, [7, 8], [3, 4], 2)]
    drafts = drafter.propose(requests, skip_attention=skip_attention)
    assert [len(d) for d in drafts] == [3, 2]
    forwards = 3  # prepare (catch-up + first draft), then two draft steps
    assert seen == [skip_attention] * (forwards * config.num_layers)
    assert spy.calls == (0 if skip_attention else forwards * config.num_layers)
    assert drafter.num_computed(0) == 7 and drafter.num_computed(1) == 3


def test_drafts_of_a_batch_with_unequal_draft_counts_equal_each_request_drafted_alone():
    """Requests that have drafted enough drop out of later draft steps; the rest keep feeding
    their own last draft (kept on the device between steps)."""
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    requests = [
        DraftRequest(0, [1, 2, 3, 4, 5], [0, 1, 2], 1),
        DraftRequest(1, [7, 8], [3, 4], 4),
        DraftRequest(2, [9, 3, 6], [5, 6], 2),
        DraftRequest(3, [4], [7, 8], 3),
    ]
    together = DraftModel(model, num_kv_blocks=9, block_size=4).propose(requests)
    alone = [DraftModel(model, num_kv_blocks=9, block_size=4).propose([r])[0] for r in requests]
    assert [len(d) for d in together] == [1, 4, 2, 3]
    assert together == alone


def test_drafter_rollback_and_forget():
    config = ModelConfig.preset("tiny")
    drafter = DraftModel(build_model(config, device="cpu"), num_kv_blocks=4, block_size=4)
    drafter.propose([DraftRequest(5, [1, 2, 3], [0, 1], 3)])
    assert drafter.num_computed(5) == 5
    drafter.rollback(5, 4)
    assert drafter.num_computed(5) == 4
    drafter.rollback(5, 9)  # never advances
    assert drafter.num_computed(5) == 4
    drafter.forget(5)
    assert drafter.num_computed(5) == 0


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, bonus token
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the target's token at the mismatch
    assert accept_greedy([5], [4, 1]) == [4]
    assert accept_greedy([], [3]) == [3]
    with pytest.raises(ValueError, match="one more target token than drafts"):
        accept_greedy([1, 2], [1, 2])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1, got 0"),
        (dict(num_speculative_tokens=-2), "got -2"),
        (dict(num_speculative_tokens=True), "got True"),
        (dict(num_speculative_tokens=2.0), "got 2.0"),
        (dict(num_speculative_tokens=None), "needs both draft_model and num_speculative_tokens"),
    ],
)
def test_bad_speculative_arguments(kwargs, match):
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    with pytest.raises(ValueError, match=match):
        ModelRunner(model, config, **RUNNER_ARGS, draft_model=model, **kwargs)


def test_k_without_draft_model_and_vocab_mismatch_are_rejected():
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    with pytest.raises(ValueError, match="draft_model=None, num_speculative_tokens=2"):
        ModelRunner(model, config, **RUNNER_ARGS, num_speculative_tokens=2)
    draft = build_model(config.replace(vocab_size=64), device="cpu")
    with pytest.raises(ValueError, match="vocab_size=64 differs from the target's vocab_size=128"):
        ModelRunner(model, config, **RUNNER_ARGS, draft_model=draft, num_speculative_tokens=2)


def test_drafter_rejects_zero_drafts():
    drafter = DraftModel(build_model(ModelConfig.preset("tiny"), device="cpu"), num_kv_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="request 3: num_drafts must be >= 1, got 0"):
        drafter.propose([DraftRequest(3, [1, 2], [0], 0)])


def test_runner_passes_skip_attention_to_the_drafter():
    config = ModelConfig.preset("tiny")
    spy = SpyBackend()
    draft = build_model(config, device="cpu", attn_backend=spy)
    runner = spec_runner(config, build_model(config, device="cpu"), draft, 2)
    runner.add_request([1, 2, 3], 5)
    runner.step()  # the prefill: nothing to draft yet
    chunks = runner.propose_drafts(runner.schedule(), skip_attention=True)
    assert [len(c.draft_token_ids) for c in chunks] == [2]
    assert spy.calls == 0


# ----- the drafter's graphs (fake graph backend: capture bookkeeping without CUDA) -------------


def _drafter_with_fake_graphs(spy, **kwargs):
    from tests.test_cudagraph import FakeBackend

    draft = build_model(ModelConfig.preset("tiny"), device="cpu", attn_backend=spy)
    return DraftModel(
        draft,
        num_kv_blocks=8,
        block_size=4,
        capture_sizes=[4, 8],
        max_blocks_per_req=4,
        graph_backend=FakeBackend(),
        **kwargs,
    )


def test_drafter_piecewise_capture_skips_attention_and_full_capture_runs_it():
    spy = SpyBackend()
    drafter = _drafter_with_fake_graphs(spy)
    calls = {}
    create = drafter.graphs._create_forward_fn

    def counting(desc):
        forward_fn = create(desc)

        def counted(mode):
            before = spy.calls
            out = forward_fn(mode)
            calls[desc.cg_mode, desc.num_tokens, mode] = spy.calls - before
            return out

        return counted

    drafter.graphs._create_forward_fn = counting
    drafter.capture_graphs()
    layers = drafter.model.config.num_layers
    for size in (4, 8):  # warm-up (NONE), then the capture pass, of every descriptor
        assert calls[PIECEWISE, size, NONE] == calls[PIECEWISE, size, PIECEWISE] == 0
        assert calls[FULL, size, NONE] == calls[FULL, size, FULL] == layers
    assert all(layer.kv_cache is None for layer in drafter.model.attention_layers.values()), (
        "the draft cache is bound only around the drafter's own work"
    )


def test_drafter_replays_its_graphs_and_never_when_skipping_attention():
    spy = SpyBackend()
    drafter = _drafter_with_fake_graphs(spy)
    drafter.capture_graphs()
    replayed = []
    replay = drafter.graphs.replay
    drafter.graphs.replay = lambda desc, *args: replayed.append(desc) or replay(desc, *args)
    requests = [DraftRequest(0, [1, 2, 3, 4, 5], [0, 1, 2], 3), DraftRequest(1, [7, 8], [3, 4], 3)]
    spy.calls = 0
    drafter.propose(requests, skip_attention=True)
    assert not replayed and spy.calls == 0, "a skip_attention forward runs eagerly and skips attention"
    drafter.rollback(0, 0)
    drafter.rollback(1, 0)
    drafter.propose(requests)
    assert [(d.cg_mode, d.num_tokens) for d in replayed] == [(PIECEWISE, 8), (FULL, 4), (FULL, 4)], (
        "catch-up (7 tokens) replays PIECEWISE, each one-token draft step FULL"
    )
    drafter.release_graphs()
    assert drafter.graphs.plan(2, 2, 1) is None


def test_a_catch_up_after_verification_is_made_uniform_and_replays_a_full_graph_of_k_plus_1():
    spy = SpyBackend()
    drafter = _drafter_with_fake_graphs(spy, catch_up_width=3)
    drafter.capture_graphs()
    fed = []
    forward = drafter._forward
    drafter._forward = lambda chunks, ids, **kw: fed.append([n for _, _, n in chunks]) or forward(chunks, ids, **kw)
    replayed = []
    replay = drafter.graphs.replay
    drafter.graphs.replay = lambda desc, *args: replayed.append(desc) or replay(desc, *args)
    prompts = [DraftRequest(0, [1, 2, 3, 4, 5], [0, 1], 2), DraftRequest(1, [7, 8, 9], [3], 2)]
    drafter.propose(prompts)
    assert fed[0] == [5, 3], "prompts are caught up whole: too long to pad to k + 1"
    # The target accepted one draft of request 0 (plus its own token) and none of request 1's.
    drafter.rollback(0, 6)
    drafter.rollback(1, 3)
    after = [DraftRequest(0, [1, 2, 3, 4, 5, 6, 7], [0, 1], 2), DraftRequest(1, [7, 8, 9, 10], [3, 4], 2)]
    fed.clear(), replayed.clear()
    drafts = drafter.propose(after)
    assert fed == [[3, 3], [1, 1]], "catch-ups of 1 token start earlier: the last k + 1 tokens of each request"
    assert [(d.cg_mode, d.num_tokens, d.uniform_token_count) for d in replayed] == [(FULL, 6, 3), (FULL, 4, 1)]
    assert len(drafts) == 2


def test_padded_catch_ups_draft_what_unpadded_ones_draft():
    model = build_model(ModelConfig.preset("tiny"), device="cpu")
    padded = DraftModel(model, num_kv_blocks=8, block_size=4, catch_up_width=3)
    plain = DraftModel(model, num_kv_blocks=8, block_size=4)
    prompts = [DraftRequest(0, [1, 2, 3, 4, 5], [0, 1], 2), DraftRequest(1, [7, 8, 9], [3], 2)]
    first = [drafter.propose(prompts) for drafter in (padded, plain)]
    assert first[0] == first[1]
    # The target accepts request 0's first draft and none of request 1's, each plus a token of its own.
    after = [DraftRequest(0, [1, 2, 3, 4, 5, first[0][0][0], 99], [0, 1], 2), DraftRequest(1, [7, 8, 9, 77], [3, 4], 2)]
    for drafter in (padded, plain):
        drafter.rollback(0, 6)
        drafter.rollback(1, 3)
    assert padded.propose(after) == plain.propose(after), (
        "recomputing KV the drafter holds (same tokens, same slots) changes no draft"
    )


def test_catch_up_width_below_two_is_refused():
    with pytest.raises(ValueError, match=r"catch_up_width must be an integer >= 2 \(k \+ 1\), got 1"):
        DraftModel(
            build_model(ModelConfig.preset("tiny"), device="cpu"), num_kv_blocks=4, block_size=4, catch_up_width=1
        )


def test_speculative_graphs_need_cuda_and_dp_needs_a_local_drafter(monkeypatch):
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    with pytest.raises(ValueError, match="cudagraph_capture_sizes needs a CUDA device, got cpu"):
        spec_runner(config, model, model, 2, cudagraph_capture_sizes=[8])
    monkeypatch.setattr(ModelRunner, "_init_dp", _fake_dp_init)
    draft = build_model(config, device="cpu")
    draft.layers[0].ffn.tp_group = object()  # as if tensor-parallel
    with pytest.raises(ValueError, match="the draft model must run locally on each rank"):
        spec_runner(config, model, draft, 2)


def _fake_dp_init(runner, dp_group, timeout_s):
    runner._dp_group, runner.dp_rank, runner.dp_size, runner._pad_to_max, runner._num_steps = object(), 0, 2, False, 0


# ----- speculation with data parallelism (gloo, 2 processes) -----------------------------------


def dp_spec_body(rank: int, world_size: int, num_ubatches: int) -> None:
    """DP=2 EP=2 target, a local one-layer drafter per rank: outputs equal one process's plain
    greedy decoding of every request."""
    import torch.distributed as dist

    config = ModelConfig.preset("tiny-moe")
    loads = [(3, 17, 40, 9), (12, 2)]
    g = torch.Generator().manual_seed(0)
    prompts = [[torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lens] for lens in loads]
    reference = ModelRunner(build_model(config, device="cpu"), config, **RUNNER_ARGS).generate(
        sum(prompts, []), MAX_NEW_TOKENS
    )
    target = build_model(config, device="cpu", ep_group=dist.group.WORLD)
    draft = build_model(config.replace(num_layers=1), device="cpu")
    runner = ModelRunner(
        target,
        config,
        **RUNNER_ARGS,
        num_ubatches=num_ubatches,
        dp_group=dist.group.WORLD,
        timeout_s=60,
        draft_model=draft,
        num_speculative_tokens=3,
    )
    first = sum(len(p) for p in prompts[:rank])
    assert runner.generate(prompts[rank], MAX_NEW_TOKENS) == reference[first : first + len(prompts[rank])]
    assert 0.0 < runner.spec_stats.acceptance_rate < 1.0


@pytest.mark.parametrize("num_ubatches", [1, 2])
def test_dp2_speculative_generation_equals_single_process(num_ubatches):
    from tests.dist_utils import run_distributed

    run_distributed(dp_spec_body, 2, num_ubatches)
