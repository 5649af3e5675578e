"""ubatch.attention: layer, metadata, paged KV cache, backends, and the skip_attention path.

Every backend is checked against a dense float64 reference that never touches the cache: each
request's full Q/K/V sequence is drawn up front, fed to the layer chunk by chunk, and each
step's outputs are compared with explicit causal softmax over the tokens seen so far.
"""

from __future__ import annotations

import math
import random
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.builtin_flash_fake import fake_builtin_flash_enabled
from tests.interpreted import run_interpreted
from ubatch.attention import (
    Attention,
    AttentionMetadata,
    BlockPool,
    FlashAttentionBackend,
    PagedKVCache,
    TorchBackend,
    available_backends,
    build_attention_metadata,
    get_attention_context,
    get_backend,
    split_attn_metadata,
    write_kv,
)
from ubatch.attention import backends as backends_module
from ubatch.attention import kv_cache as kv_cache_module
from ubatch.attention.backends import describe_backend, load_flash_attn, preferred_block_size
from ubatch.bench.workload import make_step
from ubatch.context import set_forward_context
from ubatch.models import ModelConfig, build_model
from ubatch.slicing import UBatchSlice

LAYER = "model.layers.0.attn"


def reference_attention(q, k, v, start, scale, causal=True):
    """Dense attention in float64: ``q [n, H, D]`` at positions ``start..start+n-1`` over
    ``k``/``v`` ``[>= start+n, KVH, D]`` (causal: up to each query's position; else all
    ``start+n`` keys); query head h reads KV head h // (H / KVH)."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k[: start + n].double().repeat_interleave(group, dim=1)
    v = v[: start + n].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    key_pos = torch.arange(start + n).view(1, -1)
    query_pos = torch.arange(start, start + n).view(-1, 1)
    if causal:
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Scenario:
    """Requests with known full Q/K/V, a shuffled block table, and the layer under test."""

    def __init__(
        self,
        lengths,
        *,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        block_size=4,
        backend="torch",
        dtype=torch.float32,
        device="cpu",
        seed=0,
    ):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype, self.device = dtype, torch.device(device)
        self.block_size = block_size
        self.lengths = list(lengths)
        self.q = [torch.randn(n, num_heads, head_dim, generator=self.gen, dtype=torch.float64) for n in lengths]
        self.k = [torch.randn(n, num_kv_heads, head_dim, generator=self.gen, dtype=torch.float64) for n in lengths]
        self.v = [torch.randn(n, num_kv_heads, head_dim, generator=self.gen, dtype=torch.float64) for n in lengths]
        blocks_per_req = [-(-n // block_size) for n in lengths]
        num_blocks = sum(blocks_per_req) + 3  # spare blocks stay untouched
        pool = BlockPool(num_blocks)
        ids = pool.allocate(num_blocks)
        random.Random(seed).shuffle(ids)  # non-contiguous, out-of-order blocks
        self.blocks, at = [], 0
        for nb in blocks_per_req:
            self.blocks.append(ids[at : at + nb])
            at += nb
        self.done = [0] * len(lengths)
        self.registry = {}
        self.layer = Attention(
            num_heads,
            head_dim,
            num_kv_heads,
            layer_name=LAYER,
            backend=backend,
            registry=self.registry,
        )
        self.cache = PagedKVCache(
            [LAYER],
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )
        self.layer.kv_cache = self.cache[LAYER]

    def slot(self, r, pos):
        return self.blocks[r][pos // self.block_size] * self.block_size + pos % self.block_size

    def batch(self, chunks, num_pad=0):
        """Inputs and metadata for one step: ``chunks`` is [(request, num_new_tokens)]."""
        qs, ks, vs, slots, query_lens, seq_lens, rows = [], [], [], [], [], [], []
        for r, n in chunks:
            start = self.done[r]
            assert start + n <= self.lengths[r]
            qs.append(self.q[r][start : start + n])
            ks.append(self.k[r][start : start + n])
            vs.append(self.v[r][start : start + n])
            slots += [self.slot(r, p) for p in range(start, start + n)]
            query_lens.append(n)
            seq_lens.append(start + n)
            rows.append(self.blocks[r])
        for parts in (qs, ks, vs):  # padding rows carry garbage that must not leak anywhere
            parts.append(torch.randn(num_pad, *parts[0].shape[1:], generator=self.gen, dtype=torch.float64) * 100)
        slots += [-1] * num_pad
        width = max(len(b) for b in rows)
        table = torch.tensor([b + [0] * (width - len(b)) for b in rows], dtype=torch.int32)
        md = build_attention_metadata(
            query_lens,
            seq_lens,
            table,
            torch.tensor(slots, dtype=torch.int64),
            device=self.device,
        )
        q, k, v = (torch.cat(p).to(self.dtype).to(self.device) for p in (qs, ks, vs))
        return q.flatten(1), k.flatten(1), v.flatten(1), md

    def expected(self, chunks):
        outs = []
        for r, n in chunks:
            start = self.done[r]
            outs.append(
                reference_attention(self.q[r][start : start + n], self.k[r], self.v[r], start, self.layer.scale)
            )
        return torch.cat(outs).flatten(1)

    def step(self, chunks, num_pad=0, atol=1e-5, rtol=1e-5):
        q, k, v, md = self.batch(chunks, num_pad)
        with set_forward_context({LAYER: md}, no_compile_layers=self.registry):
            out = self.layer(q, k, v)
        n = md.num_actual_tokens
        assert out.shape == q.shape and out.dtype == self.dtype
        torch.testing.assert_close(out[:n].double().cpu(), self.expected(chunks), atol=atol, rtol=rtol)
        assert torch.count_nonzero(out[n:]) == 0, "padding rows must be zero"
        for r, n_new in chunks:
            self.done[r] += n_new
        return out

    def check_cache(self):
        """Every written slot holds its token's K/V; every other slot is still zero."""
        kv = self.cache[LAYER].cpu().double().flatten(1, 2)  # [2, slots, KVH, D]
        expect = torch.zeros_like(kv)
        for r, done in enumerate(self.done):
            for p in range(done):
                expect[0, self.slot(r, p)] = self.k[r][p].to(self.dtype).double()
                expect[1, self.slot(r, p)] = self.v[r][p].to(self.dtype).double()
        assert torch.equal(kv, expect)


def random_schedule(lengths, rng, max_pad=3):
    """Steps mixing prefill, chunked continuation, decode and multi-token requests; requests
    join at different steps so one batch holds several phases."""
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths)):
        active = [r for r, (d, n) in enumerate(zip(done, lengths)) if d < n]
        chosen = sorted(rng.sample(active, rng.randint(1, len(active))))
        rng.shuffle(chosen)
        chunks = []
        for r in chosen:
            left = lengths[r] - done[r]
            n = 1 if done[r] and rng.random() < 0.5 else rng.randint(1, left)
            chunks.append((r, min(n, left)))
            done[r] += chunks[-1][1]
        steps.append((chunks, rng.randint(0, max_pad)))
    return steps


