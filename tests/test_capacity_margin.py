"""Capacity factors measured from routing (ubatch.models.capacity): the fills, that the factors
they give drop nothing on the runs they came from (and that less would), and the bench flag."""

import json
import math
import re

import pytest
import torch

from tests.dist_utils import run_distributed
from ubatch.bench.cli import main, parse_args
from ubatch.bench.modes import dropped_share, eager_call
from ubatch.bench.workload import make_step
from ubatch.link import HostLink
from ubatch.models import ModelConfig, build_model
from ubatch.models.capacity import RoutingFill, measure_capacity, routing_fill
from ubatch.models.dispatch import balanced_chunk_rows
from ubatch.models.moe import MoEFFN
from ubatch.overlap import parse_modes

MODES = parse_modes("overlap,pipeline2,split2,split3,split2+join,split2+join+pipeline2")


def test_routing_fill_is_the_fullest_block_and_expert_over_their_balanced_shares():
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2]])  # 4 experts over 2 ranks: 0, 1 on rank 0
    # every token sends rank 0 one row, whichever of its experts are there: 4 rows, where a uniform
    # router's top-2 misses both of a rank's experts 1 time in 6 (share 10 / 3); expert 0 takes 3
    # assignments (share 2)
    assert routing_fill(ids, num_experts=4, world=2, chunks=1).tolist() == pytest.approx([1.2, 1.5])
    # two expert groups of one expert per rank: a row goes in the dispatch chunk of its earliest
    # group (chunk 0's share 2 of 4 tokens, chunk 1's 4 / 3) and comes back in the combine chunk
    # of its latest (the same shares reversed). Dispatch chunk 0 (its size also serves combine
    # chunk 1): rank 0 takes tokens 0-2 (3 of share 2), the combine chunk 1 rows of either rank
    # fill it less. Dispatch chunk 1 (and combine chunk 0): rank 0 takes token 3 (1 of share 4 /
    # 3), but its combine chunk 0, tokens 1 and 2, holds 2 of 4 / 3
    assert routing_fill(ids, num_experts=4, world=2, chunks=2).tolist() == pytest.approx([1.5, 1.5, 1.5])
    ids = torch.tensor([[0, 2], [0, 3], [0, 1], [0, 3]])  # rank 0's tokens 0, 1, 3 only in group 0
    # dispatch chunk 0: rank 0 all 4 tokens (4 of share 2), rank 1 token 0; chunk 1: rank 1 tokens
    # 1 and 3 (2 of 4 / 3); combine chunk 1 (latest group 1): rank 0 token 2, rank 1 tokens 1 and 3
    # (2 of share 2); combine chunk 0: rank 0 tokens 0, 1, 3 (3 of 4 / 3), rank 1 token 0
    assert routing_fill(ids, num_experts=4, world=2, chunks=2).tolist() == pytest.approx([2.0, 2.25, 2.0])


def test_the_layer_takes_a_factor_per_dispatch_chunk_where_one_is_set():
    config = ModelConfig.preset("tiny-deepseek", capacity_factor=1.2)
    layer = MoEFFN(config, 0, device=torch.device("cpu"))
    layer.chunk_capacity_factors = {2: (1.0, 2.0)}

    def expected(factors):
        shares = balanced_chunk_rows(400, config.num_experts, config.top_k, 1, len(factors))
        return [min(400, math.ceil(f * share)) for f, share in zip(factors, shares)]

    assert layer.capacity(400) == expected([1.2])
    layer.expert_chunks = 2
    assert layer.capacity(400) == expected([1.0, 2.0]) != expected([1.2, 1.2])
    layer.expert_chunks = 4  # no factors for four groups: capacity_factor for every chunk
    assert layer.capacity(400) == expected([1.2] * 4)
    layer.chunk_capacity_factors = {2: (1.0,)}
    layer.expert_chunks = 2
    with pytest.raises(ValueError, match=r"chunk_capacity_factors\[2\] must hold 2 factors, got \(1.0,\)"):
        layer.capacity(400)
    layer.chunk_capacity_factors = {2: (1.0, 2.0)}
    layer.shape_capacity_factors = {(2, 400): (1.5, 1.5), (2, 300): (1.5,)}  # a shape's own factors come first
    assert layer.capacity(400) == expected([1.5, 1.5]) and layer.capacity(200) == [
        min(200, math.ceil(f * share))
        for f, share in zip((1.0, 2.0), balanced_chunk_rows(200, config.num_experts, config.top_k, 1, 2))
    ]
    with pytest.raises(ValueError, match=r"shape_capacity_factors\[\(2, 300\)\] must hold 2 factors"):
        layer.capacity(300)


def test_the_padded_expert_gemm_takes_its_own_factor_where_one_is_set():
    layer = MoEFFN(ModelConfig.preset("tiny-moe", num_experts=8, capacity_factor=2.0), 0, device=torch.device("cpu"))
    assert layer.expert_capacity(num_tokens=200, num_rows=800) == 128  # 2.0 * 50 = 100 rows, rounded up to 128
    layer.expert_capacity_factor = 0.5
    assert layer.expert_capacity(num_tokens=200, num_rows=800) == 64  # 25 rows, rounded up to 64
    layer.capacity_factor = None
    assert layer.expert_capacity(num_tokens=200, num_rows=800) is None, "no row may be dropped at all"


