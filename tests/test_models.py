"""Reference models: config validation, the layers (RMSNorm, rotary, attention block) and MoE
dispatch against direct computations, and tensor / expert parallelism over gloo matching the
single-process model."""

from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.interpreted import run_interpreted
from tests.reference import forward_sequences
from ubatch.bench.workload import make_step
from ubatch.context import capture_scope, set_forward_context, static_collectives
from ubatch.link import HostLink
from ubatch.models import DenseDecoder, ModelConfig, MoEDecoder, build_model, expert_compute
from ubatch.models.dispatch import dispatch_row_width
from ubatch.models.layers import RMSNorm, RotaryEmbedding
from ubatch.models.moe import MoEFFN
from ubatch.proxy_link import ProxyLink

# ----- config ---------------------------------------------------------------------------------


def test_presets_and_kind():
    assert ModelConfig.preset("tiny").kind == "dense"
    moe = ModelConfig.preset("moe-bench")
    assert (moe.kind, moe.hidden_size, moe.num_experts, moe.top_k) == ("moe", 4096, 8, 2)
    assert ModelConfig.preset("dense-bench").dtype == torch.bfloat16
    assert ModelConfig.preset("tiny", dtype="bf16", seed=3).dtype == torch.bfloat16
    assert ModelConfig.preset("tiny-moe-shared").num_shared_experts == 1


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(hidden_size=0), r"hidden_size must be an integer >= 1, got 0"),
        (dict(num_layers=2.5), r"num_layers .* got 2\.5"),
        (dict(num_heads=4, num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        (dict(head_dim=15), r"head_dim must be even.*15"),
        (dict(rms_eps=0.0), r"rms_eps must be > 0, got 0\.0"),
        (dict(dtype="int8"), r"dtype .* got 'int8'"),
        (dict(num_experts=4, top_k=5, moe_intermediate_size=8), r"top_k must be in \[1, num_experts=4\], got 5"),
        (dict(num_experts=4, top_k=2, moe_intermediate_size=0), r"moe_intermediate_size .* got 0"),
        (
            dict(num_experts=4, top_k=2, moe_intermediate_size=8, capacity_factor=0.0),
            r"capacity_factor must be > 0 or None, got 0\.0",
        ),
        (dict(num_experts=-1), r"num_experts must be an integer >= 0, got -1"),
    ],
)
def test_bad_config_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.preset("tiny", **overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'"):
        ModelConfig.preset("huge")


def test_build_model_dispatches_on_kind():
    assert type(build_model(ModelConfig.preset("tiny"), device="cpu")) is DenseDecoder
    model = build_model(ModelConfig.preset("tiny-moe"), device="cpu")
    assert type(model) is MoEDecoder
    assert model.layer_names == ["layers.0.attn", "layers.1.attn"]
    assert set(model.attention_layers) == set(model.layer_names)
    assert set(model.overflow_counters()) == {"layers.0.moe", "layers.1.moe"}


def test_weights_are_deterministic_from_seed():
    a = build_model(ModelConfig.preset("tiny-moe"), device="cpu").state_dict()
    b = build_model(ModelConfig.preset("tiny-moe"), device="cpu").state_dict()
    c = build_model(ModelConfig.preset("tiny-moe", seed=1), device="cpu").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed"], c["embed"])


# ----- layers against direct computations -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_float64_formula(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, 1e-5, dtype=dtype, device=torch.device("cpu"))
    norm.weight.data = torch.randn(48, generator=g).to(dtype)
    x = (torch.randn(9, 48, generator=g) * 3).to(dtype)
    xd = x.double()
    expected = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    out = norm(x)
    assert out.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), expected, **tol)