GQA = [(4, 4), (8, 2)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", GQA, ids=["mha", "gqa"])
def test_prefill(block_size, heads):
    sc = Scenario([5, 17, 1, 33], num_heads=heads[0], num_kv_heads=heads[1], block_size=block_size)
    sc.step([(r, n) for r, n in enumerate(sc.lengths)], num_pad=3)
    sc.check_cache()


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", GQA, ids=["mha", "gqa"])
def test_chunked_prefill_then_decode(block_size, heads):
    sc = Scenario([20, 13, 9], num_heads=heads[0], num_kv_heads=heads[1], block_size=block_size, seed=1)
    sc.step([(0, 7), (1, 13), (2, 4)])  # request 0 and 2 are chunked
    sc.step([(0, 9), (2, 5)], num_pad=2)  # continuations over cached context
    sc.step([(2, 0), (0, 3)])  # an empty request is tolerated
    sc.step([(0, 1)], num_pad=1)  # decode
    sc.check_cache()


@pytest.mark.parametrize("heads", GQA, ids=["mha", "gqa"])
def test_decode_batch_and_uniform_multi_token(heads):
    sc = Scenario([12, 30, 7, 19, 25], num_heads=heads[0], num_kv_heads=heads[1], block_size=4, seed=2)
    sc.step([(r, n - 6) for r, n in enumerate(sc.lengths)])
    for _ in range(3):
        sc.step([(r, 1) for r in range(5)], num_pad=3)  # decode
    sc.step([(r, 3) for r in range(5)])  # uniform 3 tokens (spec verification)
    sc.check_cache()


@pytest.mark.parametrize("heads", GQA, ids=["mha", "gqa"])
def test_runs_of_equal_query_lengths_take_one_sdpa_each(heads, monkeypatch):
    """Consecutive requests with equal query lengths but different contexts share one SDPA call."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, *a, **kw: calls.append(q.shape[0]) or sdpa(q, *a, **kw),
    )
    sc = Scenario([12, 9, 15, 6, 10], num_heads=heads[0], num_kv_heads=heads[1], block_size=4, seed=3)
    sc.step([(0, 3), (1, 3), (2, 5), (3, 2), (4, 2)], num_pad=2)
    assert calls == [2, 1, 2]
    calls.clear()
    sc.step([(0, 4), (1, 4), (2, 4), (3, 1), (4, 1)])  # contexts 7, 7, 9, then 3, 3
    assert calls == [3, 2]
    calls.clear()
    sc.step([(3, 0), (0, 1), (1, 1)])  # an empty request is a run with nothing to attend
    assert calls == [2]
    sc.check_cache()


@pytest.mark.parametrize("heads", GQA, ids=["mha", "gqa"])
def test_non_causal_runs_attend_each_request_whole_context(heads):
    sc = Scenario([12, 9, 15, 6, 10], num_heads=heads[0], num_kv_heads=heads[1], block_size=4, seed=4)
    sc.step([(0, 3), (1, 5), (2, 1), (3, 2), (4, 4)])  # cached contexts 3, 5, 1, 2, 4
    _check_non_causal_step(sc, [(0, 4), (1, 4), (2, 4), (3, 1), (4, 1)])  # runs {0, 1, 2} and {3, 4}


def _check_non_causal_step(sc, chunks):
    """One step with ``causal=False``: every query attends its request's whole context."""
    q, k, v, md = sc.batch(chunks, num_pad=2)
    md.causal = False
    with set_forward_context({LAYER: md}, no_compile_layers=sc.registry):
        out = sc.layer(q, k, v)
    expect = torch.cat(
        [
            reference_attention(
                sc.q[r][sc.done[r] : sc.done[r] + n], sc.k[r], sc.v[r], sc.done[r], sc.layer.scale, causal=False
            )
            for r, n in chunks
        ]
    ).flatten(1)
    torch.testing.assert_close(out[: md.num_actual_tokens].double(), expect, atol=1e-5, rtol=1e-5)


@settings(max_examples=100, deadline=None)
@given(query_lens=st.lists(st.integers(0, 3), max_size=12))
def test_equal_query_runs_partition_requests_into_maximal_runs(query_lens):
    from ubatch.attention.backends import _equal_query_runs

    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    runs = _equal_query_runs(starts)
    assert [r for first, last in runs for r in range(first, last)] == list(range(len(query_lens)))
    assert all(len({query_lens[r] for r in range(first, last)}) == 1 for first, last in runs)
    assert all(query_lens[a[1] - 1] != query_lens[b[0]] for a, b in zip(runs, runs[1:])), "runs are maximal"


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
    heads = rng.choice(GQA)
    sc = Scenario(
        lengths,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        block_size=rng.choice([1, 4, 16]),
        seed=seed,
    )
    for chunks, pad in random_schedule(lengths, rng):
        sc.step(chunks, num_pad=pad)
    sc.check_cache()


def test_non_causal_attends_whole_context():
    sc = Scenario([6], block_size=4)
    q, k, v, md = sc.batch([(0, 6)])
    md.causal = False
    with set_forward_context({LAYER: md}, no_compile_layers=sc.registry):
        out = sc.layer(q, k, v)
    full = sc.q[0].double().transpose(0, 1) @ sc.k[0].double().permute(1, 2, 0) * sc.layer.scale
    expect = (full.softmax(-1) @ sc.v[0].double().transpose(0, 1)).transpose(0, 1).flatten(1)
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)


# --- skip_attention: the seed regression ------------------------------------------------


class SpyBackend:
    """Records calls; fails the test when called where attention must be skipped."""

    name = "spy"

    def __init__(self, allowed):
        self.allowed = allowed
        self.calls = 0

    def forward(self, q, kv_cache, metadata, scale):
        self.calls += 1
        if not self.allowed:
            raise AssertionError("attention backend launched under skip_attention")
        return TorchBackend().forward(q, kv_cache, metadata, scale)


def _seeded_scenario(allowed):
    """A layer with a spy backend and some context already in its cache."""
    spy = SpyBackend(allowed=True)
    sc = Scenario([9, 4], backend=spy, block_size=4)
    sc.step([(0, 3), (1, 2)])
    spy.allowed, spy.calls = allowed, 0
    return sc, spy


@pytest.mark.parametrize("explicit_slot_mapping", [True, False])
def test_skip_attention_seed_regression(explicit_slot_mapping):
    sc, spy = _seeded_scenario(allowed=False)
    q, k, v, md = sc.batch([(0, 4), (1, 1)], num_pad=2)
    raw = {LAYER: md}
    raw_before = dict(raw)
    slot_mapping = {LAYER: md.slot_mapping} if explicit_slot_mapping else None
    cache_before = sc.layer.kv_cache.clone()
    with set_forward_context(raw, slot_mapping=slot_mapping, skip_attention=True, no_compile_layers=sc.registry) as ctx:
        metadata, layer, kv_cache, slots = get_attention_context(LAYER)
        assert metadata is None
        assert layer is sc.layer
        assert kv_cache is sc.layer.kv_cache
        assert slots is md.slot_mapping
        out = sc.layer(q, k, v)
        assert ctx.attn_metadata is raw
    assert raw == raw_before and raw[LAYER] is md
    assert spy.calls == 0
    assert torch.equal(sc.layer.kv_cache, cache_before), "skip_attention must not write KV"
    assert out.shape == q.shape and out.dtype == q.dtype and torch.count_nonzero(out) == 0


def test_without_skip_attention_the_backend_runs():
    sc, spy = _seeded_scenario(allowed=True)
    sc.step([(0, 4), (1, 1)], num_pad=2)
    assert spy.calls == 1
    sc.check_cache()


