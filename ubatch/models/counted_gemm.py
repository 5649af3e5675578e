"""The experts' down projection over rows sorted by expert, computing only the rows each expert
holds: its end offsets are read on the device, so a CUDA graph replays it for any routing, and
the padding rows past the last offset cost nothing.

Why: under graphs the rows an expert receives are a device count; torch's GEMMs take the row
count from the host, so they must run over the whole static buffer, padding included. For one
expert per rank (moe-bench as one rank of eight) ``torch._grouped_mm`` skips the padding but
tiles a hidden-wide output too coarsely (0.18 ms at 512 rows where a plain GEMM takes 0.11,
``expert_compute.ONE_EXPERT_PLAIN_MAX_ROWS``), and the plain GEMM computes every padding row: at
a measured capacity of 1.55 a third of its FLOPs. A token split halves each GEMM's rows and pays
that tax twice. Here a program per (row tile, column tile) exits at once past the last offset.

Each row's output is its own K loop in a fixed order, whatever the other rows: a row gets the
same bits in any batch cut (batch-invariant), which cuBLAS does not promise across row counts.
"""

from __future__ import annotations

import torch

from ubatch._triton import tl, triton, triton_available

BLOCK_M = 64
BLOCK_N = 128
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 4
_MAX_EXPERTS = 128  # experts whose end offsets a program loads at once
_DTYPES = (torch.float16, torch.bfloat16)


def kernel_takes(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> bool:
    """Whether ``grouped_rows_matmul`` handles these inputs: CUDA with Triton, half-precision rows
    and weights of one dtype with the inner dimension dense, int32 end offsets, one per expert."""
    return (
        triton_available(x.device)
        and x.dim() == 2
        and w.dim() == 3
        and x.stride(1) == 1
        and w.stride(2) == 1
        and x.dtype in _DTYPES
        and w.dtype == x.dtype
        and x.shape[1] == w.shape[2]
        and w.device == x.device
        and ends.dtype == torch.int32
        and ends.dim() == 1
        and ends.is_contiguous()
        and len(ends) == len(w)
        and ends.device == x.device
        and 0 < len(w) <= _MAX_EXPERTS
    )


def grouped_rows_matmul(
    x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, *, config: tuple[int, int, int, int, int] | None = None
) -> torch.Tensor:
    """[R, N] where row r, held by expert e (``ends[e - 1] <= r < ends[e]``, sorted by expert as
    ``torch._grouped_mm``'s ``offs`` are), is ``x[r] @ w[e].T``; the rows at and past ``ends[-1]``
    are left unwritten. ``x`` [R, K]; ``w`` [E, N, K]; ``ends`` int32 [E] on the device,
    non-decreasing and at most R. Float32 accumulation, output in ``x``'s dtype. ``config``
    (block M, N, K, warps, stages) is for benchmarks; the default suits Hopper."""
    if not kernel_takes(x, w, ends):
        raise ValueError(
            f"grouped_rows_matmul takes CUDA half-precision x [R, K] and w [E, N, K] of one dtype with the "
            f"inner dimension dense and int32 ends [E]; got x {tuple(x.shape)} {x.dtype} on {x.device}, "
            f"w {tuple(w.shape)} {w.dtype}, ends {tuple(ends.shape)} {ends.dtype}"
        )
    return _launch(x, w, ends, config or (BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES))


def _launch(
    x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, config: tuple[int, int, int, int, int]
) -> torch.Tensor:
    block_m, block_n, block_k, warps, stages = config
    rows, inner = x.shape
    experts, cols, _ = w.shape
    out = x.new_empty(rows, cols)
    if rows == 0 or cols == 0:
        return out
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    _grouped_rows_gemm[grid](
        x,
        w,
        ends,
        out,
        inner,
        cols,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        experts,
        EXPERTS_POW2=max(2, triton.next_power_of_2(experts)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=inner % block_k == 0,
        num_warps=warps,
        num_stages=stages,
    )
    return out


if triton is not None:

    @triton.jit
    def _grouped_rows_gemm(
        x_ptr,
        w_ptr,
        ends_ptr,
        out_ptr,
        inner,
        cols,
        stride_x,
        stride_we,
        stride_wn,
        stride_out,
        experts,
        EXPERTS_POW2: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        """Row tile ``program_id(0)``, column tile ``program_id(1)`` (consecutive programs share a
        column tile, so its weights are read from L2 by all row tiles running together). A tile
        past the last end exits; one that straddles experts runs once per expert it holds, each
        run masked to that expert's rows."""
        m0 = tl.program_id(0) * BLOCK_M
        keys = tl.arange(0, EXPERTS_POW2)
        ends = tl.load(ends_ptr + keys, mask=keys < experts, other=0)
        total = tl.max(ends, axis=0)
        if m0 < total:
            tile_end = tl.minimum(m0 + BLOCK_M, total)
            first = tl.sum(((ends <= m0) & (keys < experts)).to(tl.int32), axis=0)
            last = tl.sum(((ends <= tile_end - 1) & (keys < experts)).to(tl.int32), axis=0)
            rows = m0 + tl.arange(0, BLOCK_M)
            columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            column_ok = columns < cols
            x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
            for expert in tl.range(first, last + 1):
                start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
                end = tl.load(ends_ptr + expert)
                row_ok = (rows >= start) & (rows < end)
                w_cols = w_ptr + tl.cast(expert, tl.int64) * stride_we + columns.to(tl.int64)[None, :] * stride_wn
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in tl.range(0, inner, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    if EVEN_K:
                        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
                        b = tl.load(w_cols + ks[:, None], mask=column_ok[None, :], other=0.0)
                    else:
                        k_ok = ks < inner
                        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                        b = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & column_ok[None, :], other=0.0)
                    acc = tl.dot(a, b, acc)
                target = out_ptr + rows.to(tl.int64)[:, None] * stride_out + columns[None, :]
                tl.store(target, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & column_ok[None, :])
