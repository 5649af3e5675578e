"""Graph descriptors, dispatch, and the capture bookkeeping that runs without CUDA (a fake
graph backend stands in for torch.cuda.CUDAGraph)."""

import contextlib
import logging

import pytest
import torch

from ubatch import CUDAGraphMode, get_forward_context, set_forward_context
from ubatch.attention import TorchBackend
from ubatch.bench.workload import make_step
from ubatch.context import capture_scope
from ubatch.cudagraph import BatchExecutionDescriptor as BED
from ubatch.cudagraph import CudaGraphManager, dispatch, make_descriptors
from ubatch.graphed import GraphedModel
from ubatch.link import HostLink
from ubatch.models import ModelConfig, build_model
from ubatch.overlap import OverlapMode, apply_mode
from ubatch.wrapper import UBatchWrapper

FULL, PIECEWISE, NONE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE


class FakeGraph:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def replay(self):
        self.log.append(("replay", self.name))


class FakeBackend:
    """Runs 'captures' eagerly and logs them; replays only log."""

    def __init__(self, fail=()):
        self.log, self.fail, self.created = [], set(fail), []

    def capture(self, fn):
        self.log.append("capture")
        out = fn()
        if "full" in self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.created.append(FakeGraph(self.log, "full"))
        return self.created[-1], out

    def begin_segment(self):
        self.created.append(FakeGraph(self.log, f"segment{len(self.created)}"))
        return self.created[-1]

    def end_segment(self, graph):
        self.log.append(("end", graph.name))

    def capture_stream(self):
        return contextlib.nullcontext()

    def release(self, graph):
        self.log.append(("release", graph.name))

    def synchronize(self):
        pass

    def recover(self):
        self.log.append("recover")

    def memory_in_use(self):
        return 0

    def rng_state(self):
        return torch.get_rng_state()

    def set_rng_state(self, state):
        torch.set_rng_state(state)


class SpyBackend(TorchBackend):
    """Counts attention kernel launches; fails on the dummy inputs a capture would feed it."""

    def __init__(self, fail_on_dummy=False):
        super().__init__()
        self.calls, self.fail_on_dummy = 0, fail_on_dummy

    def forward(self, q, kv_cache, metadata, scale):
        self.calls += 1
        if self.fail_on_dummy and bool((metadata.slot_mapping < 0).all()):
            raise RuntimeError("illegal memory access: attention ran on capture-time dummy inputs")
        return super().forward(q, kv_cache, metadata, scale)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cg_mode=NONE, num_tokens=8), "PIECEWISE or FULL"),
        (dict(cg_mode=FULL, num_tokens=0), "num_tokens must be an integer >= 1, got 0"),
        (dict(cg_mode=FULL, num_tokens=8, uniform_token_count=3), "not a multiple"),
        (dict(cg_mode=FULL, num_tokens=8, uniform_token_count=2, num_reqs=3), "has 4 requests, not 3"),
        (dict(cg_mode=FULL, num_tokens=2, num_ubatches=3), "num_ubatches=3 exceeds num_tokens=2"),
    ],
)
def test_descriptor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BED(**kwargs)


def test_dispatch_picks_smallest_compatible_full_first():
    descs = make_descriptors([8, 16, 32], ubatch_counts=(1, 2))
    assert dispatch(descs, 5, num_reqs=5, uniform_token_count=1) == BED(FULL, 8, uniform_token_count=1)
    assert dispatch(descs, 12, num_reqs=12, uniform_token_count=1, num_ubatches=2) == BED(
        FULL, 16, uniform_token_count=1, num_ubatches=2
    )
    # a mixed batch of a FULL size never replays the uniform-decode graph
    assert dispatch(descs, 8, num_reqs=3, uniform_token_count=None) == BED(PIECEWISE, 8)
    # the same size of tokens, but 2 tokens per request: not the decode graph
    assert dispatch(descs, 8, num_reqs=4, uniform_token_count=2) == BED(PIECEWISE, 8)
    assert dispatch(descs, 33, num_reqs=33, uniform_token_count=1) is None
    assert dispatch(descs, 8, num_reqs=2, uniform_token_count=None, num_ubatches=2) == BED(PIECEWISE, 8, num_ubatches=2)
    assert dispatch(descs, 8, num_reqs=2, uniform_token_count=None, num_ubatches=3) is None