def _mode_runs(model, step):
    return [eager_call(model, step, mode) for mode in MODES]


def test_measured_factors_drop_nothing_on_the_runs_they_came_from_and_less_would():
    model = build_model(ModelConfig.preset("tiny-deepseek", capacity_factor=3.0), device="cpu")
    # enough tokens that a block of the expert groups' smallest chunk (a token's top-4 misses 8 of
    # the 16 experts 1 time in 26) holds a few rows, or rounding up keeps any smaller factor whole
    step, _ = make_step(model, [1] * 128 + [9, 7], [5] * 128 + [0, 3])
    measured = measure_capacity(model, _mode_runs(model, step), margin=1.0)
    assert all(
        layer.capacity_factor == 3.0 and layer.expert_capacity_factor is None for layer in model.moe_layers.values()
    ), "measuring leaves the model's factors as they were"
    assert measured.dispatch >= measured.dispatch_fill > 0 and measured.expert >= measured.expert_fill > 1
    assert measured.dispatch - measured.dispatch_fill < 0.05 and measured.margin == 1.0
    # the two-group modes' chunks have factors of their own, each from its own fill
    assert list(measured.chunk_dispatch) == [2] and len(measured.chunk_dispatch[2]) == 2
    assert all(f >= max(fill, 1.0) for f, fill in zip(measured.chunk_dispatch[2], measured.chunk_dispatch_fill[2]))
    measured.apply(model)
    layers = list(model.moe_layers.values())
    assert all(layer.chunk_capacity_factors == measured.chunk_dispatch for layer in layers)
    assert all(layer.shape_capacity_factors == measured.shape_dispatch for layer in layers)
    grouped = [eager_call(model, step, mode) for mode in MODES if mode.expert_chunks == 2]

    def shrunk(keep_groups: int) -> dict:
        """Every measured shape's factors at 0.7x its fill, but those of ``keep_groups`` groups."""
        return {
            shape: factors if shape[0] == keep_groups else tuple(0.7 * f for f in measured.shape_dispatch_fill[shape])
            for shape, factors in measured.shape_dispatch.items()
        }

    with torch.inference_mode():
        assert [dropped_share(model, run, step) for run in _mode_runs(model, step)] == [0.0] * len(MODES)
        for layer in layers:
            layer.shape_capacity_factors = shrunk(keep_groups=1)
        assert sum(dropped_share(model, run, step) for run in grouped) > 0, "the chunk factors size the groups"
        for layer in layers:
            layer.shape_capacity_factors = shrunk(keep_groups=2)
        assert sum(dropped_share(model, run, step) for run in _mode_runs(model, step)) > 0


def test_each_call_size_gets_the_factor_its_own_routing_asks_for():
    """A split's ubatches route fewer tokens each and fill their blocks more unevenly: their factor
    must not become the unsplit step's (which would send the split's padding), and a size that was
    not measured falls back to the largest factor."""
    # as one rank of four (the link stand-in), so a rank's blocks hold a share of its tokens
    link = HostLink(4, bandwidth_gbps=1000.0)
    model = build_model(ModelConfig.preset("tiny-deepseek", capacity_factor=3.0), device="cpu", ep_group=link)
    step, _ = make_step(model, [1] * 128 + [9, 7], [5] * 128 + [0, 3])  # 144 tokens
    modes = parse_modes("overlap,split2,split3,tokens4")  # the unsplit step first; tokens4 cuts its blocks
    measured = measure_capacity(model, [eager_call(model, step, mode) for mode in modes], margin=1.0)
    assert sorted(measured.shape_dispatch) == [(1, 48), (1, 72), (1, 144)]
    fills = {tokens: measured.shape_dispatch_fill[1, tokens][0] for _, tokens in measured.shape_dispatch}
    assert measured.dispatch_fill == max(fills.values()) and measured.dispatch >= max(fills.values())
    assert fills[144] < max(fills[48], fills[72]), "fewer tokens per call fill their blocks more unevenly"
    measured.apply(model)
    layer = next(iter(model.moe_layers.values()))
    for tokens, fill in fills.items():
        factor = measured.shape_dispatch[1, tokens][0]
        assert fill <= factor < max(fill, 1.0) + 0.05
        assert layer.capacity(tokens) == [math.ceil(factor * balanced_chunk_rows(tokens, 16, 4, 4, 1)[0])]
    assert layer.capacity(100) == [math.ceil(measured.dispatch * balanced_chunk_rows(100, 16, 4, 4, 1)[0])]
    report = measured.report()
    assert list(report["shape_dispatch"]) == ["1:48", "1:72", "1:144"]
    with torch.inference_mode():
        assert [dropped_share(model, eager_call(model, step, m), step) for m in modes] == [0.0] * len(modes)