def test_no_metadata_is_the_profiling_path():
    sc, spy = _seeded_scenario(allowed=False)
    q, k, v, _ = sc.batch([(0, 2)])
    cache_before = sc.layer.kv_cache.clone()
    with set_forward_context(None, no_compile_layers=sc.registry):
        assert get_attention_context(LAYER)[0] is None
        out = sc.layer(q, k, v)
    assert spy.calls == 0 and torch.count_nonzero(out) == 0
    assert torch.equal(sc.layer.kv_cache, cache_before)


# --- errors -------------------------------------------------------------------------------


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="'nope'.*valid.*torch.*flash"):
        get_backend("nope", "cpu")
    with pytest.raises(ValueError, match="'nope'"):
        Attention(4, 8, layer_name="a", backend="nope")


def test_flash_on_cpu_is_an_error():
    with pytest.raises(RuntimeError, match="'flash' needs a CUDA device, got cpu"):
        get_backend("flash", "cpu")
    layer = Attention(2, 8, layer_name="a", backend="flash", registry=(reg := {}))
    layer.kv_cache = torch.zeros(2, 2, 4, 2, 8)
    md = build_attention_metadata([1], [1], torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
    with set_forward_context({"a": md}, no_compile_layers=reg):
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            layer(torch.zeros(1, 16), torch.zeros(1, 16), torch.zeros(1, 16))


def test_auto_backend_on_cpu_is_torch():
    assert isinstance(get_backend(None, "cpu"), TorchBackend)
    assert available_backends("cpu") == ["torch"]


def test_triton_backend_needs_cuda_and_triton():
    with pytest.raises(RuntimeError, match="'triton' needs a CUDA device, got cpu"):
        get_backend("triton", "cpu")


def test_the_decode_kernel_takes_decode_steps_and_the_inner_backend_the_rest(monkeypatch):
    """Steps of one query token per request, or of a few each alike and causal, go to the decode
    kernel (q cut to the step's tokens); any other step, and one the kernel does not take, to the
    wrapped backend unchanged."""
    calls = []

    class Inner:
        name = "inner"

        def forward(self, q, kv_cache, metadata, scale):
            calls.append(("inner", len(q)))
            return q

    def kernel(q, kv_cache, block_table, seq_lens, scale, *, query_len):
        calls.append(("kernel", len(q), tuple(seq_lens.tolist()), scale, query_len))
        return q

    takes = {"value": True}
    monkeypatch.setattr(backends_module, "decode_kernel_takes", lambda *args, query_len: takes["value"])
    monkeypatch.setattr(backends_module, "decode_attention", kernel)
    backend = backends_module.DecodeKernelBackend(Inner())
    assert describe_backend(backend) == "triton_decode+inner" and backend.name == "triton"
    cache, table = torch.zeros(2, 4, 4, 2, 8), torch.zeros(3, 2, dtype=torch.int32)
    slots = torch.zeros(6, dtype=torch.int64)
    decode = build_attention_metadata([1, 1, 1], [3, 5, 7], table, slots)
    verify = build_attention_metadata([2, 2, 2], [3, 5, 7], table, slots)  # one drafted token each
    uneven = build_attention_metadata([1, 2, 1], [3, 5, 7], table, slots)
    bidirectional = build_attention_metadata([2, 2, 2], [3, 5, 7], table, slots, causal=False)
    q = torch.zeros(8, 2, 8)  # padding rows past the step's tokens
    for metadata in (decode, verify, uneven, bidirectional):
        backend.forward(q, cache, metadata, 0.5)
    takes["value"] = False
    backend.forward(q, cache, decode, 0.5)
    assert calls == [
        ("kernel", 3, (3, 5, 7), 0.5, 1),
        ("kernel", 6, (3, 5, 7), 0.5, 2),
        ("inner", 8),
        ("inner", 8),
        ("inner", 8),
    ]
    assert preferred_block_size(backend, 128, torch.bfloat16) == preferred_block_size(Inner(), 128, torch.bfloat16)


def test_heads_not_divisible():
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by num_kv_heads=4"):
        Attention(6, 8, 4, layer_name="a")


def test_duplicate_layer_name():
    reg = {}
    Attention(4, 8, layer_name="dup", registry=reg)
    with pytest.raises(ValueError, match="duplicate attention layer name 'dup'"):
        Attention(4, 8, layer_name="dup", registry=reg)


def test_missing_layer_in_no_compile_layers():
    reg = {}
    Attention(4, 8, layer_name="present", registry=reg)
    with set_forward_context(None, no_compile_layers=reg):
        with pytest.raises(RuntimeError, match=r"'absent' is not in .*no_compile_layers.*'present'"):
            get_attention_context("absent")


def test_metadata_dict_without_this_layer():
    sc = Scenario([3])
    q, k, v, md = sc.batch([(0, 3)])
    with set_forward_context({"other": md}, no_compile_layers=sc.registry):
        with pytest.raises(RuntimeError, match=f"no entry for attention layer '{LAYER}'.*'other'"):
            sc.layer(q, k, v)


def test_per_ubatch_list_must_be_resolved_by_wrapper():
    sc = Scenario([3])
    q, k, v, md = sc.batch([(0, 3)])
    with set_forward_context([{LAYER: md}, {LAYER: md}], no_compile_layers=sc.registry):
        with pytest.raises(RuntimeError, match="resolved by UBatchWrapper"):
            get_attention_context(LAYER)


def test_missing_kv_cache():
    sc = Scenario([3])
    sc.layer.kv_cache = None
    q, k, v, md = sc.batch([(0, 3)])
    with set_forward_context({LAYER: md}, no_compile_layers=sc.registry):
        with pytest.raises(RuntimeError, match=f"'{LAYER}' has no KV cache bound"):
            sc.layer(q, k, v)


def test_bad_input_shapes_and_dtypes():
    sc = Scenario([3])
    q, k, v, md = sc.batch([(0, 3)])
    with set_forward_context({LAYER: md}, no_compile_layers=sc.registry):
        with pytest.raises(ValueError, match=r"k must be \[3, 64\], got \(3, 32\)"):
            sc.layer(q, k[:, :32], v)
        with pytest.raises(TypeError, match="v is torch.float64"):
            sc.layer(q, k, v.double())


def test_block_pool_exhaustion_and_double_free():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(RuntimeError, match="asked for 5 blocks but only 1 of 4"):
        pool.allocate(5)
    pool.free([1])
    with pytest.raises(ValueError, match="block id 1 is already free"):
        pool.free([1])
    with pytest.raises(ValueError, match="block id 9 is out of range"):
        pool.free([9])
    assert sorted(pool.allocate(2)) == [1, 3] and pool.num_free == 0


def test_metadata_building_and_validation():
    md = build_attention_metadata([3, 1], [3, 8], torch.tensor([[2, 0], [0, 1]]), torch.tensor([8, 9, 10, 7, -1, -1]))
    assert isinstance(md, AttentionMetadata)
    assert md.num_reqs == 2 and md.num_actual_tokens == 4
    assert md.query_start_loc.tolist() == [0, 3, 4] and md.query_start_loc.dtype == torch.int32
    assert md.seq_lens_cpu.tolist() == [3, 8] and md.seq_lens.dtype == torch.int32
    assert md.block_table.dtype == torch.int32 and md.slot_mapping.dtype == torch.int64
    assert (md.max_query_len, md.max_seq_len) == (3, 8)
    with pytest.raises(ValueError, match="request 1: .*query_len=5, seq_len=4"):
        build_attention_metadata([1, 5], [1, 4], torch.zeros(2, 2), torch.zeros(6))
    with pytest.raises(ValueError, match="block_table must be \\[num_reqs=2"):
        build_attention_metadata([1, 1], [1, 1], torch.zeros(3, 2), torch.zeros(2))
    with pytest.raises(ValueError, match="negative block id -1: pad rows with a valid id such as 0"):
        build_attention_metadata([1, 1], [1, 5], torch.tensor([[3, -1], [4, 5]]), torch.zeros(2))


@pytest.mark.cuda
def test_cuda_metadata_and_its_ubatch_split_upload_without_synchronizing():
    """A split step builds every ubatch's metadata; a synchronizing upload would stall the host
    until the GPU drained the previous step. The host copies are pinned and the uploads async."""
    table = torch.arange(8, dtype=torch.int32, device="cuda").view(4, 2)
    slots = torch.arange(12, device="cuda")
    md = build_attention_metadata([3, 4, 2, 3], [3, 9, 2, 5], table, slots)  # warm the pinned allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = build_attention_metadata([3, 4, 2, 3], [3, 9, 2, 5], table, slots)
        parts = split_attn_metadata(md, [UBatchSlice(slice(0, 2), slice(0, 5)), UBatchSlice(slice(1, 4), slice(5, 12))])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert md.query_start_loc_cpu.is_pinned() and md.seq_lens_cpu.is_pinned()
    assert md.query_start_loc.tolist() == [0, 3, 7, 9, 12] and md.seq_lens.tolist() == [3, 9, 2, 5]
    assert [p.query_start_loc.tolist() for p in parts] == [[0, 3, 5], [0, 2, 4, 7]]
    assert [p.seq_lens.tolist() for p in parts] == [[3, 7], [9, 2, 5]]


def test_paged_kv_cache_layout():
    cache = PagedKVCache(
        ["a", "b"],
        num_blocks=5,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float16,
        device="cpu",
    )
    assert cache["a"].shape == (2, 5, 4, 2, 8) and cache["a"].dtype == torch.float16
    assert cache["a"].data_ptr() != cache["b"].data_ptr() and list(cache) == ["a", "b"]
    with pytest.raises(KeyError, match="'c'.*'a', 'b'"):
        cache["c"]


# --- write_kv -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_write_kv_matches_a_naive_loop(data):
    num_blocks, block_size = data.draw(st.integers(1, 4)), data.draw(st.sampled_from([1, 2, 4]))
    num_slots = num_blocks * block_size
    num_rows = data.draw(st.integers(0, num_slots + 3))
    real = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=min(num_rows, num_slots)))
    slots = real + [-1] * (num_rows - len(real))
    slots = data.draw(st.permutations(slots))  # padding anywhere, not only at the end
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    cache = torch.randn(2, num_blocks, block_size, 2, 3, generator=gen)
    k, v = torch.randn(num_rows, 2, 3, generator=gen), torch.randn(num_rows, 2, 3, generator=gen)
    expect = cache.clone()
    for i, s in enumerate(slots):
        if s >= 0:
            expect[0].view(num_slots, 2, 3)[s] = k[i]
            expect[1].view(num_slots, 2, 3)[s] = v[i]
    write_kv(cache, k, v, torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(cache, expect)


def test_write_kv_validates():
    cache = torch.zeros(2, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="kv_cache must be"):
        write_kv(cache[0], torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="k dtype torch.float16"):
        write_kv(
            cache,
            torch.zeros(1, 2, 8, dtype=torch.float16),
            torch.zeros(1, 2, 8),
            torch.zeros(1, dtype=torch.int64),
        )


def _naive_write_kv(cache, k, v, slots):
    """The reference, on the CPU: a Python loop over the rows, skipping padding (slot < 0) and
    slots past the cache."""
    out = cache.cpu().clone()
    num_slots = out.shape[1] * out.shape[2]
    flat = out.view(2, num_slots, *out.shape[3:])
    for i, s in enumerate(slots.tolist()):
        if 0 <= s < num_slots:
            flat[0, s], flat[1, s] = k[i].cpu(), v[i].cpu()
    return out


def _kv_of(qkv, heads, head_dim, strided):
    """k, v [rows, heads, head_dim] from a fused [rows, 3 * heads * head_dim] qkv output: views of
    its K and V thirds (strided: rows 3 * heads * head_dim apart), or contiguous copies of them."""
    width, rows = heads * head_dim, qkv.shape[0]
    k, v = (qkv[:, i * width : (i + 1) * width].view(rows, heads, head_dim) for i in (1, 2))
    return (k, v) if strided else (k.contiguous(), v.contiguous())


def _random_slots(rng, num_rows, num_slots):
    """Distinct real slots with padding (assorted negative values) anywhere among them."""
    real = rng.sample(range(num_slots), min(rng.randint(0, num_rows), num_slots))
    slots = real + [-rng.randint(1, 3) for _ in range(num_rows - len(real))]
    rng.shuffle(slots)
    return slots


def test_write_kv_kernel_interpreted():
    """The Triton kernel itself, under Triton's CPU interpreter, against a naive loop: both
    dtypes and slot dtypes, padding anywhere, slots past the cache, strided rows, rows past the
    slot mapping, rows of one and of two blocks."""
    run_interpreted("""
import random
import torch
from ubatch.attention import kv_cache as m
rng = random.Random(0)
for dtype in (torch.float32, torch.bfloat16):
    for slot_dtype in (torch.int32, torch.int64):
        for heads, dim in ((2, 3), (10, 128)):
            cache = torch.randn(2, 3, 4, heads, dim).to(dtype)
            qkv = torch.randn(9, 3 * heads * dim).to(dtype)
            k, v = (qkv[:, i * heads * dim : (i + 1) * heads * dim].view(9, heads, dim) for i in (1, 2))
            slots = [rng.choice([-1, -2, 12, 40]) if i % 3 == 0 else s for i, s in enumerate(rng.sample(range(12), 7))]
            expect = cache.clone()
            for i, s in enumerate(slots):
                if 0 <= s < 12:
                    expect[0].view(12, heads, dim)[s], expect[1].view(12, heads, dim)[s] = k[i], v[i]
            m._write_kv_triton(cache, k, v, torch.tensor(slots, dtype=slot_dtype))
            assert torch.equal(cache, expect), (dtype, slot_dtype, heads, slots)
print("interpreted kernel ok")
""")


@pytest.fixture
def no_eager_write_kv(monkeypatch):
    """Fails a test whose write_kv falls back to the eager path."""

    def eager(*args):
        raise AssertionError("write_kv took the eager path")

    monkeypatch.setattr(kv_cache_module, "_write_kv_eager", eager)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv_slice"])
@pytest.mark.parametrize(
    "heads, head_dim", [(2, 3), (2, 64), (8, 128), (10, 128)], ids=["row6", "row128", "row1024", "row1280"]
)  # elements per row: odd, one block, a full block, two blocks (the second partial)
def test_write_kv_cuda_kernel_matches_a_naive_loop(dtype, slot_dtype, strided, heads, head_dim, no_eager_write_kv):
    rng, gen = random.Random(heads * head_dim), torch.Generator().manual_seed(heads * head_dim)
    num_blocks, block_size = 3, 4
    for num_rows, extra_rows in ((1, 0), (5, 0), (12, 3), (15, 2)):  # k/v rows past slot_mapping: ignored
        slots = torch.tensor(_random_slots(rng, num_rows, num_blocks * block_size), dtype=slot_dtype)
        qkv = torch.randn(num_rows + extra_rows, 3 * heads * head_dim, generator=gen).to(dtype)
        cache = torch.randn(2, num_blocks, block_size, heads, head_dim, generator=gen).to(dtype)
        expect = _naive_write_kv(cache, *_kv_of(qkv, heads, head_dim, strided), slots)
        cache = cache.cuda()
        k, v = _kv_of(qkv.cuda(), heads, head_dim, strided)
        write_kv(cache, k, v, slots.cuda())
        assert torch.equal(cache.cpu(), expect), (num_rows, slots)


@pytest.mark.cuda
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_cuda_skips_slots_past_the_cache(slot_dtype, no_eager_write_kv):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 2, 4, 2, 8, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(5, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([8, 3, 2**31 - 1 if slot_dtype == torch.int32 else 2**40, -1, 7], dtype=slot_dtype)
    expect = _naive_write_kv(cache, k, v, slots)
    got = cache.cuda()
    write_kv(got, k.cuda(), v.cuda(), slots.cuda())
    assert torch.equal(got.cpu(), expect)
    only_past = cache.cuda()
    write_kv(only_past, k.cuda(), v.cuda(), torch.tensor([8, 9, 100, -1, -5], dtype=slot_dtype, device="cuda"))
    assert torch.equal(only_past.cpu(), cache)


@pytest.mark.cuda
def test_write_kv_cuda_is_one_kernel(no_eager_write_kv):
    """Every K and V row, strided rows, padding: all in one launch of the Triton kernel."""
    from ubatch.bench.kernels import profile_kernels

    cache = torch.zeros(2, 4, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    k, v = _kv_of(torch.randn(40, 3 * 8 * 128, device="cuda").to(torch.bfloat16), 8, 128, strided=True)
    slots = torch.tensor(_random_slots(random.Random(0), 32, 64), dtype=torch.int32, device="cuda")
    kernels = profile_kernels(lambda: write_kv(cache, k, v, slots), torch.device("cuda"))
    assert len(kernels) == 1 and "_write_kv_kernel" in kernels[0].name, kernels


@pytest.mark.cuda
def test_write_kv_cuda_falls_back_for_layouts_the_kernel_does_not_take(monkeypatch):
    """A cache that is not contiguous, or k/v rows whose heads are strided, take the eager path,
    with the same result."""
    calls = []
    eager = kv_cache_module._write_kv_eager
    monkeypatch.setattr(kv_cache_module, "_write_kv_eager", lambda *args: calls.append(1) or eager(*args))
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([5, -1, 0, 7, -1, 2], dtype=torch.int64)
    wide_cache = torch.randn(2, 2, 4, 2, 16, generator=gen)  # a cache view with head_dim 8 of 16
    k, v = (torch.randn(2, 6, 8, generator=gen).transpose(0, 1) for _ in range(2))  # heads 6 * 8 apart
    expect = _naive_write_kv(wide_cache[..., :8], k, v, slots)
    cache = wide_cache.cuda()[..., :8]
    write_kv(cache, k.cuda(), v.cuda(), slots.cuda())  # both reasons at once
    assert torch.equal(cache.cpu(), expect) and len(calls) == 1
    cache = wide_cache[..., :8].contiguous().cuda()
    write_kv(cache, k.cuda(), v.cuda(), slots.cuda())
    assert torch.equal(cache.cpu(), expect) and len(calls) == 2
    cache = wide_cache.cuda()[..., :8]
    write_kv(cache, k.contiguous().cuda(), v.contiguous().cuda(), slots.cuda())
    assert torch.equal(cache.cpu(), expect) and len(calls) == 3


@pytest.mark.cuda
def test_write_kv_cuda_graph_replays_with_new_slots_and_rows(no_eager_write_kv):
    """Captured once, replayed on new contents of the same buffers: slots (padding moved, some
    past the cache) and K/V rows are read on the device at every replay."""
    heads, head_dim, num_blocks, block_size, num_rows = 4, 64, 4, 4, 10
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    cache_before = torch.randn(2, num_blocks, block_size, heads, head_dim, generator=gen).to(torch.bfloat16)
    cache = cache_before.cuda()
    qkv = torch.zeros(num_rows + 2, 3 * heads * head_dim, dtype=torch.bfloat16, device="cuda")
    slots = torch.full((num_rows,), -1, dtype=torch.int64, device="cuda")
    k, v = _kv_of(qkv, heads, head_dim, strided=True)
    write_kv(cache, k, v, slots)  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv(cache, k, v, slots)
    for step in range(3):
        new_slots = torch.tensor(_random_slots(rng, num_rows, num_blocks * block_size), dtype=torch.int64)
        new_slots[step] = num_blocks * block_size + step  # past the cache: not written
        new_qkv = torch.randn(qkv.shape, generator=gen).to(torch.bfloat16)
        expect = _naive_write_kv(cache_before, *_kv_of(new_qkv, heads, head_dim, strided=True), new_slots)
        slots.copy_(new_slots)
        qkv.copy_(new_qkv)
        cache.copy_(cache_before)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache.cpu(), expect), step


# --- flash-attn glue, against fake modules that check their arguments ----------------------


def _as_metadata(cu_q, seq_lens, block_table, causal):
    query_lens = (cu_q[1:] - cu_q[:-1]).tolist()
    seq_lens = seq_lens.tolist()
    assert all(0 <= q <= s for q, s in zip(query_lens, seq_lens))
    return build_attention_metadata(query_lens, seq_lens, block_table, torch.full((int(cu_q[-1]),), -1), causal=causal)


def _check_common(q, k_cache, v_cache, cu_q, block_table, max_q, scale, causal):
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert q.shape[1] % k_cache.shape[2] == 0 and q.shape[2] == k_cache.shape[3]
    assert cu_q.dtype == torch.int32 and block_table.dtype == torch.int32
    assert cu_q.shape == (block_table.shape[0] + 1,) and int(cu_q[0]) == 0
    assert int(cu_q[-1]) == q.shape[0], "q must hold exactly the real tokens"
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
    assert causal is True and isinstance(scale, float)


def _run_reference(q, k_cache, v_cache, md, scale):
    return TorchBackend().forward(q, torch.stack([k_cache, v_cache]), md, scale)


def fake_fa3(
    q,
    k_cache,
    v_cache,
    *,
    cache_seqlens,
    page_table,
    cu_seqlens_q,
    max_seqlen_q,
    softmax_scale,
    causal,
):
    _check_common(q, k_cache, v_cache, cu_seqlens_q, page_table, max_seqlen_q, softmax_scale, causal)
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (page_table.shape[0],)
    md = _as_metadata(cu_seqlens_q, cache_seqlens, page_table, causal)
    return _run_reference(q, k_cache, v_cache, md, softmax_scale)


def fake_fa4(
    q,
    k,
    v,
    *,
    cu_seqlens_q,
    max_seqlen_q,
    seqused_k,
    page_table,
    softmax_scale,
    causal,
):
    """No ``max_seqlen_k``: a host value would be frozen into a FULL graph; FA4 bounds it by
    the page-table row itself."""
    _check_common(q, k, v, cu_seqlens_q, page_table, max_seqlen_q, softmax_scale, causal)
    assert seqused_k.dtype == torch.int32
    md = _as_metadata(cu_seqlens_q, seqused_k, page_table, causal)
    out = _run_reference(q, k, v, md, softmax_scale)
    return out, torch.zeros(q.shape[1], q.shape[0])  # FA4 returns (out, lse)


def fake_fa2(
    q,
    k,
    v,
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    block_table,
):
    _check_common(q, k, v, cu_seqlens_q, block_table, max_seqlen_q, softmax_scale, causal)
    assert k.shape[1] % 256 == 0
    assert cu_seqlens_k.dtype == torch.int32 and cu_seqlens_k.shape == cu_seqlens_q.shape
    seq_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    assert max_seqlen_k == int(seq_lens.max())
    md = _as_metadata(cu_seqlens_q, seq_lens, block_table, causal)
    return _run_reference(q, k, v, md, softmax_scale)


FAKES = {
    "fa3": ("flash_attn_interface", "flash_attn_with_kvcache", fake_fa3),
    "fa4": ("flash_attn.cute.interface", "flash_attn_varlen_func", fake_fa4),
    "fa2": ("flash_attn", "flash_attn_varlen_func", fake_fa2),
}


def install_fakes(monkeypatch, versions, *, triton=False):
    """Make exactly ``versions`` importable (None in sys.modules makes an import fail), and Triton
    usable or not (``triton``)."""
    monkeypatch.setattr(backends_module, "triton_available", lambda device: triton)
    for name in (
        "flash_attn_interface",
        "flash_attn",
        "flash_attn.cute",
        "flash_attn.cute.interface",
    ):
        monkeypatch.setitem(sys.modules, name, None)
    for version in versions:
        module, attr, fn = FAKES[version]
        monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{attr: fn}))


