"""The MoE router's top-k as the same arithmetic for a row whatever batch holds it.

Why: a token split (or a token chunk) runs the router over fewer rows than the unsplit step, and a
GEMM library picks its kernel by row count (cuBLAS: other tiles, split-K in decode; CPU BLAS: a
matrix-vector kernel for one row), so the same row's float32 logits could differ in the last bits
between the two. Here a row's logits, experts and weights are the same bits in any batch that
holds it: on CUDA two Triton kernels (each program a fixed block of ``ROWS_PER_BLOCK`` rows over a
fixed ``HIDDEN_PER_PROGRAM`` slice of the hidden dim, then the slices summed in order, the top-k
picked and its softmax taken, ties to the lower expert id), which also replace the cast, GEMM,
top-k and softmax kernels with two and do the same work per row at any split; elsewhere a per-row
reduction (``router_logits``) and ``torch.topk``. The two paths differ from each other in the last
bits. This removes the router's own share of a split's rounding, not the rest: in a model the rows
that reach the router come from GEMMs over the ubatch's rows, which may round differently, so a
near-tie between experts can still go the other way (the mode tests compare within a tolerance).

The softmax over all experts renormalised over the picks is the softmax over the picked logits,
so it is taken that way, over k values.
"""

from __future__ import annotations

import torch

from ubatch._triton import tl, triton, triton_available

ROWS_PER_BLOCK = 32
"""Rows each Triton program computes; fixed, so the compiled arithmetic never depends on the batch
size."""
HIDDEN_PER_PROGRAM = 256
"""The hidden-dim slice of one Triton program: a 4096-wide router runs 16 programs per row block,
so a 256-token decode step still fills the GPU (128 programs)."""
_BLOCK_K = 32
_DOT_PRECISION = "tf32x3"
"""Three tf32 tensor-core products per block, about float32's precision: on one H100 the kernels
then take 0.11 ms at 4096 rows and 64 experts against cuBLAS's float32 path's 0.15 (0.38 with
float32 FMA, "ieee"), and pick the same experts as it on every row; one tf32 product ("tf32")
picked others on 41 of 4096 rows. Any fixed choice keeps a row's bits the same in every batch."""
_PRODUCT_BYTES = 64 << 20