def _forward_fn_factory(seen):
    """A forward_fn that builds its own context and even asks for the wrong skip_attention."""

    def create(desc):
        def forward_fn(mode):
            with set_forward_context(None, skip_attention=(mode == PIECEWISE), cudagraph_runtime_mode=mode):
                seen.append((desc.cg_mode, desc.num_tokens, mode, get_forward_context().skip_attention))
                return torch.zeros(desc.num_tokens)

        return forward_fn

    return create


@pytest.mark.parametrize("breakable", [False, True])
def test_warmup_and_capture_skip_attention_keyed_on_descriptor(breakable):
    seen = []
    manager = CudaGraphManager(backend=FakeBackend(), use_breakable_cg=breakable)
    manager.capture(_forward_fn_factory(seen), make_descriptors([4, 8]))
    expected = []
    for mode, size in [(FULL, 8), (FULL, 4), (PIECEWISE, 8), (PIECEWISE, 4)]:
        skip = mode == PIECEWISE and not breakable
        expected += [(mode, size, NONE, skip), (mode, size, mode, skip)]
    assert seen == expected, "largest first, FULL then PIECEWISE, warm-up (NONE) then capture"
    assert set(manager.graphs) == set(make_descriptors([4, 8]))


def test_failed_capture_falls_back_with_a_warning_and_restores_rng(caplog):
    manager = CudaGraphManager(backend=FakeBackend(fail={"full"}))
    state = torch.get_rng_state()

    def create(desc):
        def forward_fn(mode):
            torch.rand(3)  # advances the RNG, as a failed capture can
            return torch.zeros(1)

        return forward_fn

    with caplog.at_level(logging.WARNING):
        manager.capture(create, [BED(FULL, 4, uniform_token_count=1)])
    assert manager.graphs == {} and "capturing" in caplog.text and "run eagerly" in caplog.text
    assert torch.equal(torch.get_rng_state(), state)
    assert manager.dispatch(4, num_reqs=4, uniform_token_count=1) is None


def test_self_check_disables_graphs_on_mismatch(caplog):
    manager = CudaGraphManager(backend=FakeBackend())
    manager.capture(_forward_fn_factory([]), [BED(FULL, 4, uniform_token_count=1)])
    desc = BED(FULL, 4, uniform_token_count=1)
    assert manager.self_check(lambda d: None, lambda d: torch.zeros(4), atol=0, rtol=0)
    with caplog.at_level(logging.WARNING):
        assert not manager.self_check(lambda d: None, lambda d: torch.ones(4), atol=0, rtol=0)
    assert "disabled" in caplog.text and manager.dispatch(4, num_reqs=4, uniform_token_count=1) is None
    with pytest.raises(KeyError, match="no graph captured"):
        manager.replay(BED(FULL, 8, uniform_token_count=1))
    assert desc in manager.graphs


def _tiny_graphed(spy, breakable, **kwargs):
    model = build_model(ModelConfig.preset("tiny-moe"), device="cpu", attn_backend=spy)
    make_step(model, [1] * 8, [5] * 8)  # binds a KV cache
    return model, GraphedModel(
        model,
        capture_sizes=[8],
        max_blocks_per_req=4,
        use_breakable_cg=breakable,
        graph_backend=FakeBackend(),
        **kwargs,
    )


def test_piecewise_capture_never_runs_attention_on_dummy_inputs():
    spy = SpyBackend(fail_on_dummy=True)
    model, graphed = _tiny_graphed(spy, breakable=False, modes=(PIECEWISE,))
    graphed.capture()
    assert spy.calls == 0, "neither warm-up nor capture of a PIECEWISE descriptor may run attention"
    program = graphed.manager.graphs[BED(PIECEWISE, 8)]
    islands = [i for i in program.items if not isinstance(i, FakeGraph)]
    assert len(islands) >= model.config.num_layers, "attention and collectives became eager islands"


def test_joined_experts_refuse_a_piecewise_capture(caplog):
    """A piecewise replay would run the join as an eager island whose combines the other
    ubatches' recorded waits do not see: the capture fails, naming the layer, and those batches
    run eagerly."""
    model, graphed = _tiny_graphed(SpyBackend(), breakable=False, modes=(PIECEWISE,), ubatch_counts=(2,))
    apply_mode(model, OverlapMode(num_ubatches=2, join_experts=True))
    with caplog.at_level(logging.WARNING, logger="ubatch.cudagraph"):
        graphed.capture()
    assert "layers.0.moe: joined experts (join_ubatches=True) cannot be captured in a PIECEWISE graph" in caplog.text
    assert BED(PIECEWISE, 8, num_ubatches=2) not in graphed.manager.graphs