@pytest.mark.parametrize(
    "present, chosen",
    [(["fa3", "fa4", "fa2"], "fa3"), (["fa4", "fa2"], "fa4"), (["fa2"], "fa2")],
)
def test_flash_preference_order(monkeypatch, present, chosen):
    install_fakes(monkeypatch, present)
    backend = get_backend("flash", "cuda")
    assert isinstance(backend, FlashAttentionBackend) and backend.version == chosen
    assert isinstance(get_backend(None, "cuda"), FlashAttentionBackend)
    assert available_backends("cuda") == ["torch", "flash"]
    assert isinstance(get_backend(None, "cpu"), TorchBackend)


@pytest.mark.parametrize("flash", [["fa4"], []], ids=["flash", "no-flash"])
def test_the_decode_kernel_fronts_the_automatic_choice_where_triton_runs(monkeypatch, flash):
    """None and "triton": the decode kernel in front of flash-attn (torch for what it cannot
    run) or torch; "flash" stays flash-attn alone; without Triton, None is the inner choice and
    "triton" an error."""
    install_fakes(monkeypatch, flash, triton=True)
    for name in (None, "triton"):
        backend = get_backend(name, "cuda")
        assert isinstance(backend, backends_module.DecodeKernelBackend)
        if flash:
            assert isinstance(backend.inner, FlashAttentionBackend) and backend.inner.version == "fa4"
            assert isinstance(backend.inner.fallback, TorchBackend)
        else:
            assert isinstance(backend.inner, TorchBackend)
    if flash:
        assert isinstance(get_backend("flash", "cuda"), FlashAttentionBackend)
    assert available_backends("cuda") == ["torch", *(["flash"] if flash else []), "triton"]
    install_fakes(monkeypatch, flash, triton=False)
    assert not isinstance(get_backend(None, "cuda"), backends_module.DecodeKernelBackend)
    with pytest.raises(RuntimeError, match="'triton' needs Triton"):
        get_backend("triton", "cuda")