def route_top_k(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32 summing to 1 over each row, expert ids [T, k] int64, best first) for
    rows ``x`` [T, hidden] and router weights [experts, hidden], the logits in float32 whatever
    their dtypes (a bf16 router loses bits the float32 one keeps, but no batch cut changes them)."""
    _check(x, router, top_k)
    if triton_available(x.device) and x.stride(-1) == 1 and router.is_contiguous():
        return _route_triton(x, router, top_k)
    logits, ids = torch.topk(router_logits(x, router), top_k, dim=-1)
    return logits.softmax(dim=-1), ids


def router_logits(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """float32 logits [T, experts] as each row's elementwise products with the router summed over
    the hidden dim: a reduction over the last dim that torch runs for each (row, expert) on its
    own, where a GEMM's kernel (and a row's place in its tiles) changes with T. In row chunks of at
    most ``_PRODUCT_BYTES`` of products."""
    rows_per_chunk = max(1, _PRODUCT_BYTES // (4 * router.numel()))
    chunks = [(chunk.float()[:, None, :] * router).sum(dim=-1) for chunk in x.split(rows_per_chunk)]
    return torch.cat(chunks) if chunks else x.new_empty(0, len(router), dtype=torch.float32)


def _check(x: torch.Tensor, router: torch.Tensor, top_k: int) -> None:
    if x.dim() != 2 or router.dim() != 2 or x.shape[1] != router.shape[1]:
        shapes = f"x {tuple(x.shape)}, router {tuple(router.shape)}"
        raise ValueError(f"x must be [tokens, hidden] and router [experts, hidden], got {shapes}")
    if not x.is_floating_point() or not router.is_floating_point():
        raise TypeError(f"x and the router's weights must be floating point, got {x.dtype} and {router.dtype}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= len(router):
        raise ValueError(f"top_k must be an int in 1..{len(router)} (the experts), got {top_k!r}")


def _route_triton(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, hidden = x.shape
    experts = len(router)
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=x.device)
    if rows == 0:
        return weights, ids
    padded_experts = max(16, triton.next_power_of_2(experts))  # tl.dot's smallest width
    splits = triton.cdiv(hidden, HIDDEN_PER_PROGRAM)
    partial = torch.empty(splits, rows, padded_experts, dtype=torch.float32, device=x.device)
    row_blocks = triton.cdiv(rows, ROWS_PER_BLOCK)
    _partial_logits_kernel[(row_blocks, splits)](
        x,
        router,
        partial,
        rows,
        hidden,
        experts,
        x.stride(0),
        BLOCK_M=ROWS_PER_BLOCK,
        BLOCK_K=_BLOCK_K,
        SPAN=HIDDEN_PER_PROGRAM,
        EXPERTS=padded_experts,
        PRECISION=_DOT_PRECISION,
    )
    _top_k_kernel[(row_blocks,)](
        partial,
        weights,
        ids,
        rows,
        experts,
        SPLITS=splits,
        BLOCK_M=ROWS_PER_BLOCK,
        EXPERTS=padded_experts,
        TOP_K=top_k,
        PICKS=max(2, triton.next_power_of_2(top_k)),
    )
    return weights, ids


if triton is not None:

    @triton.jit(do_not_specialize=["rows"])
    def _partial_logits_kernel(
        x_ptr,
        router_ptr,
        partial_ptr,
        rows,
        hidden,
        experts,
        stride_x,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPAN: tl.constexpr,
        EXPERTS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """partial[split, rows of this block, :] = x[rows, slice] @ router[:, slice].T (tf32x3, into float32),
        the slice the program's ``SPAN`` columns of the hidden dim, summed in column order."""
        block = tl.program_id(0)
        split = tl.program_id(1)
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_e = tl.arange(0, EXPERTS)
        in_rows = offs_m < rows
        acc = tl.zeros((BLOCK_M, EXPERTS), dtype=tl.float32)
        for k0 in range(split * SPAN, split * SPAN + SPAN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            in_k = ks < hidden
            a = tl.load(
                x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + ks[None, :],
                mask=in_rows[:, None] & in_k[None, :],
                other=0.0,
            )
            b = tl.load(
                router_ptr + offs_e[None, :] * hidden + ks[:, None],
                mask=(offs_e < experts)[None, :] & in_k[:, None],
                other=0.0,
            )
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
        out = partial_ptr + (split.to(tl.int64) * rows + offs_m)[:, None] * EXPERTS + offs_e[None, :]
        tl.store(out, acc, mask=in_rows[:, None])

    @triton.jit(do_not_specialize=["rows"])
    def _top_k_kernel(
        partial_ptr,
        weights_ptr,
        ids_ptr,
        rows,
        experts,
        SPLITS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        EXPERTS: tl.constexpr,
        TOP_K: tl.constexpr,
        PICKS: tl.constexpr,
    ):
        """Each row's logits summed over the splits in order, its ``TOP_K`` largest picked (ties to
        the lower expert id) and the softmax over them."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_e = tl.arange(0, EXPERTS)
        in_rows = offs_m < rows
        at = offs_m.to(tl.int64)[:, None] * EXPERTS + offs_e[None, :]
        logits = tl.load(partial_ptr + at, mask=in_rows[:, None], other=0.0)
        split_stride = rows.to(tl.int64) * EXPERTS
        for split in tl.static_range(1, SPLITS):
            logits += tl.load(partial_ptr + split * split_stride + at, mask=in_rows[:, None], other=0.0)
        logits = tl.where(logits == logits, logits, float("-inf"))  # NaN: never preferred
        taken = (offs_e >= experts)[None, :] | (offs_m < 0)[:, None]  # the padding experts, per row
        picks = tl.arange(0, PICKS)
        values = tl.full((BLOCK_M, PICKS), float("-inf"), dtype=tl.float32)
        chosen = tl.zeros((BLOCK_M, PICKS), dtype=tl.int64)
        for pick in tl.static_range(TOP_K):
            best = tl.max(tl.where(taken, float("-inf"), logits), axis=1)
            # the lowest free expert at the best value: distinct ids even where all left are -inf
            expert = tl.min(tl.where(~taken & (logits == best[:, None]), offs_e[None, :], EXPERTS), axis=1)
            values = tl.where(picks[None, :] == pick, best[:, None], values)
            chosen = tl.where(picks[None, :] == pick, expert.to(tl.int64)[:, None], chosen)
            taken = taken | (offs_e[None, :] == expert[:, None])
        top = tl.max(values, axis=1)
        scaled = tl.where(picks[None, :] < TOP_K, tl.exp(values - top[:, None]), 0.0)
        weights = scaled / tl.sum(scaled, axis=1)[:, None]
        out = offs_m.to(tl.int64)[:, None] * TOP_K + picks[None, :]
        keep = in_rows[:, None] & (picks[None, :] < TOP_K)
        tl.store(weights_ptr + out, weights, mask=keep)
        tl.store(ids_ptr + out, chosen, mask=keep)