def test_breakable_piecewise_capture_runs_attention_and_full_capture_too():
    spy = SpyBackend()
    _, graphed = _tiny_graphed(spy, breakable=True, modes=(PIECEWISE,))
    graphed.capture()
    assert spy.calls == 2 * 2, "breakable: warm-up and capture both run attention in each of 2 layers"
    spy_full = SpyBackend()
    _, graphed = _tiny_graphed(spy_full, breakable=False, modes=(FULL,), ubatch_counts=(1, 2))
    graphed.capture()
    assert spy_full.calls > 0, "FULL descriptors capture attention"


def test_piecewise_scope_reaches_every_ubatch():
    spy = SpyBackend(fail_on_dummy=True)
    model = build_model(ModelConfig.preset("tiny-moe"), device="cpu", attn_backend=spy)
    step, _ = make_step(model, [4, 4], [0, 0])
    wrapper = UBatchWrapper(model, num_ubatches=2, device="cpu")
    with torch.inference_mode(), capture_scope(skip_attention=True):
        with set_forward_context(
            step.attn_metadata,
            no_compile_layers=model.attention_layers,
            ubatch_slices=step.slices(2),
            skip_attention=False,
        ):
            wrapper(step.input_ids, step.positions)
    assert spy.calls == 0


def test_ubatched_piecewise_capture_records_a_program_per_ubatch_and_skips_attention():
    spy = SpyBackend(fail_on_dummy=True)
    model, graphed = _tiny_graphed(spy, breakable=False, modes=(PIECEWISE,), ubatch_counts=(2,))
    graphed.capture()
    assert spy.calls == 0, "no ubatch of a PIECEWISE warm-up or capture may run attention"
    program = graphed.manager.graphs[BED(PIECEWISE, 8, num_ubatches=2)]
    blocks = [i for i in program.items if hasattr(i, "programs")]
    assert len(blocks) == 1 and len(blocks[0].programs) == 2
    for ubatch_program in blocks[0].programs:
        islands = [i for i in ubatch_program.items if hasattr(i, "fn")]
        assert len(islands) >= model.config.num_layers


def test_breakable_ubatched_piecewise_capture_runs_attention_in_every_ubatch():
    spy = SpyBackend()
    _, graphed = _tiny_graphed(spy, breakable=True, modes=(PIECEWISE,), ubatch_counts=(2,))
    graphed.capture()
    assert spy.calls == 2 * 2 * 2, "warm-up and capture, 2 ubatches, 2 layers"


def test_release_frees_every_graph_and_later_steps_run_eagerly():
    """NCCL's communicator teardown waits for every graph that captured a collective: release()
    must reach FULL graphs and every segment of (ubatched) piecewise programs."""
    model, graphed = _tiny_graphed(SpyBackend(), breakable=False, modes=(FULL, PIECEWISE), ubatch_counts=(1, 2))
    graphed.capture()
    backend = graphed.manager.backend
    graphed.release()
    released = [entry[1] for entry in backend.log if isinstance(entry, tuple) and entry[0] == "release"]
    assert sorted(released) == sorted(g.name for g in backend.created)
    assert released.count("full") == 2 and len(released) > 2, "FULL graphs (N=1, 2) and piecewise segments"
    assert not graphed.manager.graphs and not graphed.static
    step, _ = make_step(model, [1] * 8, [5] * 8, seed=1)
    md = step.attn_metadata[model.layer_names[0]]
    assert graphed.plan(8, 8, 1) is None
    with torch.inference_mode():
        torch.testing.assert_close(
            graphed.run(step.input_ids, step.positions, md), graphed.eager(step.input_ids, step.positions, md)
        )


def test_capture_sizes_gain_the_multiples_each_tokens_per_request_count_needs():
    from ubatch.cudagraph import sizes_with_multiples

    assert sizes_with_multiples([4, 8], [3]) == [4, 6, 8, 9]
    assert sizes_with_multiples([4, 8, 16], []) == [4, 8, 16]
    descs = make_descriptors(sizes_with_multiples([4, 8], [1, 3]), uniform_token_count=(1, 3))
    full = {(d.num_tokens, d.uniform_token_count) for d in descs if d.cg_mode == CUDAGraphMode.FULL}
    assert full == {(4, 1), (6, 1), (8, 1), (9, 1), (6, 3), (9, 3)}