def test_flash_missing_package(monkeypatch):
    install_fakes(monkeypatch, [])
    with pytest.raises(RuntimeError, match=r"flash_attn_interface.*flash_attn\.cute.*pip install ubatch\[flash\]"):
        get_backend("flash", "cuda")
    assert isinstance(get_backend(None, "cuda"), TorchBackend)
    assert available_backends("cuda") == ["torch"]


@pytest.mark.parametrize("version", ["fa3", "fa4", "fa2"])
@pytest.mark.parametrize("heads", GQA, ids=["mha", "gqa"])
def test_flash_glue_matches_reference(monkeypatch, version, heads):
    install_fakes(monkeypatch, [version])
    backend, _ = load_flash_attn()
    assert backend.version == version
    rng = random.Random(7)
    lengths = [rng.randint(1, 30) for _ in range(4)]
    sc = Scenario(
        lengths,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        block_size=256 if version == "fa2" else 16,
        backend=backend,
        dtype=torch.bfloat16,  # flash-attn's dtypes
        seed=7,
    )
    for chunks, pad in random_schedule(lengths, rng):
        sc.step(chunks, num_pad=pad, atol=2e-2, rtol=2e-2)
    sc.check_cache()


@pytest.mark.parametrize("chosen_by", ["name", "auto"])
def test_flash_takes_only_half_precision_and_auto_hands_the_rest_to_torch(monkeypatch, chosen_by):
    install_fakes(monkeypatch, ["fa4"])
    backend = get_backend("flash" if chosen_by == "name" else None, "cuda")
    sc = Scenario([9, 4], block_size=16, backend=backend, seed=3)  # float32
    if chosen_by == "name":
        with pytest.raises(TypeError, match=r"float16 / bfloat16 .* got torch\.float32 with head size 16"):
            sc.step([(0, 9), (1, 4)])
    else:
        assert isinstance(backend.fallback, TorchBackend)
        sc.step([(0, 9), (1, 4)])
        sc.check_cache()


