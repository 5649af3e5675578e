"""Every overlap mode equals the plain unsplit step: single-batch overlap (one slice run as a
ubatch), expert pipelining (``expert_chunks``), token chunks through the experts
(``token_chunks``), token splits, splits with joined expert stages,
own rows first, and their combinations, in one process, expert-parallel over two gloo ranks and
over the link stand-in; the shared experts run while the dispatch is in flight, and so do the
GEMMs of the rows a rank routes to its own experts.

Tolerance: float32 on CPU, atol = rtol = 1e-5 (GEMMs over other row counts or expert groups may
block their sums differently).
"""

import itertools
import math
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.test_ubatch_models import _forward
from ubatch import comm, split_batch
from ubatch.bench.workload import make_step
from ubatch.context import static_collectives
from ubatch.link import HostLink
from ubatch.models import ModelConfig, build_model
from ubatch.models.dispatch import dispatch_plan
from ubatch.models.layers import row_parallel
from ubatch.models.moe import MoEFFN
from ubatch.overlap import OverlapMode, apply_mode, supported
from ubatch.wrapper import UBatchWrapper

TOL = dict(atol=1e-5, rtol=1e-5)
CONFIG = dict(num_experts=8, top_k=2, moe_intermediate_size=48, num_shared_experts=1)


def _set_chunks(model, chunks: int) -> None:
    for layer in model.moe_layers.values():
        layer.expert_chunks = chunks


def check_modes_equal_unsplit(model, seed: int, names: str, rank: int = 0) -> None:
    """Every mode of ``names`` against the unsplit step, on a batch drawn from ``seed``; over
    several ranks every rank has the batch's shape (the same collectives) but its own tokens."""
    rng = random.Random(seed)
    n = rng.randint(3, 7)
    query_lens = [rng.choice([1, rng.randint(2, 9)]) for _ in range(n)]
    context_lens = [rng.choice([0, rng.randint(1, 15)]) for _ in range(n)]
    step, cache = make_step(model, query_lens, context_lens, block_size=4, seed=100 * seed + rank)
    before = {name: cache[name].clone() for name in model.layer_names}
    apply_mode(model, OverlapMode())
    expected = _forward(model, model, step)
    wrapper = UBatchWrapper(model, num_ubatches=3, device=model.device)
    for mode in map(OverlapMode.parse, names.split(",")):
        for name in model.layer_names:
            cache[name].copy_(before[name])
        apply_mode(model, mode)
        got = _forward(wrapper, model, step, split_batch(query_lens, mode.num_ubatches))
        torch.testing.assert_close(got, expected, **TOL, msg=lambda m: f"{mode.name}: {m}")
    apply_mode(model, OverlapMode())


MODES = (
    "overlap,pipeline2,pipeline4,split2,split2+pipeline2,split3+pipeline4,split2+join,split3+join+pipeline2,"
    "split2+local,tokens2,tokens4,split2+tokens3,tokens3+local"
)


@pytest.mark.parametrize("seed", range(3))
def test_overlap_modes_equal_unsplit_one_process(seed):
    model = build_model(ModelConfig(**CONFIG), device="cpu")
    check_modes_equal_unsplit(model, seed, MODES)


def _modes_over_ep(rank: int, world: int) -> None:
    model = build_model(ModelConfig(**CONFIG), device="cpu", ep_group=dist.group.WORLD)
    for seed in range(2):
        check_modes_equal_unsplit(
            model,
            seed,
            "overlap,pipeline2,pipeline4,split2+pipeline2,split3,split2+join,split3+join+pipeline4,"
            "local,split2+local,pipeline2+local,split3+join+pipeline2+local,tokens2,split2+tokens2,"
            "tokens3+local,split2+tokens2+local",
            rank,
        )
    # the static dispatch (a capacity no row exceeds): each rank places the other's rows at the
    # return positions they carry, per expert group
    static = build_model(ModelConfig(**CONFIG, capacity_factor=8.0), device="cpu", ep_group=dist.group.WORLD)
    check_modes_equal_unsplit(
        static,
        0,
        "pipeline2,pipeline4,split2+join+pipeline2,pipeline2+local,tokens2,tokens3,split2+tokens2+local,tokens4+local",
        rank,
    )


