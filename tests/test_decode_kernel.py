"""The flash-decoding kernel over the paged KV cache: under Triton's CPU interpreter against a
torch reference (one query token per request, and several, causal), on CUDA including a graph
replayed with new lengths and blocks, and its input checks and split heuristic (no Triton
needed)."""

import pytest
import torch

from tests.interpreted import run_interpreted
from ubatch.attention import decode_kernel
from ubatch.attention.decode_kernel import decode_attention, decode_kernel_takes

# The kernel rounds only twice (the probabilities to q's dtype for P @ V, the output); against a
# float32 reference that leaves a few ulps of the output's dtype: bf16 has 8 significant bits
# (ulp 2^-7 near 1), fp16 11 (2^-10). Outputs are averages of unit-normal values, so |out| < ~3.
TOL = {torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}, torch.float16: {"atol": 4e-3, "rtol": 4e-3}}


def make_case(num_heads, kv_heads, head_dim, block_size, max_blocks, lengths, dtype, device="cpu", seed=0, query_len=1):
    """(q, kv_cache, block_table, seq_lens) for requests of ``lengths`` with ``query_len`` query
    tokens each (q [requests * query_len, heads, head_dim]): each request's pages are
    distinct shuffled block ids, the table's entries past its last page are 0, and every cache
    slot no request reads (block 0, the tail of each last page) holds NaN, so a read past a
    request's length shows up in its output."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(lengths)
    num_blocks = num_reqs * max_blocks + 1
    q = torch.randn(num_reqs * query_len, num_heads, head_dim, generator=gen).to(dtype)
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: num_reqs * max_blocks].view(num_reqs, max_blocks)
    keys = torch.arange(max_blocks * block_size)
    for r, length in enumerate(lengths):
        table[r, -(-length // block_size) :] = 0
        live = keys[: min(length, len(keys))]
        slots = table[r, live // block_size] * block_size + live % block_size
        new = torch.randn(2, len(slots), kv_heads, head_dim, generator=gen)
        kv_cache.view(2, -1, kv_heads, head_dim)[:, slots] = new.to(dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, kv_cache, table.to(torch.int32), seq_lens))


def reference_decode(q, kv_cache, block_table, seq_lens, scale, query_len=1):
    """Each request's query tokens over its keys, gathered through the block table, in float32,
    grouped heads: token t of a request's ``query_len`` sees keys 0 .. seq_len - query_len + t,
    a length past the table's end read as the table's; zeros for a token that sees none."""
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = num_tokens // query_len
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    keys = torch.arange(block_table.shape[1] * block_size, device=q.device)
    slots = block_table.long()[:, keys // block_size] * block_size + keys % block_size
    seq_lens = seq_lens.clamp(max=len(keys))
    live = keys.view(1, -1) < seq_lens.view(-1, 1)
    k, v = (kv_cache[i].flatten(0, 1)[slots].float().masked_fill(~live[..., None, None], 0.0) for i in (0, 1))
    tokens = torch.arange(query_len, device=q.device)
    seen = live[:, None, :] & (keys.view(1, 1, -1) <= (seq_lens.view(-1, 1) - query_len + tokens).unsqueeze(-1))
    grouped = q.float().view(num_reqs, query_len, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.einsum("rtkgd,rnkd->rtkgn", grouped, k) * scale
    probs = scores.masked_fill(~seen[:, :, None, None, :], float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("rtkgn,rnkd->rtkgd", probs, v).reshape(num_tokens, num_heads, head_dim)


def lengths_for(block_size, max_blocks, seed):
    """0, 1, one page exactly, the full table, past the table (read as full), and random ones."""
    gen = torch.Generator().manual_seed(seed)
    full = block_size * max_blocks
    return [0, 1, block_size, full, full + 5, *torch.randint(2, full, (3,), generator=gen).tolist()]


# (num_heads, kv_heads, head_dim, block_size, max_blocks): groups of 1, 4 and 8, head_dim 64 and
# 128, pages of 16 and 64 tokens
CONFIGS = [(4, 4, 64, 16, 12), (8, 2, 128, 64, 3), (16, 2, 64, 16, 6)]


def check_case(config, dtype, num_splits, launch, device="cpu", seed=0, query_len=1):
    """``launch`` on one config's case, ``query_len`` query tokens per request, against the
    reference."""
    head_dim, block_size, max_blocks = config[2:]
    lengths = lengths_for(block_size, max_blocks, seed)
    q, kv_cache, table, lens = make_case(*config, lengths, dtype, device, seed, query_len)
    scale = head_dim**-0.5
    assert decode_kernel._input_error(q, kv_cache, table, lens, query_len) is None
    out = launch(q, kv_cache, table, lens, scale, num_splits, query_len)
    assert out.shape == q.shape and out.dtype == dtype
    assert not out.isnan().any(), (config, num_splits, query_len)
    assert out[:query_len].eq(0).all(), "a request of length 0 gets zeros"
    want = reference_decode(q, kv_cache, table, lens, scale, query_len)
    torch.testing.assert_close(
        out.float(), want, **TOL[dtype], msg=lambda m: f"{config} {dtype} splits {num_splits} x{query_len}: {m}"
    )


def test_kernel_interpreted():
    """The kernels under Triton's CPU interpreter: every config with one split, three splits
    (the later ones empty for short requests, as the per-split floor of chunks leaves them) and
    three splits with no floor (every split of a long request busy), each split setting once per
    config, with one query token per request or with three (causal: a request of one key has
    tokens that see none); the CUDA test runs every combination. fp16 only: the interpreter
    (Triton 3.5) multiplies bf16 tl.dot operands as their uint16 bit patterns."""
    run_interpreted(
        """