def _rotate_complex(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Neox rotary as complex multiplication: element i pairs with element i + head_dim / 2."""
    heads = x.double().unflatten(-1, (-1, head_dim))
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    turn = torch.polar(torch.ones(len(positions), half, dtype=torch.float64), positions.double()[:, None] * freqs)
    z = torch.complex(heads[..., :half], heads[..., half:]) * turn[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1).flatten(1)


def test_rotary_matches_complex_rotation_and_keeps_relative_positions():
    head_dim, theta = 16, 10000.0
    rotary = RotaryEmbedding(head_dim, theta, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 37, 1000, 4095])
    x = torch.randn(len(positions), 3 * head_dim, generator=g)
    # float32 angles carry an absolute error of about position * 6e-8 radians (2.4e-4 at 4095).
    torch.testing.assert_close(
        rotary.rotate(positions, x).double(), _rotate_complex(x, positions, head_dim, theta), atol=1e-3, rtol=0
    )
    # Rotating query and key heads together equals rotating them apart.
    q, k = x[:, : 2 * head_dim], x[:, 2 * head_dim :]
    both = rotary.rotate(positions, x)
    torch.testing.assert_close(both, torch.cat([rotary.rotate(positions, q), rotary.rotate(positions, k)], dim=1))
    # A query-key score depends only on the distance between their positions.
    qv, kv = torch.randn(1, head_dim, generator=g), torch.randn(1, head_dim, generator=g)
    scores = [
        (rotary.rotate(torch.tensor([m]), qv) * rotary.rotate(torch.tensor([n]), kv)).sum()
        for m, n in [(3, 1), (10, 8), (1002, 1000)]
    ]
    torch.testing.assert_close(scores[1], scores[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(scores[2], scores[0], atol=1e-4, rtol=1e-4)


def test_attention_block_matches_direct_causal_attention():
    """One layer's attention block (fused QKV, rotary, paged cache, GQA, output projection) on
    two prompts, against dense causal softmax attention written out per request."""
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    block = model.layers[0].attn
    lengths = [5, 11]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lengths), config.hidden_size, generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    d, heads, kv_heads = config.head_dim, config.num_heads, config.num_kv_heads
    wq, wk, wv = block.qkv.split([heads * d, kv_heads * d, kv_heads * d])
    q = _rotate_complex(x @ wq.T, positions, d, config.rope_theta).view(-1, heads, d)
    k = _rotate_complex(x @ wk.T, positions, d, config.rope_theta).view(-1, kv_heads, d)
    v = (x @ wv.T).double().view(-1, kv_heads, d)
    expected, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n] for t in (q, k, v))
        ks, vs = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (ks, vs))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        expected.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).flatten(1))
        start += n
    expected = torch.cat(expected) @ block.o_proj.double().T

    step, _ = make_step(model, lengths)  # a fresh cache bound to the layers, metadata for the prompts
    assert torch.equal(step.positions, positions)
    with torch.inference_mode(), set_forward_context(step.attn_metadata, no_compile_layers=model.attention_layers):
        out = block(x, step.positions)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe-shared"])
def test_decoder_is_the_pre_norm_residual_stack(preset):
    """The decoder's forward (each residual add folded into the next norm) against the blocks
    composed as written: h = x + attn(norm1(x)), x = h + ffn(norm2(h)), then the final norm."""
    config = ModelConfig.preset(preset, num_layers=3)
    model = build_model(config, device="cpu")
    lengths = [4, 7]
    step, _ = make_step(model, lengths, seed=1)
    with torch.inference_mode(), set_forward_context(step.attn_metadata, no_compile_layers=model.attention_layers):
        x = F.embedding(step.input_ids, model.embed)
        for layer in model.layers:
            h = x + layer.attn(layer.input_norm(x), step.positions)
            x = h + layer.ffn(layer.post_attn_norm(h))
        expected = model.norm(x)
    step, _ = make_step(model, lengths, seed=1)  # a fresh cache: the pass above wrote its K and V
    with torch.inference_mode(), set_forward_context(step.attn_metadata, no_compile_layers=model.attention_layers):
        out = model(step.input_ids, step.positions)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


# ----- MoE dispatch ---------------------------------------------------------------------------


def dense_reference_moe(layer: MoEFFN, x: torch.Tensor) -> torch.Tensor:
    """Every token through its top-k experts, computed directly (one rank holds all experts)."""
    probs = (x.float() @ layer.router.T).softmax(-1)
    weights, ids = probs.topk(layer.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(layer.top_k):
            e = int(ids[t, j])
            gate, up = (layer.w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (layer.w2[e] @ (F.silu(gate) * up))
    if layer.shared is not None:
        out += layer.shared(x)
    return out.to(x.dtype)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-shared", "tiny-deepseek"])
@pytest.mark.parametrize("use_grouped_mm", [True, False])
@pytest.mark.parametrize("capacity_factor", [None, 4.0])
@pytest.mark.parametrize("chunks", [1, 2])
def test_moe_dispatch_matches_dense_reference(preset, use_grouped_mm, capacity_factor, chunks):
    """A token's experts on one rank share a row, summed at the expert side; with two expert
    groups the row still travels once, and the expert side adds up both groups' experts."""
    config = ModelConfig.preset(preset, capacity_factor=capacity_factor)
    layer = MoEFFN(config, 0, device=torch.device("cpu"))
    layer.use_grouped_mm = use_grouped_mm
    layer.expert_chunks = chunks
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), dense_reference_moe(layer, x), atol=1e-5, rtol=1e-5)
    assert int(layer.overflow_count) == 0