def test_overlap_modes_equal_unsplit_expert_parallel():
    run_distributed(_modes_over_ep, world_size=2)


def test_expert_chunks_must_divide_local_experts():
    layer = next(iter(build_model(ModelConfig(**CONFIG), device="cpu").moe_layers.values()))
    for bad in (0, 3, True, 2.0):
        with pytest.raises(ValueError, match="expert_chunks"):
            layer.expert_chunks = bad


def test_capacity_is_per_expert_group():
    layer = next(iter(build_model(ModelConfig(**CONFIG, capacity_factor=1.5), device="cpu").moe_layers.values()))
    assert layer.capacity(64) == [64]  # every token has its experts in the one chunk: 1.5 * 64, capped at 64
    layer.expert_chunks = 4
    # chunk c: a token's top-2 misses groups 0..c-1 (2 of the 8 experts each) and hits group c
    missed = [math.comb(8 - 2 * c, 2) / 28 for c in range(5)]
    expected = [math.ceil(1.5 * 64 * (missed[c] - missed[c + 1])) for c in range(4)]
    assert layer.capacity(64) == expected == [45, 31, 18, 4]


def test_shared_experts_run_while_the_dispatch_is_in_flight(monkeypatch):
    """Single-batch overlap: every group's dispatch starts, the shared experts run, and only then
    does the layer wait for the first dispatch. (Over two ranks: one rank's dispatch is no
    collective, its rows are received where they were sent.)"""
    model = build_model(ModelConfig(**CONFIG), device="cpu", ep_group=HostLink(2, bandwidth_gbps=50.0))
    _set_chunks(model, 2)
    events = []
    start, wait = comm.all_to_all_single, comm.CollectiveHandle.wait
    monkeypatch.setattr(comm, "all_to_all_single", lambda *a, **k: events.append("start") or start(*a, **k))
    monkeypatch.setattr(comm.CollectiveHandle, "wait", lambda self: events.append("wait") or wait(self))
    layer = next(iter(model.moe_layers.values()))
    layer.shared.register_forward_hook(lambda *_: events.append("shared"))
    step, _ = make_step(model, [5, 3], [0, 4], block_size=4)
    _forward(UBatchWrapper(model, num_ubatches=2), model, step, split_batch([5, 3], 1))
    first_layer = events[: events.index("shared") + 2]
    assert first_layer == ["start"] * 3 + ["shared", "wait"], events  # the row counts' exchange, a dispatch per group


@pytest.mark.parametrize("name", ["split2+join", "split3+join+pipeline2"])
def test_joined_stages_run_the_shared_experts_once_over_every_ubatch(name):
    """With joined expert stages the shared experts run in the joined stage, once a layer over
    every ubatch's rows (their weights read once, while the last dispatch is in flight), and the
    step still equals unsplit; a split without joining runs them per ubatch."""
    model = build_model(ModelConfig(**CONFIG), device="cpu", ep_group=HostLink(2, bandwidth_gbps=50.0))
    calls = []
    for layer in model.moe_layers.values():
        layer.shared.register_forward_hook(lambda module, args, out: calls.append(len(args[0])))
    query_lens = [5, 3, 4, 2]
    step, cache = make_step(model, query_lens, [0, 4, 2, 7], block_size=4)
    before = {layer: cache[layer].clone() for layer in model.layer_names}
    expected = _forward(model, model, step)
    wrapper = UBatchWrapper(model, num_ubatches=3)
    layers = len(model.moe_layers)
    for mode, per_layer in ((OverlapMode.parse(name), [14]), (OverlapMode.parse("split2"), [7, 7])):
        for layer in model.layer_names:
            cache[layer].copy_(before[layer])
        apply_mode(model, mode)
        calls.clear()
        got = _forward(wrapper, model, step, split_batch(query_lens, mode.num_ubatches))
        torch.testing.assert_close(got, expected, **TOL)
        assert calls == per_layer * layers, (mode.name, calls)
    apply_mode(model, OverlapMode())