import torch
from tests.test_decode_kernel import CONFIGS, check_case
from ubatch.attention import decode_kernel as m
for config in CONFIGS:
    for query_len, num_splits, min_chunks in ((1, 1, 4), (3, 3, 4), (1, 3, 1)):
        m._MIN_SPLIT_CHUNKS = min_chunks
        check_case(config, torch.float16, num_splits, m._launch, query_len=query_len)
print("interpreted kernel ok")
""",
        timeout=300,
    )


def cuda_launch(q, kv_cache, table, lens, scale, num_splits, query_len):
    return decode_attention(q, kv_cache, table, lens, scale, query_len=query_len, num_splits=num_splits)


@pytest.mark.cuda
@pytest.mark.parametrize("query_len", [1, 3])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 32])
@pytest.mark.parametrize("config", CONFIGS, ids=["group1", "group4", "group8"])
def test_cuda_matches_the_reference(config, num_splits, query_len):
    for dtype in (torch.bfloat16, torch.float16):
        check_case(config, dtype, num_splits, cuda_launch, "cuda", seed=1, query_len=query_len)


@pytest.mark.cuda
def test_cuda_large_decode_batch():
    """The shape the kernel was written for: 1024 requests x 512 cached tokens, 32 query heads on
    8 KV heads of 128, pages of 128 (one split: 8192 programs fill an H100)."""
    lengths = [512] * 1000 + [0, 1, 128, 511] * 6
    q, kv_cache, table, lens = make_case(32, 8, 128, 128, 4, lengths, torch.bfloat16, "cuda")
    assert decode_kernel_takes(q, kv_cache, table, lens)
    out = decode_attention(q, kv_cache, table, lens, 128**-0.5)
    torch.testing.assert_close(
        out.float(), reference_decode(q, kv_cache, table, lens, 128**-0.5), **TOL[torch.bfloat16]
    )


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_cuda_graph_replays_with_new_lengths_and_blocks(num_splits):
    """Captured once, replayed after the lengths, block ids and queries change in place: the
    host decides nothing from their values."""
    config = (16, 4, 128, 16, 8)
    first = make_case(*config, [5, 128, 0, 77, 1, 40], torch.bfloat16, "cuda", seed=2)
    second = make_case(*config, [128, 0, 33, 16, 100, 2], torch.bfloat16, "cuda", seed=3)
    static = tuple(t.clone() for t in first)
    scale = 128**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        decode_attention(*static, scale, num_splits=num_splits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(*static, scale, num_splits=num_splits)
    for case in (second, first):
        for target, new in zip(static, case):
            target.copy_(new)
        graph.replay()
        torch.testing.assert_close(out.float(), reference_decode(*case, scale), **TOL[torch.bfloat16])


@pytest.mark.cuda
def test_cuda_kernel_takes_says_no_without_raising():
    q, kv_cache, table, lens = make_case(8, 2, 128, 16, 2, [3], torch.bfloat16, "cuda")
    assert decode_kernel_takes(q, kv_cache, table, lens)
    assert not decode_kernel_takes(q.float(), kv_cache, table, lens)
    assert not decode_kernel_takes(q[..., :96], kv_cache[..., :96], table, lens)
    assert not decode_kernel_takes(q, kv_cache, table.long(), lens)
    assert not decode_kernel_takes(q.cpu(), kv_cache, table, lens)


def small_case(num_heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16):
    return make_case(num_heads, kv_heads, head_dim, block_size, 2, [3, 20], dtype)


@pytest.mark.parametrize("name", ["num_splits", "query_len"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "2"])
def test_num_splits_and_query_len_must_be_positive_ints(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got {value!r}"):
        decode_attention(*small_case(), 0.125, **{name: value})


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, c, t, s: (q[0], c, t, s), ValueError, r"q must be \[num_reqs \* query_len, num_heads, head_dim\]"),
        (lambda q, c, t, s: (q, c[0], t, s), ValueError, "kv_cache must be"),
        (lambda q, c, t, s: (q, c, t[:1], s), ValueError, r"block_table must be \[2, max_blocks\]"),
        (lambda q, c, t, s: (q, c, t, s[:1]), ValueError, r"seq_lens must be \[2\]"),
        (lambda q, c, t, s: (q[:, :5], c, t, s), ValueError, "num_heads 5 is not a multiple of kv_heads 2"),
        (lambda q, c, t, s: (q.float(), c.float(), t, s), TypeError, "q dtype torch.float32"),
        (lambda q, c, t, s: (q, c.bfloat16(), t, s), TypeError, "kv_cache dtype torch.bfloat16"),
        (lambda q, c, t, s: (q, c, t.long(), s), TypeError, "block_table must be int32, got torch.int64"),
        (lambda q, c, t, s: (q, c, t, s.long()), TypeError, "seq_lens must be int32"),
        (lambda q, c, t, s: (q, c, t, s.to("meta")), ValueError, "seq_lens is on meta"),
        (lambda q, c, t, s: (q[..., :48], c[..., :48], t, s), ValueError, "head_dim 48 is not a power of two"),
        (lambda q, c, t, s: (q, c[..., :32], t, s), ValueError, "kv_cache head_dim 32 differs from q's 64"),
        (lambda q, c, t, s: (q[..., ::2], c[..., ::2], t, s), ValueError, "dense last dim"),
        (lambda q, c, t, s: (q, c[:, :, :8], t, s), ValueError, "block_size 8 is not a power of two >= 16"),
    ],
)
def test_bad_inputs_raise_and_are_not_taken(change, error, match, monkeypatch):
    """Each bad input raises, naming the value; ``decode_kernel_takes`` says no, even where Triton
    would run (patched in), rather than raising."""
    inputs = change(*small_case())
    with pytest.raises(error, match=match):
        decode_attention(*inputs, 0.125)
    monkeypatch.setattr(decode_kernel, "triton_available", lambda device: True)
    assert not decode_kernel_takes(*inputs)


def test_more_than_64_rows_per_kv_head_are_refused():
    """A tile row per query head of a KV head and query token: 16 heads x 4 tokens fit, 16 x 5 do
    not, nor do 128 heads x 1; a q whose tokens do not split evenly into requests is refused."""
    q, kv_cache, table, lens = make_case(16, 1, 64, 16, 2, [3, 20], torch.float16, query_len=4)
    assert decode_kernel._input_error(q, kv_cache, table, lens, 4) is None
    q5 = torch.cat([q, q[:2]])
    with pytest.raises(ValueError, match="16 query heads per KV head times 5 query tokens is 80 rows; .* at most 64"):
        decode_attention(q5, kv_cache, table, lens, 0.125, query_len=5)
    with pytest.raises(ValueError, match="q's 10 tokens are not 4 per request"):
        decode_attention(q5, kv_cache, table, lens, 0.125, query_len=4)
    inputs = small_case(num_heads=128, kv_heads=1)
    with pytest.raises(ValueError, match="128 query heads per KV head times 1 query tokens is 128 rows"):
        decode_attention(*inputs, 0.125)


def test_cpu_tensors_are_not_taken():
    inputs = small_case()
    assert not decode_kernel_takes(*inputs)
    with pytest.raises(ValueError, match="runs on CUDA with Triton.*q is on cpu"):
        decode_attention(*inputs, 0.125)


@pytest.mark.parametrize(
    "num_reqs, kv_heads, head_dim, block_size, max_blocks, splits",
    [
        (1024, 8, 128, 128, 4, 1),  # 8192 programs: the GPU is full without splits
        (17, 8, 128, 128, 64, 1),  # 136 programs: one per SM already
        (16, 8, 128, 128, 64, 3),  # 128 programs: 3 splits reach 2 per SM
        (4, 8, 128, 128, 64, 9),  # 32 programs: 9 splits
        (4, 8, 128, 128, 4, 2),  # ... but a 512-token table gives 8 chunks of 64: 2 splits of 4
        (1, 1, 128, 16, 4096, 32),  # capped at 32
        (2, 1, 128, 16, 3, 1),  # under 4 chunks in all: no split
    ],
)
def test_split_heuristic_from_shapes(num_reqs, kv_heads, head_dim, block_size, max_blocks, splits, monkeypatch):
    """Splits where a 132-SM H100 would have fewer programs than SMs, to 2 per SM, each split at least
    4 chunks, at most 32 splits."""
    monkeypatch.setattr(decode_kernel, "_sm_count", lambda device: 132)
    q = torch.empty(num_reqs, kv_heads, head_dim)
    kv_cache = torch.empty(2, 1, block_size, kv_heads, head_dim)
    table = torch.empty(num_reqs, max_blocks, dtype=torch.int32)
    assert decode_kernel._default_splits(q, kv_cache, table) == splits


def test_no_requests_launch_nothing():
    q, kv_cache, table, lens = small_case()
    out = decode_kernel._launch(q[:0], kv_cache, table[:0], lens[:0], 0.125, 3)
    assert out.shape == (0, 8, 64) and out.dtype == torch.float16
