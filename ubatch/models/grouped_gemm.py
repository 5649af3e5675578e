"""A grouped GEMM in Triton for the routed experts: rows sorted by expert, each group of rows
times its expert's weight, tiled so that a few experts with a few hundred rows still fill the GPU.

Why: ``torch._grouped_mm`` tiles each group in large blocks. Where a rank holds one or two
experts (an expert-parallel world of 8 with 8 experts) and a ubatch sends it ~256 rows, the down
projection (N = hidden, K = the expert's width) has a few dozen tiles for 132 SMs, and the GEMM
reads its weights at well under HBM speed. Here each program takes one (row block, column block)
of one group, in an order that has the programs sharing a weight block run side by side (the
weights then come from HBM about once), with block sizes picked per shape (``pick_blocks``).

The tile a program takes is found on the device from the group ends (``offsets``), so the launch
needs no host sync and is CUDA-graph capturable with counts that change between replays: the
grid covers every tile the buffer's rows could need, and programs past the real tiles return.
Rows at and past the last offset are padding: never read, and left unwritten in the output.
"""

from __future__ import annotations

import os

import torch

from ubatch._triton import tl, triton, triton_available

_DTYPES = (torch.bfloat16, torch.float16)
GEMM_ENV = "UBATCH_EXPERT_GEMM"
"""Which grouped GEMM the experts run: ``auto`` (the default: ``pick_gemm``'s measured rule),
``triton`` (wherever the kernel takes the inputs) or ``torch`` (``torch._grouped_mm`` always),
for A/B runs of one build."""
_GEMM_CHOICES = ("auto", "triton", "torch")


def kernel_takes(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether ``grouped_gemm`` runs these inputs: CUDA tensors with Triton, 16-bit rows with a
    unit inner stride, weights [groups, N, K] of the same dtype with K contiguous, int32 group
    ends, and K a multiple of 16 (the MMA's step)."""
    return (
        triton_available(x.device)
        and x.dim() == 2
        and weight.dim() == 3
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(2) == 1
        and weight.shape[2] == x.shape[1]
        and x.shape[1] % 16 == 0
        and offsets.dtype == torch.int32
        and offsets.dim() == 1
        and len(offsets) == weight.shape[0]
        and x.device == weight.device == offsets.device
    )


def pick_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> str:
    """ "triton" or "torch": the grouped GEMM for these inputs, by ``UBATCH_EXPERT_GEMM``."""
    choice = os.environ.get(GEMM_ENV, "auto")
    if choice not in _GEMM_CHOICES:
        raise ValueError(f"{GEMM_ENV} must be one of {', '.join(_GEMM_CHOICES)}, got {choice!r}")
    if choice == "torch" or not kernel_takes(x, weight, offsets):
        return "torch"
    return "triton" if choice == "triton" or _triton_pays(len(weight)) else "torch"


def _triton_pays(groups: int) -> bool:
    """Where the Triton kernel beat ``torch._grouped_mm`` (scripts/bench_expert_gemm.py)."""
    return groups <= 2


def pick_blocks(rows: int, n: int, k: int, groups: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for ``rows`` buffer rows in ``groups`` groups.

    Few rows per group: narrow row blocks, so no program multiplies padding; few tiles in all
    (a wide-K down projection of one or two experts): narrow column blocks, so that every SM has
    one."""
    per_group = rows / max(groups, 1)
    block_m = 64 if per_group <= 192 else 128
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, 128)
    block_n = 128 if tiles >= 2 * 132 else 64
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return block_m, block_n, 64, warps, 4


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    blocks: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x[r] @ weight[g].T`` for each row r of group g, where group g holds the rows from
    ``offsets[g - 1]`` (0 for the first) up to ``offsets[g]``: what ``torch._grouped_mm(x,
    weight.transpose(1, 2), offs=offsets)`` gives, as a new [rows, N] tensor. Rows at and past
    ``offsets[-1]`` are left unwritten. ``blocks`` overrides ``pick_blocks`` (benchmarks)."""
    if not kernel_takes(x, weight, offsets):
        raise ValueError(
            "grouped_gemm takes CUDA bf16/fp16 rows [R, K] with K a multiple of 16, weights [G, N, K] of their "
            f"dtype and int32 ends [G]; got rows {tuple(x.shape)} {x.dtype} on {x.device}, weights "
            f"{tuple(weight.shape)} {weight.dtype}, ends {tuple(offsets.shape)} {offsets.dtype}"
        )
    return _launch(x, weight, offsets, blocks)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, blocks: tuple[int, int, int, int, int] | None
) -> torch.Tensor:
    """The kernel's launch, unchecked (Triton's CPU interpreter runs it on CPU tensors in tests)."""
    rows, k = x.shape
    groups, n, _ = weight.shape
    out = x.new_empty(rows, n)
    if rows == 0 or groups == 0:
        return out
    block_m, block_n, block_k, warps, stages = blocks or pick_blocks(rows, n, k, groups)
    row_tiles = triton.cdiv(rows, block_m) + groups  # each group may end in a partial tile
    grid = (row_tiles * triton.cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        x,
        weight,
        out,
        offsets,
        groups,
        n,
        k,
        row_tiles,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        GROUPS=triton.next_power_of_2(groups),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=warps,
        num_stages=stages,
    )
    return out


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        ends_ptr,
        num_groups,
        n,
        k,
        row_tiles,
        stride_x,
        stride_wg,
        stride_wn,
        stride_out,
        GROUPS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        # row tiles vary fastest: the programs that read one weight column block run together
        tile = pid % row_tiles
        col_block = pid // row_tiles
        g = tl.arange(0, GROUPS)
        in_range = g < num_groups
        ends = tl.load(ends_ptr + g, mask=in_range, other=0)
        starts = tl.load(ends_ptr + g - 1, mask=in_range & (g > 0), other=0)
        tiles = tl.where(in_range, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        tiles_end = tl.cumsum(tiles, 0)
        if tile < tl.sum(tiles, 0):
            group = tl.sum((tiles_end <= tile).to(tl.int32), 0)
            here = g == group
            first_tile = tl.sum(tl.where(here, tiles_end - tiles, 0), 0)
            row_start = tl.sum(tl.where(here, starts, 0), 0) + (tile - first_tile) * BLOCK_M
            row_end = tl.sum(tl.where(here, ends, 0), 0)
            offs_m = row_start + tl.arange(0, BLOCK_M)
            offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            row_ok = offs_m < row_end
            col_ok = offs_n < n
            x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
            w_ptrs = w_ptr + group.to(tl.int64) * stride_wg + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                if EVEN_K:
                    a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                    b = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
                else:
                    k_ok = offs_k < k - k0
                    a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc = tl.dot(a, b, acc)
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