@pytest.mark.parametrize("capacity_factor", [2.0, None])  # the static dispatch and the counted one
def test_token_chunks_start_every_dispatch_before_the_first_expert_gemm(monkeypatch, capacity_factor):
    """tokens2: both chunks' dispatches start (the counted dispatch after one exchange of both
    chunks' counts), then the shared experts run; chunk 0's GEMMs run once its dispatch is waited
    and its combine starts before chunk 1's GEMMs, so those run while chunk 0's rows travel back."""
    model = build_model(
        ModelConfig(**CONFIG, capacity_factor=capacity_factor), device="cpu", ep_group=HostLink(2, 50.0)
    )
    apply_mode(model, OverlapMode.parse("tokens2"))
    layer = next(iter(model.moe_layers.values()))
    events = []
    start, wait, experts = comm.all_to_all_single, comm.CollectiveHandle.wait, type(layer)._experts

    def started(*args, **kwargs):
        events.append("start" if kwargs.get("async_op") else "counts")
        return start(*args, **kwargs)

    monkeypatch.setattr(comm, "all_to_all_single", started)
    monkeypatch.setattr(comm.CollectiveHandle, "wait", lambda self: events.append("wait") or wait(self))
    monkeypatch.setattr(type(layer), "_experts", lambda self, *a: events.append("gemm") or experts(self, *a))
    for moe in model.moe_layers.values():
        moe.shared.register_forward_hook(lambda *_: events.append("shared"))
    step, _ = make_step(model, [5, 3], [0, 4], block_size=4)
    _forward(UBatchWrapper(model, num_ubatches=2), model, step, split_batch([5, 3], 1))
    per_layer = ["start", "start", "shared", "wait", "gemm", "start", "wait", "gemm", "start", "wait", "wait"]
    per_layer = (["counts"] if capacity_factor is None else []) + per_layer
    assert events == per_layer * model.config.num_layers, events
    apply_mode(model, OverlapMode())


def test_token_chunks_cannot_join_expert_stages_or_cut_expert_groups():
    with pytest.raises(ValueError, match="token_chunks=2"):
        OverlapMode.parse("split2+join+tokens2")
    with pytest.raises(ValueError, match="expert_chunks=2, token_chunks=4"):
        OverlapMode.parse("pipeline2+tokens4")
    model = build_model(ModelConfig(**CONFIG), device="cpu")
    layer = next(iter(model.moe_layers.values()))
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="token_chunks"):
            layer.token_chunks = bad
    layer.expert_chunks, layer.token_chunks = 2, 2  # set one by one, as a mode switch does: refused when run
    with pytest.raises(ValueError, match="token_chunks=2 cuts the expert stage"):
        layer(torch.randn(4, model.config.hidden_size))


@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_static_token_chunks_send_the_unsplit_steps_rows_cut_into_runs(chunks):
    """Under a capacity, token chunks cut every destination's block of the unsplit step into runs:
    they move its bytes (its capacity rounded up to a multiple of the chunks), where chunks of the
    tokens would each pad for their own fullest block, and the outputs equal the unsplit step's."""
    moved = {}
    for mode in ("unsplit", f"tokens{chunks}"):
        link = HostLink(4, bandwidth_gbps=1000.0)
        model = build_model(ModelConfig(**CONFIG, capacity_factor=1.5), device="cpu", ep_group=link)
        layer = next(iter(model.moe_layers.values()))
        apply_mode(model, OverlapMode.parse(mode))
        x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            moved[mode] = (layer(x), link.bytes_moved)
    cap = layer.capacity(40)[0]
    (expected, unsplit_bytes), (got, chunked_bytes) = moved.values()
    torch.testing.assert_close(got, expected, **TOL)
    assert chunked_bytes == unsplit_bytes * math.ceil(cap / chunks) * chunks / cap


LINK_MODES = (
    "overlap,pipeline2,split2,split2+pipeline2,split2+join+pipeline2,local,split2+local,split2+join+local,tokens2,"
    "split2+tokens2"
)


