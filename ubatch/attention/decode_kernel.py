"""Flash-decoding over the paged KV cache: a few query tokens per request (one in a decode step,
k + 1 when k drafted tokens are verified), on CUDA with Triton.

Why: flash-attn 4's paged forward tiles 128 query rows, but a decode step has one query token
per request, so its tile holds only the query heads that share a KV head; inside a 1024-request
decode step on an H100 it read K and V at 2.3 TB/s (run 16's profile), below the 3.0 a copy
reaches. Here one program takes one request, one KV head and one range of its keys, with that KV
head's query heads (of each of the request's query tokens) as the rows of a small tile, so each
page of K and V is read once per KV head and the kernel is bound by the cache's bytes, not by
tile padding.

The host side decides the grid, the split count and the tile sizes from shapes alone (never
from ``seq_lens``' values), so a call can be captured in a CUDA graph and replayed with other
lengths and block ids.
"""

from __future__ import annotations

import functools

import torch

from ubatch._triton import tl, triton, triton_available

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_ROWS = 64  # query heads per KV head times query tokens per request: the tile's rows
_MIN_ROWS = 16  # tl.dot needs at least 16 rows
_MAX_HEAD_DIM = 256
_MIN_BLOCK_SIZE = 16
_MAX_BLOCK_N = 128  # keys per loop step, at most
_KEY_TILE_ELEMS = 8192  # a K chunk of at most 64 keys at head_dim 128: 16 KiB of bf16 per stage
_MIN_SPLIT_CHUNKS = 4  # a split reads at least this many chunks, else its fixed cost dominates
_MAX_SPLITS = 32
_PROGRAMS_PER_SM = 2  # programs per SM that splitting aims for, where there are fewer than one per SM
# Hardly tuned: on one H100, 4 or 8 warps, 2 to 4 stages and 64- or 128-key chunks all came within
# ~2% of each other at 1024 and 256 requests x 512 tokens (head_dim 128, bf16, ~3 TB/s)
_NUM_WARPS = 4
_NUM_STAGES = 2
_COMBINE_WARPS = 4
_LOG2E = 1.4426950408889634