def test_measuring_needs_a_moe_model_a_run_and_a_margin_of_at_least_one():
    with pytest.raises(ValueError, match="needs a MoE model"):
        RoutingFill(build_model(ModelConfig.preset("tiny"), device="cpu"))
    model = build_model(ModelConfig.preset("tiny-deepseek"), device="cpu")
    with pytest.raises(RuntimeError, match="recorded no MoE layer call"):
        measure_capacity(model, [])
    with pytest.raises(ValueError, match="margin must be a number >= 1, got 0.9"):
        measure_capacity(model, [], margin=0.9)


def test_bench_measures_the_capacity_over_every_mode_before_timing_them(tmp_path, capsys):
    out = tmp_path / "modes.json"
    main(
        [
            "--device",
            "cpu",
            "--preset",
            "tiny-deepseek",
            "--modes",
            "pipeline2,split2,split2+join",
            "--capacity-factor",
            "measured:1.1",
            "--tokens",
            "32,64",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    capacity = report["setup"]["capacity"]
    assert capacity["margin"] == 1.1 and capacity["dispatch"] >= 1.1 * capacity["dispatch_fill"] - 1e-9
    assert list(capacity["chunk_dispatch"]) == ["2"] and len(capacity["chunk_dispatch"]["2"]) == 2
    assert [r["dropped_fraction"] for r in report["results"]] == [0.0] * 8
    assert list(capacity["shape_dispatch"]) == ["1:16", "1:32", "1:64", "2:32", "2:64"]  # split2's halves, pipeline2
    assert "capacity factors" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--capacity-factor", "measured"], "is measured over the modes of a --modes run"),
        (["--capacity-factor", "measured:0.5", "--modes", "split2"], "MARGIN >= 1"),
        (["--capacity-factor", "lots", "--modes", "split2"], "a positive number"),
    ],
)
def test_bench_refuses_a_measured_capacity_it_cannot_measure(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--device", "cpu", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def _fills_are_the_largest_over_ranks(rank, world):
    """Each rank records its own routing (its own tokens, as many as the other rank's); fills()
    returns, per call shape (expert groups, tokens) and chunk, the largest fill of either rank, on
    both."""
    model = build_model(ModelConfig.preset("tiny-deepseek"), device="cpu")
    layer = next(iter(model.moe_layers.values()))
    recorder = RoutingFill(model)
    g = torch.Generator().manual_seed(rank)
    shapes = [(1, 24), (2, 24), (1, 64)]
    own = {}
    with recorder, torch.no_grad():
        for chunks, tokens in shapes:
            x = torch.randn(tokens, layer.router.shape[1], generator=g)
            layer.expert_chunks = chunks
            layer(x)
            own[chunks, tokens] = routing_fill(layer.route(x)[1], layer.num_local_experts, 1, chunks).tolist()
    shape_fills, expert_fill = recorder.fills()
    both = [None, None]
    torch.distributed.all_gather_object(both, own)
    assert sorted(shape_fills) == sorted(shapes)
    for shape in shapes:
        largest = [max(a, b) for a, b in zip(both[0][shape], both[1][shape])]
        assert shape_fills[shape] == pytest.approx(tuple(largest[: shape[0]]))
    assert expert_fill == pytest.approx(max(fills[shape][-1] for fills in both for shape in shapes))


def test_fills_are_the_largest_over_the_ranks():
    run_distributed(_fills_are_the_largest_over_ranks, 2)


def _ranks_that_measured_different_shapes(rank, world):
    model = build_model(ModelConfig.preset("tiny-deepseek"), device="cpu")
    layer = next(iter(model.moe_layers.values()))
    layer.expert_chunks = 1 + rank
    recorder = RoutingFill(model)
    with recorder, torch.no_grad():
        layer(torch.randn(16, layer.router.shape[1]))
    shapes = re.escape("calls of different shapes (expert groups, tokens): [[(1, 16)], [(2, 16)]]")
    with pytest.raises(RuntimeError, match=shapes):
        recorder.fills()


def test_ranks_that_measured_different_shapes_get_an_error_not_a_hang():
    run_distributed(_ranks_that_measured_different_shapes, 2)


def test_the_unsplit_step_sends_the_same_bytes_whatever_modes_were_measured_beside_it():
    """A probe of the unsplit step alone and a sweep of it beside splits must time one payload:
    measuring the splits too must not grow the unsplit step's padding."""
    link = HostLink(4, bandwidth_gbps=1000.0)
    model = build_model(ModelConfig.preset("tiny-deepseek", capacity_factor=3.0), device="cpu", ep_group=link)
    step, _ = make_step(model, [1] * 128 + [9, 7], [5] * 128 + [0, 3])
    unsplit = eager_call(model, step, parse_modes("overlap")[0])
    sent = []
    for modes in ("overlap", "overlap,split2,split3"):
        measure_capacity(model, [eager_call(model, step, m) for m in parse_modes(modes)]).apply(model)
        before = link.bytes_moved
        with torch.inference_mode():
            unsplit()
        sent.append(link.bytes_moved - before)
    assert sent[0] == sent[1] > 0