@pytest.mark.parametrize(
    "world_size, names, capacity_factor",
    [
        (2, LINK_MODES, None),
        (4, LINK_MODES, None),
        (8, "overlap,split2,split3,split2+join,split3+join,local,split2+local,tokens2,tokens4,split2+tokens2", None),
        (8, "tokens2,tokens3,tokens4+local,split2+tokens2,split3+tokens2+local", 8.0),
    ],
)
def test_overlap_modes_equal_unsplit_over_the_link_stand_in(world_size, names, capacity_factor):
    """Over a host link each rank holds 1/W of the experts and moves a W-rank world's bytes; its
    values are one rank's, the same in every mode (with W = 8 a rank holds one expert: no groups);
    with a capacity factor, through the static dispatch."""
    link = HostLink(world_size, bandwidth_gbps=50.0)
    model = build_model(ModelConfig(**CONFIG, capacity_factor=capacity_factor), device="cpu", ep_group=link)
    assert next(iter(model.moe_layers.values())).num_local_experts == 8 // world_size
    check_modes_equal_unsplit(model, 3, names)
    assert link.bytes_moved > 0


@pytest.mark.parametrize("capacity_factor", [None, 2.0])  # the counted dispatch and the static one
def test_own_rows_run_before_the_dispatch_is_waited(monkeypatch, capacity_factor):
    """Own rows first: the first expert GEMM of a layer takes this rank's rows to its own experts
    before the dispatch is waited, the second the other ranks' rows; together every received row."""
    link = HostLink(2, bandwidth_gbps=50.0)
    model = build_model(ModelConfig(**CONFIG, capacity_factor=capacity_factor), device="cpu", ep_group=link)
    apply_mode(model, OverlapMode.parse("local"))
    layer = next(iter(model.moe_layers.values()))
    events = []
    experts, wait = type(layer)._experts, comm.CollectiveHandle.wait
    monkeypatch.setattr(type(layer), "_experts", lambda self, x, *a: events.append(len(x)) or experts(self, x, *a))
    monkeypatch.setattr(comm.CollectiveHandle, "wait", lambda self: events.append("wait") or wait(self))
    routed = []
    layer.register_forward_pre_hook(lambda module, args: routed.append(module.route(args[0])[1]))
    step, _ = make_step(model, [5, 3], [0, 4], block_size=4)
    _forward(UBatchWrapper(model, num_ubatches=2), model, step, split_batch([5, 3], 1))
    own, waited, peers = events[:3]
    assert waited == "wait" and own > 0 and peers > 0, events
    # Counted: one row per token and destination rank holding any of its experts (over the
    # stand-in, a world of one, the rows for the other rank come back as if it had sent them);
    # static: every block at its capacity.
    destinations = routed[0] // layer.num_local_experts
    real = sum(int((destinations == rank).any(dim=1).sum()) for rank in range(2))
    assert own + peers == (real if capacity_factor is None else layer.capacity(8)[0] * 2)
    apply_mode(model, OverlapMode())


TP_MODES = "allreduce2,allreduce4,split2+allreduce2,split3+allreduce3"


def _tp_modes(rank: int, world: int) -> None:
    model = build_model(ModelConfig.preset("tiny"), device="cpu", tp_group=dist.group.WORLD)
    for seed in range(2):
        check_modes_equal_unsplit(model, seed, TP_MODES)  # tensor-parallel ranks run one batch


def test_chunked_all_reduce_modes_equal_unsplit_tensor_parallel():
    run_distributed(_tp_modes, world_size=2)


def test_chunked_all_reduce_modes_equal_unsplit_over_the_link_stand_in():
    link = HostLink(2, bandwidth_gbps=50.0)
    model = build_model(ModelConfig.preset("tiny"), device="cpu", tp_group=link)
    check_modes_equal_unsplit(model, 1, TP_MODES)
    assert link.bytes_moved > 0


def test_every_chunk_of_a_row_parallel_all_reduce_starts_before_the_first_is_waited(monkeypatch):
    """allreduce2: per projection, both chunks' GEMMs and all-reduces are issued before the
    first wait, so the second chunk's GEMM runs while the first chunk's all-reduce is in flight."""
    model = build_model(ModelConfig.preset("tiny"), device="cpu", tp_group=HostLink(2, bandwidth_gbps=50.0))
    apply_mode(model, OverlapMode.parse("allreduce2"))
    events = []
    start, wait = comm.all_reduce, comm.CollectiveHandle.wait
    monkeypatch.setattr(comm, "all_reduce", lambda *a, **k: events.append("start") or start(*a, **k))
    monkeypatch.setattr(comm.CollectiveHandle, "wait", lambda self: events.append("wait") or wait(self))
    step, _ = make_step(model, [5, 3], [0, 4], block_size=4)
    _forward(UBatchWrapper(model, num_ubatches=2), model, step, split_batch([5, 3], 1))
    per_layer = ["start", "start", "wait", "wait"] * 2  # the attention's output projection, the MLP's down
    assert events == per_layer * model.config.num_layers, str(events)
    apply_mode(model, OverlapMode())