def test_fa2_rejects_small_blocks(monkeypatch):
    install_fakes(monkeypatch, ["fa2"])
    sc = Scenario([5], block_size=16, backend=load_flash_attn()[0], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_size % 256 == 0, got block_size=16"):
        sc.step([(0, 5)])


@pytest.mark.parametrize(
    "version, head_dim, dtype, block_size",
    [
        ("fa4", 128, torch.bfloat16, 128),
        ("fa4", 64, torch.float16, 128),
        ("fa4", 256, torch.bfloat16, 16),
        ("fa4", 128, torch.float32, 16),
        ("fa2", 128, torch.bfloat16, 256),
        ("fa3", 128, torch.bfloat16, 16),
    ],
)
def test_preferred_block_size_is_the_page_the_kernel_reads_fastest(monkeypatch, version, head_dim, dtype, block_size):
    """flash-attn 4 reads pages with TMA only when a page is its key tile; fp32 goes to torch."""
    install_fakes(monkeypatch, [version])
    assert preferred_block_size(load_flash_attn()[0], head_dim, dtype) == block_size
    assert preferred_block_size(TorchBackend(), head_dim, dtype) == 16


def test_a_freely_sized_cache_takes_the_page_size_of_the_models_backend(monkeypatch):
    install_fakes(monkeypatch, ["fa4"])
    config = ModelConfig.preset("tiny", dtype=torch.bfloat16)
    model = build_model(config, device="cpu", attn_backend=load_flash_attn()[0])
    assert PagedKVCache.preferred_block_size(model) == 128
    step, cache = make_step(model, [1] * 3, [200] * 3)
    assert cache.block_size == 128 and cache.num_blocks == 6  # 201 tokens a request: two pages each
    assert next(iter(step.attn_metadata.values())).block_table.shape == (3, 2)
    assert make_step(model, [1] * 3, [200] * 3, block_size=16)[1].block_size == 16
    assert make_step(build_model(ModelConfig.preset("tiny"), device="cpu"), [2], [5])[1].block_size == 16


# --- CUDA (run on the GPU machine) --------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 2e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("heads", GQA, ids=["mha", "gqa"])
def test_torch_backend_cuda_low_precision(dtype, atol, heads):
    rng = random.Random(3)
    lengths = [rng.randint(1, 200) for _ in range(6)]
    sc = Scenario(
        lengths,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=64,
        block_size=16,
        backend="torch",
        dtype=dtype,
        device="cuda",
        seed=3,
    )
    for chunks, pad in random_schedule(lengths, rng):
        sc.step(chunks, num_pad=pad, atol=atol, rtol=atol)
    sc.check_cache()


def _backend_or_skip(name):
    """``name`` itself, or for "flash" the flash-attn backend where one is importable (the GPU
    image has none: ``GPU_CHECK_PARTS=flash`` unpacks flash-attn 4 from ``.fa4/``)."""
    if name != "flash":
        return name
    backend = load_flash_attn()[0]
    if backend is None:
        pytest.skip("no flash-attn importable")
    return backend


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads", GQA, ids=["mha", "gqa"])
def test_flash_backend_cuda_matches_the_reference(block_size, heads):
    """flash-attn reading the paged cache in place, on the schedules the torch backend meets."""
    rng = random.Random(block_size)
    lengths = [rng.randint(1, 300) for _ in range(6)]
    sc = Scenario(
        lengths,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=128,
        block_size=block_size,
        backend=_backend_or_skip("flash"),
        dtype=torch.bfloat16,
        device="cuda",
        seed=5,
    )
    for chunks, pad in random_schedule(lengths, rng):
        sc.step(chunks, num_pad=pad, atol=2e-2, rtol=2e-2)
    sc.check_cache()


def test_triton_backend_through_the_layer_interpreted():
    """The same schedule as the CUDA test below on the CPU, the decode kernel under Triton's
    interpreter (fp16: the interpreter miscomputes bf16 dots) in front of the torch backend."""
    run_interpreted("""
import torch
from tests.test_attention import Scenario
from ubatch.attention import backends, decode_kernel
decode_kernel.triton_available = lambda device: True  # the interpreter runs the kernel on CPU tensors
decode_kernel._sm_count = lambda device: 132  # an H100's, for the split heuristic
backend = backends.DecodeKernelBackend(backends.TorchBackend())
calls = []
real = backends.decode_attention
backends.decode_attention = lambda *args, **kwargs: calls.append(kwargs["query_len"]) or real(*args, **kwargs)
lengths = [40, 37, 70, 33]
sc = Scenario(lengths, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, backend=backend,
              dtype=torch.float16, device="cpu", seed=6)
sc.step([(r, 20) for r in range(len(lengths))], atol=4e-3, rtol=4e-3)  # 80 rows a KV head: the torch backend
for query_len in (1, 3, 1):
    sc.step([(r, query_len) for r in range(len(lengths))], num_pad=2, atol=4e-3, rtol=4e-3)
sc.step([(0, 1), (1, 2), (2, 1)], atol=4e-3, rtol=4e-3)
sc.check_cache()
assert calls == [1, 3, 1], calls
print("interpreted kernel ok")
""")


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads", GQA, ids=["mha", "gqa"])
def test_triton_backend_cuda_matches_the_reference(block_size, heads):
    """The decode kernel through the layer (backend "triton"): decode steps, steps verifying two
    drafted tokens per request, with padding rows, and a mixed step it hands to the inner backend."""
    lengths = [140, 90, 260, 129, 80]
    sc = Scenario(
        lengths,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=128,
        block_size=block_size,
        backend="triton",
        dtype=torch.bfloat16,
        device="cuda",
        seed=6,
    )
    sc.step([(r, 70) for r in range(len(lengths))], atol=2e-2, rtol=2e-2)  # over 64 rows a KV head: the inner backend
    for query_len in (1, 3, 1, 1, 3):
        sc.step([(r, query_len) for r in range(len(lengths))], num_pad=2, atol=2e-2, rtol=2e-2)
    sc.step([(0, 1), (1, 2), (2, 1)], atol=2e-2, rtol=2e-2)  # uneven: the inner backend
    sc.check_cache()


@pytest.mark.cuda
def test_flash_backend_is_sync_free_on_a_mixed_batch():
    flash = _backend_or_skip("flash")
    sc = Scenario(
        [70, 33, 90, 12],
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        backend=flash,
        dtype=torch.bfloat16,
        device="cuda",
        seed=8,
    )
    sc.step([(0, 50), (1, 33), (2, 20)], atol=2e-2, rtol=2e-2)  # first call: kernels compiled
    q, _, _, md = sc.batch([(3, 12), (0, 7), (1, 0), (2, 1)], num_pad=3)
    qh = q[: md.num_actual_tokens].view(md.num_actual_tokens, 8, 128)
    flash.forward(qh, sc.layer.kv_cache, md, sc.layer.scale)  # this batch's kernel variant compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flash.forward(qh, sc.layer.kv_cache, md, sc.layer.scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "flash"])
def test_cuda_graph_replay_matches_eager(backend):
    sc = Scenario(
        [40, 25, 60, 9],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        backend=_backend_or_skip(backend),
        dtype=torch.bfloat16,
        device="cuda",
        seed=4,
    )
    sc.step([(0, 30), (1, 20), (2, 50), (3, 5)], atol=2e-2, rtol=2e-2)  # context in the cache
    q, k, v, md = sc.batch([(0, 3), (1, 1), (2, 1), (3, 2)], num_pad=3)  # fixed shapes
    cache = sc.layer.kv_cache
    cache_before = cache.clone()
    ctx = dict(attn_metadata={LAYER: md}, no_compile_layers=sc.registry)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), set_forward_context(**ctx):
        for _ in range(2):  # warm-up outside the capture
            sc.layer(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with set_forward_context(**ctx), torch.cuda.graph(graph):
        static_out = sc.layer(q, k, v)

    for t in (q, k, v):  # new inputs into the captured buffers
        t.copy_(torch.randn_like(t))
    cache.copy_(cache_before)
    graph.replay()
    torch.cuda.synchronize()
    graph_out, graph_cache = static_out.clone(), cache.clone()

    cache.copy_(cache_before)
    with set_forward_context(**ctx):
        eager_out = sc.layer(q, k, v)
    torch.testing.assert_close(graph_out, eager_out, atol=1e-3, rtol=1e-3)
    assert torch.equal(graph_cache, cache)
    assert torch.count_nonzero(graph_out[md.num_actual_tokens :]) == 0
    assert not torch.equal(graph_cache, cache_before)  # the replay did write this step's KV
    assert math.isfinite(graph_out.float().abs().max().item())


# --- TorchBackend on torch's built-in varlen flash kernel (faked on CPU, real in the cuda tests) ---


@pytest.fixture
def builtin_flash():
    with fake_builtin_flash_enabled() as calls:
        yield calls


@pytest.mark.parametrize("seed", range(4))
def test_builtin_flash_path_matches_the_reference_on_random_mixed_batches(seed, builtin_flash):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
    heads = rng.choice(GQA)
    sc = Scenario(lengths, num_heads=heads[0], num_kv_heads=heads[1], block_size=rng.choice([1, 4, 16]), seed=seed)
    steps = random_schedule(lengths, rng)
    for chunks, pad in steps:
        sc.step(chunks, num_pad=pad)
    sc.check_cache()
    assert len(steps) <= len(builtin_flash) <= 3 * len(steps), "decodes at either end, the rest: one call each"


def test_builtin_flash_path_gives_decodes_at_either_end_a_call_of_their_own(builtin_flash):
    """A call holding only decodes lets the kernel fold a KV head's query heads into one tile."""
    sc = Scenario([9, 7, 20, 6, 12, 5], num_heads=8, num_kv_heads=2, block_size=4, seed=11)
    sc.step([(0, 8), (1, 6), (2, 10), (3, 5), (4, 8), (5, 4)])
    sc.step([(0, 1), (1, 1), (2, 5), (3, 0), (4, 3), (5, 1)], num_pad=2)
    assert builtin_flash == [(41, 10), (2, 1), (8, 5), (1, 1)]


@settings(max_examples=60, deadline=None)
@given(query_lens=st.lists(st.sampled_from([0, 1, 1, 1, 2, 5]), min_size=1, max_size=8), seed=st.integers(0, 99))
def test_builtin_flash_path_on_decodes_and_empty_requests_anywhere_matches_the_reference(query_lens, seed):
    """Decode runs at either end, empty requests beside them: every call keeps the kernel's
    rules (the fake checks one query per request at ``max_seqlen_q == 1``) and the result is
    the reference's."""
    contexts = [3 + (seed * (r + 1)) % 9 for r in range(len(query_lens))]
    sc = Scenario([c + n for c, n in zip(contexts, query_lens)], num_heads=8, num_kv_heads=2, block_size=4, seed=seed)
    with fake_builtin_flash_enabled():
        sc.step(list(enumerate(contexts)))
        sc.step(list(enumerate(query_lens)), num_pad=seed % 3)


def test_builtin_flash_path_under_a_capture_is_one_call_over_equal_slots(builtin_flash, monkeypatch):
    """Host-side lengths are frozen in a graph, so a captured batch depends on shapes alone."""
    from ubatch.attention import varlen

    sc = Scenario([9, 7, 20], num_heads=8, num_kv_heads=2, block_size=4, seed=12)
    sc.step([(0, 8), (1, 6), (2, 10)])
    monkeypatch.setattr(varlen, "_capturing", lambda device: True)
    sc.step([(0, 1), (1, 1), (2, 5)], num_pad=2)
    assert builtin_flash == [(24, 10), (7, 5)]


def test_decode_ends_splits_off_leading_and_trailing_decodes():
    from ubatch.attention.varlen import decode_ends

    assert decode_ends([1, 1, 5, 0, 3, 1]) == [(0, 2), (2, 5), (5, 6)]
    assert decode_ends([1, 1]) == [(0, 2)]
    assert decode_ends([1, 0, 1]) == [(0, 1), (1, 2), (2, 3)]
    assert decode_ends([4, 1, 3]) == [(0, 3)]
    assert decode_ends([2, 1]) == [(0, 1), (1, 2)]
    assert decode_ends([]) == []


def test_builtin_flash_path_keeps_empty_requests_off_the_decode_only_kernel(builtin_flash):
    """At ``max_seqlen_q == 1`` the kernel assumes one query per request (the fake checks it)."""
    sc = Scenario([9, 7, 20, 6, 5], num_heads=8, num_kv_heads=2, block_size=4, seed=13)
    sc.step([(0, 8), (1, 6), (2, 10), (3, 5), (4, 4)])
    sc.step([(0, 1), (1, 0), (2, 1), (3, 0), (4, 1)], num_pad=1)
    assert builtin_flash[1:] == [(1, 1), (1, 2), (1, 1)]


def test_builtin_flash_false_keeps_the_sdpa_runs(builtin_flash):
    sc = Scenario([12, 9], num_heads=8, num_kv_heads=2, block_size=4, seed=9, backend=TorchBackend(builtin_flash=False))
    sc.step([(0, 5), (1, 9)])
    sc.step([(0, 1), (1, 0)])
    assert builtin_flash == []
    with pytest.raises(TypeError, match="builtin_flash must be a bool, got 'yes'"):
        TorchBackend(builtin_flash="yes")


def test_packed_slots_hold_each_request_s_own_blocks():
    from ubatch.attention.varlen import packed_slots

    table = torch.tensor([[5, 6, 7, 8], [9, 0, 0, 0], [3, 4, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([13, 3, 6], dtype=torch.int32)
    blocks, cum_seq_k, max_k = packed_slots(table, seq_lens, seq_lens.clone(), block_size=4)  # 4, 1 and 2 blocks
    assert blocks.tolist() == [5, 6, 7, 8, 9, 3, 4]
    assert cum_seq_k.dtype == torch.int32 and cum_seq_k.tolist() == [0, 16, 20, 28] and max_k == 16


@pytest.mark.parametrize("device, dtype", [("cpu", torch.bfloat16), ("cpu", torch.float32)])
def test_builtin_flash_is_only_for_cuda_half_precision(device, dtype):
    from ubatch.attention.varlen import builtin_flash_supports

    assert not builtin_flash_supports(torch.zeros(2, 4, 64, device=device, dtype=dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_torch_backend_takes_the_builtin_flash_kernel_sync_free_and_agrees_with_sdpa(dtype, monkeypatch):
    """On the GPU machine the torch backend's half-precision path is the built-in varlen flash
    kernel; on a mixed batch (prompt, continuation, decodes, padding) it never waits for the GPU
    and agrees with its SDPA path."""
    from ubatch.attention import backends
    from ubatch.attention.varlen import builtin_flash_supports

    assert builtin_flash_supports(torch.empty(1, 8, 64, device="cuda", dtype=dtype))
    sc = Scenario(
        [70, 33, 90, 12], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, device="cuda", seed=8
    )
    sc.step([(0, 50), (1, 33), (2, 20)], atol=2e-2, rtol=2e-2)
    q, _, _, md = sc.batch([(3, 12), (0, 7), (1, 0), (2, 1)], num_pad=3)
    qh = q[: md.num_actual_tokens].view(md.num_actual_tokens, 8, 64)
    torch.cuda.set_sync_debug_mode("error")
    try:
        flash = backends.TorchBackend().forward(qh, sc.layer.kv_cache, md, sc.layer.scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(backends, "builtin_flash_supports", lambda q: False)
    sdpa = backends.TorchBackend().forward(qh, sc.layer.kv_cache, md, sc.layer.scale)
    torch.testing.assert_close(flash, sdpa, atol=2e-2, rtol=2e-2)