def test_expert_capacity_pads_small_experts_to_a_step_and_leaves_large_ones_to_the_grouped_gemm():
    layer = MoEFFN(ModelConfig.preset("tiny-moe", num_experts=8, capacity_factor=2.0), 0, device=torch.device("cpu"))
    assert layer.expert_capacity(num_tokens=16, num_rows=64) == 64  # 2.0 * 16 * 2 / 8 = 8 rows, rounded up to 64
    assert layer.expert_capacity(num_tokens=16, num_rows=40) == 40  # never more rows than were received
    assert layer.expert_capacity(num_tokens=200, num_rows=800) == 128  # 100 rounded up to 128
    assert layer.expert_capacity(num_tokens=300, num_rows=1200) is None  # 150 -> 192 rows: the grouped GEMM
    layer.expert_chunks = 2  # in groups, the padded GEMM serves up to 256 rows per expert
    assert layer.expert_capacity(num_tokens=300, num_rows=1200) == 192
    assert layer.expert_capacity(num_tokens=600, num_rows=2400) is None  # 300 -> 320 rows
    layer.expert_chunks = 1
    layer.capacity_factor = None
    assert layer.expert_capacity(num_tokens=16, num_rows=64) is None  # no row may be dropped


@pytest.mark.parametrize("rows", [40, expert_compute.ONE_EXPERT_PLAIN_MAX_ROWS + 1])
def test_a_group_of_one_expert_on_the_grouped_path_equals_the_masked_loop(rows):
    """One expert per group (a rank of a world as wide as the experts): up to
    ``ONE_EXPERT_PLAIN_MAX_ROWS`` its down projection runs over the first len(x) sorted rows, which
    hold every pair of it, whatever the other experts; past it, the grouped GEMM over them all."""
    from ubatch.models.gather_sum import gather_sum

    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 16, generator=g)
    ids = torch.randint(-1, 4, (rows, 2), generator=g)
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], -1, ids[:, 1])  # a token's experts are distinct
    weights = torch.rand(rows, 2, generator=g)
    w13, w2 = torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12, generator=g)
    for first in range(4):
        one = slice(first, first + 1)
        out, position, kept = expert_compute.group_outputs(
            x,
            ids,
            weights,
            w13[one],
            w2[one],
            first=first,
            capacity=None,
            use_grouped_mm=True,
            dropped=torch.zeros((), dtype=torch.int64),
        )
        assert len(out) == rows, "a row holds at most one pair of the one expert: the sort keeps len(x) rows"
        local = torch.where(ids == first, 0, -1)
        expected = expert_compute.masked_experts(x, local, weights, w13[one], w2[one])
        torch.testing.assert_close(gather_sum(out, position, kept).float(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_experts", [1, 3, 6])
def test_the_torch_sort_copies_only_the_rows_that_can_hold_an_expert_of_the_group(num_experts):
    """A row names each expert once, so at most rows * min(top_k, experts) pairs are the group's:
    the sort copies that many rows (every pair's rows past them would never be read), sorted as
    a copy of every pair's row would be."""
    g = torch.Generator().manual_seed(num_experts)
    rows, top_k = 50, 4
    x = torch.randn(rows, 8, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:top_k] for _ in range(rows)]) - 2
    ids = torch.where(ids < num_experts, ids, -1)  # ids -2..-1 and past the group: none
    sorted_rows, order, ends = expert_compute.sort_by_expert(x, ids, num_experts)
    assert len(sorted_rows) == rows * min(top_k, num_experts)
    held = int(ends[-1])
    assert held == int((ids >= 0).sum()) and held <= len(sorted_rows)
    torch.testing.assert_close(sorted_rows[:held], x[order // top_k][:held], rtol=0, atol=0)


def test_expert_groups_on_the_padded_gemm_equal_one_group_on_the_grouped_gemm(monkeypatch):
    """Between ``PADDED_MAX_ROWS`` and ``PADDED_MAX_ROWS_PIPELINED`` rows per expert one group runs
    the grouped GEMM and two groups the padded bmm: the same output, and nothing dropped."""
    config = ModelConfig.preset("tiny-moe", capacity_factor=1.6)
    layer = MoEFFN(config, 0, device=torch.device("cpu"))
    x = torch.randn(300, config.hidden_size, generator=torch.Generator().manual_seed(3))
    paths = []
    for name in ("padded_experts", "grouped_experts"):
        real = getattr(expert_compute, name)
        spy = lambda *args, _real=real, _name=name: paths.append(_name) or _real(*args)  # noqa: E731
        monkeypatch.setattr(expert_compute, name, spy)
    with torch.no_grad():
        one = layer(x)  # one group of 4 experts: 256 rows per expert, above 128
        layer.expert_chunks = 2
        two = layer(x)
    assert paths == ["grouped_experts"] + ["padded_experts"] * 2
    assert int(layer.overflow_count) == 0
    torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)


def test_padded_expert_gemm_counts_the_rows_past_an_experts_capacity(monkeypatch):
    monkeypatch.setattr(expert_compute, "PADDED_ROWS_STEP", 1)
    config = ModelConfig.preset("tiny-moe", capacity_factor=1.0)
    layer = MoEFFN(config, 0, device=torch.device("cpu"))
    x = torch.randn(40, config.hidden_size, generator=torch.Generator().manual_seed(1))
    _, ids = layer.route(x)
    per_expert = torch.bincount(ids.flatten(), minlength=layer.num_local_experts)
    capacity = layer.expert_capacity(40, 80)
    assert capacity == math.ceil(40 * layer.top_k / layer.num_local_experts)
    with torch.no_grad():
        layer(x)
    assert int(layer.overflow_count) == int((per_expert - capacity).clamp(min=0).sum()) > 0


def test_moe_small_capacity_counts_overflow():
    config = ModelConfig.preset("tiny-moe", capacity_factor=0.5)
    layer = MoEFFN(config, 0, device=torch.device("cpu"))
    x = torch.randn(32, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        layer(x)
    # One rank and one chunk: every token sends it one row holding both its experts, and the
    # capacity, ceil(0.5 * 32 rows), keeps 16 tokens' rows of 32.
    assert layer.capacity(32) == [16]
    assert int(layer.overflow_count) == (32 - 16) * layer.top_k


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-deepseek"])
@pytest.mark.parametrize("chunks", [1, 2])
def test_counted_dispatch_equals_the_static_one_and_moves_only_the_real_rows(preset, chunks):
    """Without a capacity factor an eager step exchanges its counts and sends its real rows, one
    per token with any expert on the other rank (top-4 of 16: a token's experts there share one,
    in every expert group); with a capacity no row can exceed, the static path sends every chunk
    at worst-case size. Over the CPU link stand-in (world 2) the bytes moved say which rows
    travelled."""
    config = ModelConfig.preset(preset)
    counted_link, static_link = HostLink(2, 1e6, device="cpu"), HostLink(2, 1e6, device="cpu")
    counted = MoEFFN(config, 0, device=torch.device("cpu"), ep_group=counted_link)
    static = MoEFFN(config, 0, device=torch.device("cpu"), ep_group=static_link)
    static.capacity_factor = 1e6
    for layer in (counted, static):
        layer.expert_chunks = chunks
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(counted(x), static(x), atol=1e-6, rtol=1e-6)
    _, ids = counted.route(x)
    remote = int((ids // counted.num_local_experts == 1).any(dim=1).sum())
    row = 4 * dispatch_row_width(config.hidden_size, config.top_k, torch.float32)  # with weights, ids, return position
    counts = 2 * 8 * chunks  # the other rank's int64 counts per chunk, of the dispatch and of the combine
    assert counted_link.bytes_moved == counts + remote * row + remote * 4 * config.hidden_size
    worst = 37  # the static path's rows to the other rank, per chunk: one per token
    assert static_link.bytes_moved == chunks * worst * (row + 4 * config.hidden_size)
    assert int(counted.overflow_count) == 0
    # a graph's warm-up runs what its capture runs, and a DP rank whose peers replay issues what they do
    for scope in (capture_scope(skip_attention=False), static_collectives()):
        with scope, torch.no_grad():
            before = counted_link.bytes_moved
            counted(x)
        assert counted_link.bytes_moved - before == chunks * worst * (row + 4 * config.hidden_size)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-deepseek"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_link_that_sizes_on_the_device_is_charged_the_real_rows_of_a_padded_dispatch(preset, world):
    """The static dispatch pads every block to its capacity; over a ProxyLink (sizes set on the
    device) the dispatch and the combine, whole or in token runs, charge only the rows to other
    ranks that hold a token, which is what the counted path moves, and the outputs equal HostLink's;
    so do expert groups, each row charged in one dispatch chunk and one combine chunk."""
    config = ModelConfig.preset(preset)
    host, proxy = HostLink(world, 1e6, device="cpu"), ProxyLink(world, 1e6, device="cpu")
    layers = [MoEFFN(config, 0, device=torch.device("cpu"), ep_group=group) for group in (host, proxy)]
    for layer in layers:
        layer.capacity_factor = 2.0
    x = torch.randn(29, config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(layers[1](x), layers[0](x), atol=0, rtol=0)
    _, ids = layers[0].route(x)
    rank_of = ids // layers[0].num_local_experts
    remote = sum(int((rank_of == r).any(dim=1).sum()) for r in range(1, world))
    assert int(layers[1].overflow_count) == 0, "a factor of 2 keeps every row of this batch"
    row = 4 * dispatch_row_width(config.hidden_size, config.top_k, torch.float32)
    assert proxy.bytes_moved == remote * (row + 4 * config.hidden_size) < host.bytes_moved
    for layer in layers:  # token runs: each run charged its own real rows, the runs together all of them
        layer.token_chunks = 2
    before, before_host = proxy.bytes_moved, host.bytes_moved
    with torch.no_grad():
        torch.testing.assert_close(layers[1](x), layers[0](x), atol=0, rtol=0)
    assert proxy.bytes_moved - before == remote * (row + 4 * config.hidden_size) < host.bytes_moved - before_host
    if layers[0].num_local_experts % 2:
        return
    for layer in layers:  # expert groups: each row charged once, in its earliest group's dispatch and latest's combine
        layer.token_chunks, layer.expert_chunks = 1, 2
    before, before_host = proxy.bytes_moved, host.bytes_moved
    with torch.no_grad():
        torch.testing.assert_close(layers[1](x), layers[0](x), atol=0, rtol=0)
    assert proxy.bytes_moved - before == remote * (row + 4 * config.hidden_size) < host.bytes_moved - before_host


# ----- tensor / expert parallelism over gloo ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _random_sequences(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _check_sharded(config: ModelConfig, sequences: list[list[int]], **groups) -> None:
    reference = forward_sequences(build_model(config, device="cpu"), sequences, block_size=4)
    sharded = forward_sequences(build_model(config, device="cpu", **groups), sequences, block_size=4)
    torch.testing.assert_close(sharded, reference, atol=1e-5, rtol=0)


def _parallel_worker(rank: int, port: int, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        # TP: every rank runs the same tokens.
        _check_sharded(ModelConfig.preset("tiny"), _random_sequences([5, 11, 3], 128, seed=0), tp_group=group)
        # EP: each rank runs its own tokens (same count per rank, as DP padding guarantees).
        lengths = [[6, 10], [16]][rank]
        for preset in ("tiny-moe", "tiny-moe-shared"):
            _check_sharded(ModelConfig.preset(preset), _random_sequences(lengths, 128, seed=10 + rank), ep_group=group)
        # TP attention + shared expert with EP routed experts: TP needs the same tokens everywhere.
        _check_sharded(
            ModelConfig.preset("tiny-moe-shared", capacity_factor=8.0),
            _random_sequences([7, 9], 128, seed=20),
            ep_group=group,
            tp_group=group,
        )
        match = r"num_experts \(3\) must be divisible by the expert-parallel world size \(2\)"
        with pytest.raises(ValueError, match=match):
            build_model(ModelConfig.preset("tiny-moe", num_experts=3), device="cpu", ep_group=group)
        match = r"num_kv_heads \(1\) must be divisible by the tensor-parallel world size \(2\)"
        with pytest.raises(ValueError, match=match):
            build_model(ModelConfig.preset("tiny", num_kv_heads=1), device="cpu", tp_group=group)
    finally:
        dist.destroy_process_group()


def test_tensor_and_expert_parallel_match_single_process():
    world = 2
    mp.spawn(_parallel_worker, args=(_free_port(), world), nprocs=world, join=True)


def test_expert_rows_kernel_interpreted():
    """The Triton kernel itself, under Triton's CPU interpreter, against the torch path: slots,
    dropped count and placed rows, with drops, strided rows, rows of three copy blocks and more
    rows than one rank block (both blocks shrunk, so the loops turn at small sizes, which the
    interpreter runs in seconds)."""
    run_interpreted(
        """
import torch
from ubatch.models import expert_compute, expert_rows
expert_rows._BLOCK_RANK, expert_rows._MAX_BLOCK_HIDDEN = 64, 16
g = torch.Generator().manual_seed(0)
drops = 0
for dtype in (torch.float32, torch.bfloat16):
    cases = ((1, 8, 2, 4, 1), (37, 24, 4, 8, 1), (150, 40, 3, 30, 1), (40, 24, 4, 16, 3))
    for num_rows, hidden, n, cap, per_row in cases if dtype == torch.bfloat16 else cases[:2]:
        x = torch.randn(num_rows, hidden + 3, generator=g).to(dtype)[:, :hidden]
        for first in (0, 2):  # the experts of a group from ``first`` on; the others' ids are padding
            expert = torch.randint(-1, n + 2 * first, (num_rows * per_row,), generator=g)
            padded, slot, dropped = expert_rows.pad_expert_rows_kernel(x, expert.to(torch.int32), n, cap, first)
            ref_padded, ref_slot, ref_dropped = expert_compute.pad_expert_rows(x, expert, n, cap, first)
            assert torch.equal(slot, ref_slot) and int(dropped) == int(ref_dropped)
            kept = slot >= 0
            assert torch.equal(padded.flatten(0, 1)[slot[kept]], x.repeat_interleave(per_row, 0)[kept])
            drops += int(dropped)
            counter = torch.full((), 3, dtype=torch.int64)  # a running total counts the drops in place
            counted = expert_rows.pad_expert_rows_kernel(x, expert, n, cap, first, counter=counter)[2]
            assert counted is counter and int(counter) == 3 + int(ref_dropped)
assert drops > 0
print("interpreted kernel ok")
""",
        timeout=600,
    )


SORT_CHECK = """
import torch
from ubatch.models import expert_compute, expert_rows


def check_sort(x, ids, n, first):
    # the kernel's sorted rows, positions and ends against the torch sort's; returns the pairs placed
    got_rows, got_pos, got_ends = expert_rows.sort_by_expert_kernel(x, ids, n, first)
    shifted = torch.where((ids >= first) & (ids < first + n), ids - first, -1)
    ref_rows, order, ref_ends = expert_compute.sort_by_expert(x, shifted, n)
    landed = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    assert torch.equal(got_ends, ref_ends), (got_ends, ref_ends)
    assert torch.equal(got_pos, torch.where(shifted >= 0, landed.view_as(ids), -1))
    real = int(ref_ends[-1])
    assert torch.equal(got_rows[:real], ref_rows[:real])
    return real


def sort_cases(device, dtype, seed, small=False):
    # strided rows, ids outside the group, a hidden size past one copy block, more pairs than one
    # scan step, a single expert, no rows; ``small``: a tenth of the rows and a hidden size of 40,
    # for blocks shrunk to match
    g = torch.Generator().manual_seed(seed)
    shapes = ((1, 1, 8, 1, 0), (37, 2, 24, 4, 0), (300, 8, 40, 8, 2), (600, 3, 1030, 5, 1), (0, 2, 8, 3, 0))
    if small:
        shapes = tuple((rows // 10 or rows, k, min(hidden, 40), n, first) for rows, k, hidden, n, first in shapes)
    for rows, top_k, hidden, n, first in shapes:
        x = torch.randn(rows, hidden + 3, generator=g).to(dtype)[:, :hidden]
        ids = torch.randint(-1, n + 2 * first + 1, (rows, top_k), generator=g)
        yield x.to(device), ids.to(device), n, first
"""


def test_sort_by_expert_kernel_interpreted():
    """The grouped GEMM's counting sort under Triton's CPU interpreter against the torch sort: the
    same ends, positions and rows. The interpreter pays per program, so the cases are small and
    the blocks shrunk to match: 16 elements a copy step (a row of 40 spans three), 32 pairs a block
    (240 pairs take eight), and the block bases four blocks a step (eight take two)."""
    run_interpreted(
        SORT_CHECK
        + """
expert_rows._MAX_BLOCK_HIDDEN, expert_rows._BLOCK_SCAN, expert_rows._BASE_TILE = 16, 32, 4
placed = 0
for dtype in (torch.float32, torch.bfloat16):
    for x, ids, n, first in sort_cases("cpu", dtype, 0, small=True):
        placed += check_sort(x, ids, n, first)
assert placed > 0
# ids naming one expert twice in a row (routing never does) fill past the output's rows: those
# pairs are not copied, the rest land where they belong
x = torch.randn(6, 40)
rows, position, ends = expert_rows.sort_by_expert_kernel(x, torch.zeros(6, 4, dtype=torch.int64), 2)
assert len(rows) == 12 and ends.tolist() == [24, 24] and position.flatten().tolist() == list(range(24))
assert torch.equal(rows, x.repeat_interleave(4, dim=0)[:12])
print("interpreted kernel ok")
""",
        timeout=600,
    )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sort_by_expert_kernel_sorts_as_torch_and_replays_from_a_graph(dtype):
    from ubatch.models import expert_rows

    namespace: dict = {}
    exec(SORT_CHECK, namespace)
    for case in namespace["sort_cases"]("cuda", dtype, 1):
        namespace["check_sort"](*case)
    many = torch.randint(-1, 9, (4000, 8), device="cuda")  # 32000 pairs: 125 blocks, four base steps
    assert namespace["check_sort"](torch.randn(4000, 64, device="cuda").to(dtype), many, 8, 0) > 0
    x = torch.randn(700, 256, device="cuda").to(dtype)
    ids = torch.randint(-1, 8, (700, 8), device="cuda")
    assert expert_rows.sort_kernel_takes(x, ids, 8)
    expert_rows.sort_by_expert_kernel(x, ids, 8)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, position, ends = expert_rows.sort_by_expert_kernel(x, ids, 8)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(700, 256, generator=g).to(dtype))
        ids.copy_(torch.randint(-1, 8, (700, 8), generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert namespace["check_sort"](x, ids, 8, 0) == int(ends[-1])
        want_rows, want_position, want_ends = expert_rows.sort_by_expert_kernel(x, ids, 8)
        assert torch.equal(position, want_position) and torch.equal(ends, want_ends)
        assert torch.equal(rows[: int(ends[-1])], want_rows[: int(ends[-1])])


def test_sort_kernel_leaves_odd_inputs_to_torch():
    from ubatch.models import expert_rows

    x, ids = torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int64)
    assert not expert_rows.sort_kernel_takes(x, ids, 4)  # CPU
    if expert_rows.triton is None or not torch.cuda.is_available():
        return
    x, ids = x.cuda(), ids.cuda()
    assert expert_rows.sort_kernel_takes(x, ids, 4)
    assert not expert_rows.sort_kernel_takes(x, ids.int(), 4)
    assert not expert_rows.sort_kernel_takes(x, ids, expert_rows._MAX_SORT_EXPERTS + 1)


def _expert_rows_case(seed, num_rows, hidden, num_experts, dtype, expert_dtype, strided, per_row=1):
    """Rows (a column slice of a wider buffer when ``strided``) and ``per_row`` expert ids in
    -1..n-1 for each."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_rows, hidden + 3, generator=g).to(dtype).cuda()
    x = wide[:, :hidden] if strided else wide[:, :hidden].contiguous()
    expert = torch.randint(-1, num_experts, (num_rows * per_row,), generator=g).to(expert_dtype).cuda()
    return x, expert


def _same_placement(kernel_result, torch_result, x):
    (padded, slot, dropped), (ref_padded, ref_slot, ref_dropped) = kernel_result, torch_result
    assert torch.equal(slot, ref_slot) and int(dropped) == int(ref_dropped)
    rows, kept = padded.flatten(0, 1), slot >= 0
    assert torch.equal(rows[slot[kept]], x.repeat_interleave(len(slot) // len(x), 0)[kept])
    assert torch.equal(rows[slot[kept]], ref_padded.flatten(0, 1)[slot[kept]])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("expert_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "column_slice"])
def test_expert_rows_kernel_places_rows_as_the_torch_path(dtype, expert_dtype, strided):
    """Slots, dropped count and placed rows equal ``pad_expert_rows``'s, with and without drops,
    for rows wider than one copy block and more rows than one rank block."""
    from ubatch.models import expert_rows

    for seed, (num_rows, hidden, num_experts, capacity, per_row) in enumerate(
        [(1, 8, 2, 4, 1), (37, 24, 4, 8, 1), (500, 40, 8, 128, 3), (2100, 1030, 3, 700, 1), (300, 40, 8, 64, 8)]
    ):
        x, expert = _expert_rows_case(seed, num_rows, hidden, num_experts, dtype, expert_dtype, strided, per_row)
        assert expert_rows.kernel_takes(x, expert)
        got = expert_rows.pad_expert_rows_kernel(x, expert, num_experts, capacity)
        _same_placement(got, expert_compute.pad_expert_rows(x, expert.long(), num_experts, capacity), x)
        assert (int(got[2]) > 0) == (seed in (1, 2, 4))  # the 37-, 1500- and 2400-pair cases overflow
        # an expert group from 1 on: expert 0's pairs are padding like the -1s
        got = expert_rows.pad_expert_rows_kernel(x, expert, num_experts - 1, capacity, 1)
        _same_placement(got, expert_compute.pad_expert_rows(x, expert.long(), num_experts - 1, capacity, 1), x)
        counter = torch.full((), 3, dtype=torch.int64, device="cuda")
        expert_rows.pad_expert_rows_kernel(x, expert, num_experts - 1, capacity, 1, counter=counter)
        assert int(counter) == 3 + int(got[2])


@pytest.mark.cuda
def test_expert_rows_kernel_is_one_launch_and_replays_from_a_graph():
    from ubatch.bench.kernels import profile_kernels
    from ubatch.models import expert_rows

    x, expert = _expert_rows_case(0, 600, 256, 4, torch.bfloat16, torch.int64, strided=True)
    kernels = profile_kernels(lambda: expert_rows.pad_expert_rows_kernel(x, expert, 4, 128), torch.device("cuda"))
    assert [k.name for k in kernels if "_pad_rows" in k.name] and len(kernels) <= 3, kernels  # two allocations' fills
    expert_rows.pad_expert_rows_kernel(x, expert, 4, 128)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = expert_rows.pad_expert_rows_kernel(x, expert, 4, 128)
    for seed in range(1, 4):
        new_x, new_expert = _expert_rows_case(seed, 600, 256, 4, torch.bfloat16, torch.int64, strided=True)
        x.copy_(new_x)
        expert.copy_(new_expert)
        graph.replay()
        torch.cuda.synchronize()
        _same_placement(captured, expert_compute.pad_expert_rows(x, expert, 4, 128), x)


@pytest.mark.cuda
def test_padded_expert_gemm_runs_the_expert_rows_kernel(monkeypatch):
    """The MoE layer takes the kernel on CUDA: the torch placement never runs."""
    monkeypatch.setattr(expert_compute, "pad_expert_rows", lambda *args: pytest.fail("the torch placement ran"))
    config = ModelConfig.preset("small-moe", capacity_factor=2.0)
    layer = MoEFFN(config, 0, device=torch.device("cuda"))
    x = torch.randn(64, config.hidden_size, device="cuda", dtype=config.dtype)
    assert layer.expert_capacity(64, 64 * config.top_k) is not None
    with torch.no_grad():
        layer(x)


@pytest.mark.cuda
def test_cuda_moe_dispatch_is_sync_free_and_matches_masked_loop():
    config = ModelConfig.preset("small-moe", capacity_factor=2.0)
    layer = MoEFFN(config, 0, device=torch.device("cuda"))
    assert layer.use_grouped_mm
    x = torch.randn(300, config.hidden_size, device="cuda", dtype=config.dtype)
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")
        try:
            grouped = layer(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        layer.use_grouped_mm = False
        masked = layer(x)
    torch.testing.assert_close(grouped, masked, atol=2e-2, rtol=2e-2)