@pytest.mark.parametrize(
    "preset, group_kind, mode_name, graph_mode",
    [
        ("tiny-moe", "ep_group", "split2+local", PIECEWISE),
        ("tiny-moe", "ep_group", "pipeline2+local", PIECEWISE),
        ("tiny-moe", "ep_group", "split2+join+pipeline2+local", FULL),
        ("tiny", "tp_group", "allreduce2", PIECEWISE),
        ("tiny", "tp_group", "split2+allreduce2", FULL),
    ],
)
def test_own_rows_first_and_chunked_all_reduces_capture_over_the_link(
    preset, group_kind, mode_name, graph_mode, caplog
):
    """Their captures take the static path and record every collective (on the CPU link, with the
    fake backend, whose captures run eagerly): no descriptor falls back to eager."""
    link = HostLink(2, bandwidth_gbps=50.0)
    model = build_model(ModelConfig.preset(preset), device="cpu", **{group_kind: link})
    make_step(model, [1] * 8, [5] * 8)  # binds a KV cache
    mode = OverlapMode.parse(mode_name)
    apply_mode(model, mode)
    graphed = GraphedModel(
        model,
        capture_sizes=[8],
        max_blocks_per_req=4,
        modes=(graph_mode,),
        ubatch_counts=(mode.num_ubatches,),
        single_batch_overlap=mode.num_ubatches == 1,
        graph_backend=FakeBackend(),
    )
    before = link.bytes_moved
    with caplog.at_level(logging.WARNING, logger="ubatch.cudagraph"):
        graphed.capture()
    assert "failed" not in caplog.text, caplog.text
    assert graphed.descriptors and set(graphed.manager.graphs) == set(graphed.descriptors), "every descriptor captured"
    assert link.bytes_moved > before
    apply_mode(model, OverlapMode())


@pytest.mark.parametrize("preset, group_kind", [("tiny", "tp_group"), ("tiny-moe", "ep_group")])
def test_a_piecewise_replay_runs_the_other_ubatch_while_a_collective_is_in_flight(preset, group_kind, monkeypatch):
    """Replayed from a PIECEWISE graph, a two-way split starts each collective, then replays the
    other ubatch's graph segments, and only then waits: the order that lets the transfer hide
    (the fake backend's replays log which ubatch launched each segment)."""
    import ubatch.scheduler as scheduler

    link = HostLink(2, bandwidth_gbps=50.0)
    model = build_model(ModelConfig.preset(preset, num_layers=2), device="cpu", **{group_kind: link})
    step, _ = make_step(model, [8, 8], [0, 0])
    backend = FakeBackend()
    graphed = GraphedModel(
        model, capture_sizes=[16], max_blocks_per_req=4, modes=(PIECEWISE,), ubatch_counts=(2,), graph_backend=backend
    )
    graphed.capture()
    log: list[tuple[str, int | None]] = []
    start, finish = scheduler.UBatchState.start_collective, scheduler.UBatchState.finish_collective

    def logged_start(self, *args, **kwargs):
        log.append(("start", self.ubatch_id))
        return start(self, *args, **kwargs)

    def logged_finish(self, pending, stream=None):
        finish(self, pending, stream)
        log.append(("waited", self.ubatch_id))

    monkeypatch.setattr(scheduler.UBatchState, "start_collective", logged_start)
    monkeypatch.setattr(scheduler.UBatchState, "finish_collective", logged_finish)
    monkeypatch.setattr(FakeGraph, "replay", lambda self: log.append(("segment", scheduler.current_ubatch_id())))
    md = step.attn_metadata[model.layer_names[0]]
    with torch.inference_mode():
        graphed.run(step.input_ids, step.positions, md, num_ubatches=2)
    starts = [i for i, (event, _) in enumerate(log) if event == "start"]
    assert len(starts) >= 2 * 2 * model.config.num_layers, log  # two collectives a layer, per ubatch
    for i in starts:
        ubatch = log[i][1]
        waited = log.index(("waited", ubatch), i)
        assert ("segment", 1 - ubatch) in log[i:waited], f"nothing of the other ubatch beside collective {i}: {log}"