def decode_kernel_takes(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_len: int = 1,
) -> bool:
    """Whether ``decode_attention`` handles these inputs (CUDA with Triton, fp16/bf16, head_dim a
    power of two in 16..256, at most 64 query heads per KV head times ``query_len``, pages of a
    power of two >= 16 tokens, int32 block table and lengths), so a caller can fall back instead
    of catching."""
    return triton_available(q.device) and _input_error(q, kv_cache, block_table, seq_lens, query_len) is None


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    query_len: int = 1,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``query_len`` query tokens per request over its keys in the paged cache.

    ``q`` [num_reqs * query_len, num_heads, head_dim], each request's tokens together;
    ``kv_cache`` [2, num_blocks, block_size, kv_heads, head_dim] (0 = K, 1 = V); key j of request
    r is ``kv_cache[0, block_table[r, j // block_size], j % block_size]``; request r's keys are
    0 .. ``seq_lens[r]`` - 1, its query tokens the last ``query_len`` of them, and token t of them
    attends keys 0 .. ``seq_lens[r]`` - ``query_len`` + t; query head h reads KV head
    h // (num_heads // kv_heads). Scores are multiplied by ``scale`` and softmaxed in float32. A
    request of length 0 (a graph's padding) gets zeros, as does a token with no key; lengths past
    the block table are read as its full length. Returns q's shape in q's dtype.

    ``num_splits``: how many programs share one (request, KV head)'s keys, each taking an equal
    run of them but at least ``_MIN_SPLIT_CHUNKS`` chunks (so a short request uses fewer); the
    default is ``_default_splits``' choice from the shapes.
    """
    for name, value in (("num_splits", num_splits), ("query_len", query_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    error = _input_error(q, kv_cache, block_table, seq_lens, query_len)
    if error is not None:
        raise error
    if not triton_available(q.device):
        missing = "" if triton is not None else " (Triton is not installed, or this torch has no CUDA)"
        raise ValueError(f"decode_attention runs on CUDA with Triton{missing}; q is on {q.device}")
    if num_splits is None:
        num_splits = _default_splits(q, kv_cache, block_table)
    return _launch(q, kv_cache, block_table, seq_lens, scale, num_splits, query_len)


def _input_error(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, query_len: int
) -> Exception | None:
    """The error for inputs the kernel does not take, or None: one list of conditions serves both
    ``decode_kernel_takes`` (which must not raise) and ``decode_attention`` (which must)."""
    if q.dim() != 3:
        return ValueError(f"q must be [num_reqs * query_len, num_heads, head_dim], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        return ValueError(
            f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got shape {tuple(kv_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    if num_tokens % query_len:
        return ValueError(f"q's {num_tokens} tokens are not {query_len} per request")
    num_reqs = num_tokens // query_len
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        return ValueError(f"block_table must be [{num_reqs}, max_blocks], got shape {tuple(block_table.shape)}")
    if seq_lens.shape != (num_reqs,):
        return ValueError(f"seq_lens must be [{num_reqs}], got shape {tuple(seq_lens.shape)}")
    if kv_cache.shape[4] != head_dim:
        return ValueError(f"kv_cache head_dim {kv_cache.shape[4]} differs from q's {head_dim}")
    if kv_heads == 0 or num_heads % kv_heads:
        return ValueError(f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    if q.dtype not in _DTYPES:
        return TypeError(f"q dtype {q.dtype} is not one of {_DTYPES}")
    if kv_cache.dtype != q.dtype:
        return TypeError(f"kv_cache dtype {kv_cache.dtype} differs from q's {q.dtype}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            return TypeError(f"{name} must be int32, got {t.dtype}")
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            return ValueError(f"{name} is on {t.device}, q on {q.device}")
    return _tile_error(q, kv_cache, query_len)


def _tile_error(q: torch.Tensor, kv_cache: torch.Tensor, query_len: int) -> ValueError | None:
    """The error for valid inputs whose sizes or layout the tile does not cover, or None."""
    head_dim, group, block_size = q.shape[2], q.shape[1] // kv_cache.shape[3], kv_cache.shape[2]
    if not (_is_pow2(head_dim) and _MIN_ROWS <= head_dim <= _MAX_HEAD_DIM):
        return ValueError(f"head_dim {head_dim} is not a power of two in {_MIN_ROWS}..{_MAX_HEAD_DIM}")
    if group * query_len > _MAX_ROWS:
        return ValueError(
            f"{group} query heads per KV head times {query_len} query tokens is {group * query_len} rows; "
            f"the kernel takes at most {_MAX_ROWS}"
        )
    if not (_is_pow2(block_size) and block_size >= _MIN_BLOCK_SIZE):
        return ValueError(f"block_size {block_size} is not a power of two >= {_MIN_BLOCK_SIZE}")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        return ValueError(f"q and kv_cache need a dense last dim, got strides {q.stride()} and {kv_cache.stride()}")
    return None


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _block_n(head_dim: int) -> int:
    """Keys per loop step: a K chunk of at most ``_KEY_TILE_ELEMS`` elements so the pipelined K/V
    stages fit in shared memory. Pages smaller than that (vLLM's default is 16 tokens) are
    gathered several per step, one block-table entry per key: a step of one small page would
    spend more on its softmax bookkeeping than on its bytes."""
    return min(_MAX_BLOCK_N, _KEY_TILE_ELEMS // head_dim)


def _default_splits(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor) -> int:
    """Splits enough to fill the GPU, from shapes only: 1 when the num_reqs * kv_heads programs
    give every SM one; else as many as bring the program count to ``_PROGRAMS_PER_SM`` per SM,
    capped so that a table-long request's split still gets ``_MIN_SPLIT_CHUNKS`` chunks, and at
    ``_MAX_SPLITS``. (A request shorter than the table uses fewer of them, see ``_decode``.)

    Measured on an H100 (132 SMs), 32 heads on 8 KV heads of 128, bf16, pages of 128: splits
    cost ~8% at 1024 x 512 tokens (partials and a second launch), and 2 splits were 10% slower
    than 1 at 32 x 512 (256 programs); at 8 x 8192 (64 programs) 4-8 splits halved the time."""
    programs = block_table.shape[0] * kv_cache.shape[3]  # requests times KV heads
    sm_count = _sm_count(q.device)
    if programs >= sm_count:
        return 1
    target = _PROGRAMS_PER_SM * sm_count
    max_chunks = block_table.shape[1] * kv_cache.shape[2] // _block_n(q.shape[2])
    return max(1, min(-(-target // max(programs, 1)), max_chunks // _MIN_SPLIT_CHUNKS, _MAX_SPLITS))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    query_len: int = 1,
) -> torch.Tensor:
    """The launches for validated inputs on any device Triton runs on (the CPU interpreter too):
    with one split the program writes its output; with more, each writes its normalized partial
    and log-sum-exp to float32 scratch and ``_combine`` merges them."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // kv_heads
    out = q.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return out
    split = num_splits > 1
    # float32 scratch for the splits' partials and log-sum-exps; without splits ``out`` stands in, unread
    partial = q.new_empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32) if split else out
    lse = q.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32) if split else out
    _decode[(num_tokens // query_len, kv_heads, num_splits)](
        q,
        kv_cache[0],
        kv_cache[1],
        block_table,
        seq_lens,
        out,
        partial,
        lse,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        block_table.stride(1),
        seq_lens.stride(0),
        block_table.shape[1] * block_size,
        scale * _LOG2E,
        group,
        query_len,
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(_MIN_ROWS, triton.next_power_of_2(group * query_len)),
        BLOCK_N=_block_n(head_dim),
        MIN_CHUNKS=_MIN_SPLIT_CHUNKS,
        SPLIT=split,
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    if split:
        _combine[(num_tokens, num_heads)](
            partial,
            lse,
            out,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=_COMBINE_WARPS,
        )
    return out


if triton is not None:

    @triton.jit
    def _decode(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        lens_ptr,
        out_ptr,
        partial_ptr,
        lse_ptr,
        stride_qr,
        stride_qh,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_tr,
        stride_tb,
        stride_len,
        max_len,
        qk_scale,
        group,
        query_len,
        num_splits,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MIN_CHUNKS: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """Request ``program_id(0)``, KV head ``program_id(1)``, split ``program_id(2)``: an
        online softmax over its run of keys, in base 2 (``qk_scale`` holds log2(e)), for the
        tile's rows: row r is query token r // group of the request, head r % group of the KV
        head's, and sees keys up to its own position (causal). The split's run is an equal share
        of this request's chunks (at least MIN_CHUNKS), so the lengths come from the device and
        the grid from the shapes. A step's chunk lies in one page (one table lookup) or, where
        pages are smaller, spans whole pages (a lookup per key), and the running max starts
        finite, so a row whose keys in a chunk are all masked adds nothing and no row sees
        -inf - -inf; a row with no key leaves a weight sum of 0, written as zeros (and lse -inf
        when split)."""
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.minimum(tl.load(lens_ptr + req * stride_len), max_len)
        chunks = tl.cdiv(seq_len, BLOCK_N)
        per_split = tl.maximum(tl.cdiv(chunks, num_splits), MIN_CHUNKS) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, seq_len)

        rows = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, HEAD_DIM)
        keys = tl.arange(0, BLOCK_N)
        token = req * query_len + rows // group  # the row's query token among all requests'
        heads = kv_head * group + rows % group
        last_key = seq_len - query_len + rows // group  # the last key the row's token sees
        num_heads = tl.num_programs(1) * group
        row_mask = rows < group * query_len
        q_rows = q_ptr + token.to(tl.int64)[:, None] * stride_qr + heads[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_rows, mask=row_mask[:, None], other=0.0)
        head_off = kv_head * stride_ch + dims[None, :]

        m = tl.full((BLOCK_G,), -1.0e30, dtype=tl.float32)
        total = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
        for start in tl.range(lo, hi, BLOCK_N):  # a for loop, so the compiler pipelines the K/V loads
            live = start + keys < hi
            table_row = table_ptr + req.to(tl.int64) * stride_tr
            if BLOCK_N <= BLOCK_SIZE:
                page = tl.load(table_row + (start // BLOCK_SIZE) * stride_tb)
                slots = start % BLOCK_SIZE + keys
                offs = page.to(tl.int64) * stride_cb + slots[:, None] * stride_cs + head_off
            else:
                pages = tl.load(table_row + ((start + keys) // BLOCK_SIZE) * stride_tb, mask=live, other=0)
                slots = (start + keys) % BLOCK_SIZE
                offs = pages.to(tl.int64)[:, None] * stride_cb + slots[:, None] * stride_cs + head_off
            k = tl.load(k_ptr + offs, mask=live[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=live[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(live[None, :] & (start + keys[None, :] <= last_key[:, None]), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        nonempty = total > 0.0
        result = acc / tl.where(nonempty, total, 1.0)[:, None]
        if SPLIT:
            at = (token * num_heads + heads) * num_splits + split
            tl.store(partial_ptr + at.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :], result, mask=row_mask[:, None])
            tl.store(lse_ptr + at, tl.where(nonempty, m + tl.log2(total), float("-inf")), mask=row_mask)
        else:
            out_rows = (token * num_heads + heads).to(tl.int64) * HEAD_DIM
            out = out_ptr + out_rows[:, None] + dims[None, :]
            tl.store(out, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])

    @triton.jit
    def _combine(partial_ptr, lse_ptr, out_ptr, num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
        """Query token ``program_id(0)``, head ``program_id(1)``: the splits' partials weighted by
        2^(lse - max lse). Empty splits (lse -inf) weigh 0; with no key at all the max is taken
        as 0 and the sum of weights as 1, so the row is zeros, not NaN."""
        row = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        dims = tl.arange(0, HEAD_DIM)
        real = splits < num_splits
        lse = tl.load(lse_ptr + row * num_splits + splits, mask=real, other=float("-inf"))
        top = tl.max(lse, axis=0)
        weight = tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0))
        total = tl.sum(weight, axis=0)
        parts = partial_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :]
        partial = tl.load(parts, mask=real[:, None] & (weight[:, None] > 0.0), other=0.0)
        result = tl.sum(weight[:, None] * partial, axis=0) / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + row * HEAD_DIM + dims, result.to(out_ptr.dtype.element_ty))