def test_chunked_all_reduce_needs_a_tensor_parallel_model():
    model = build_model(ModelConfig(**CONFIG), device="cpu")
    with pytest.raises(ValueError, match="mode allreduce2 needs a tensor-parallel model"):
        apply_mode(model, OverlapMode.parse("allreduce2"))
    assert supported(model, [OverlapMode(), OverlapMode.parse("allreduce2")]) == [OverlapMode()]


def test_putting_the_mode_in_force_again_sets_nothing(monkeypatch):
    """A runner under a mode policy applies a mode every step: where the layers already hold it,
    no (slow) nn.Module attribute write happens."""
    model = build_model(ModelConfig(**CONFIG), device="cpu")
    mode = OverlapMode.parse("split2+join+pipeline2+local")
    apply_mode(model, mode)
    writes = []
    layer_type = type(next(iter(model.moe_layers.values())))
    real = layer_type.__setattr__
    monkeypatch.setattr(
        layer_type, "__setattr__", lambda self, name, value: writes.append(name) or real(self, name, value)
    )
    apply_mode(model, mode)
    assert writes == []
    apply_mode(model, OverlapMode())
    assert sorted(set(writes)) == ["_expert_chunks", "expert_chunks", "join_ubatches", "local_first"]
    writes.clear()
    apply_mode(model, OverlapMode.parse("tokens2"))
    assert sorted(set(writes)) == ["_token_chunks", "token_chunks"]


@pytest.mark.parametrize("chunks", [1, 2, 4, 32])
def test_row_parallel_takes_any_leading_dims_and_more_chunks_than_rows(chunks):
    """``row_parallel`` for a model's own projections: [..., in] inputs, any chunk count (more
    chunks than rows runs unchunked); over the link (one rank's values) it is ``x @ w.T``."""
    x, weight = torch.randn(3, 5, 8), torch.randn(6, 8)
    got = row_parallel(x, weight, HostLink(2, bandwidth_gbps=50.0), chunks)
    assert got.shape == (3, 5, 6)
    torch.testing.assert_close(got, x @ weight.T, **TOL)


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("capacity_factor", [0.7, 1.2, None])
def test_every_kept_row_comes_back_where_its_sender_looks_for_it(chunks, capacity_factor):
    """Expert groups over the link stand-in (world 2) with blocks too small for some rows: each
    token gets exactly its experts on the ranks whose rows the plan kept (the expert side placed
    every row at the return position its sender computed), and every expert of a dropped row is
    counted."""
    config = ModelConfig.preset("tiny-deepseek", capacity_factor=capacity_factor)
    layer = MoEFFN(config, 0, device=torch.device("cpu"), ep_group=HostLink(2, 1e6, device="cpu"))
    layer.use_grouped_mm = False
    layer.expert_chunks = chunks
    x = torch.randn(40, config.hidden_size, generator=torch.Generator().manual_seed(chunks))
    weights, ids = layer.route(x)
    caps = layer.capacity(len(x))
    tables, _ = layer._static_layout(caps, x.device)
    n_local = layer.num_local_experts
    back_slot, dropped, _ = dispatch_plan(x, ids, weights, n_local, chunks, 2, tuple(caps), tables)
    with torch.no_grad(), static_collectives():
        out = layer(x)
        expected = layer.shared(x)
        for t, j in itertools.product(range(len(x)), range(config.top_k)):
            rank, local = divmod(int(ids[t, j]), n_local)  # the stand-in's peer runs our experts
            if back_slot[t, rank] >= 0:
                gate, up = (layer.w13[local] @ x[t]).chunk(2)
                expected[t] += weights[t, j] * (layer.w2[local] @ (F.silu(gate) * up))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert int(layer.overflow_count) == int(dropped)
    if capacity_factor is None:
        assert int(dropped) == 0
    elif capacity_factor < 1:
        assert int(dropped) > 0
