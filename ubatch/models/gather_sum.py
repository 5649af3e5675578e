"""Gather up to k rows per output row and sum them, weighted, in float32: one Triton kernel on
CUDA, torch elsewhere.

Why: with one dispatch row per token and destination (``ubatch.models.moe``), the expert side
sums each row's experts' outputs and the sender sums each token's rows from every destination.
In torch ops that is a gather of ``[rows, k, hidden]``, a float32 copy, a multiply, a mask and a
sum, four or five passes over ``k`` times the output; most of the gathered rows are padding (a
token has a handful of its top-k experts on any one rank), which the kernel skips instead of
reading. On an H200 the torch version added 0.2 / 0.6 ms per layer to a DeepSeek-style decode
step (top-8 of 64) at 256 / 1024 tokens (benchmarks/h200/dispatch_ab).
"""

from __future__ import annotations

import torch

from ubatch._triton import tl, triton, triton_available

_MAX_BLOCK_HIDDEN = 1024  # output columns per program: 8 bf16 (16 bytes) per thread, 4 warps


def gather_sum(
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[i] = add[i] + sum_j weight[i, j] * src[index[i, j]]`` over the ``j`` with
    ``index[i, j] >= 0``, accumulated in float32 in column order: [rows, hidden] from ``src``
    [n, hidden], ``index`` [rows, k] (int64; negative: nothing to add, and ``src`` is not read
    there), ``weight`` [rows, k] float32 (None: 1; its rows may be strided, as the weight columns of
    dispatch rows are) and ``add`` [rows', hidden] with rows' <= rows (None: 0; the rows past it
    add 0, so a sum whose later rows are new needs no zeros first). Written
    to ``out`` (contiguous [rows, hidden], any float dtype; ``add`` may be its first rows, to
    accumulate in place) or returned in ``src``'s dtype."""
    _check(src, index, weight, add, out)
    if out is None:
        out = src.new_empty(index.shape[0], src.shape[1])
    if triton_available(src.device) and src.stride(1) == 1:
        _gather_sum_triton(src, index, weight, add, out)
    else:
        out.copy_(_gather_sum_torch(src, index, weight, add))
    return out


def _check(
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None,
    add: torch.Tensor | None,
    out: torch.Tensor | None,
) -> None:
    if src.dim() != 2 or index.dim() != 2:
        raise ValueError(
            f"gather_sum needs src [n, hidden] and index [rows, k], got {tuple(src.shape)} and {tuple(index.shape)}"
        )
    if index.dtype != torch.int64:
        raise TypeError(f"gather_sum's index must be int64, got {index.dtype}")
    if weight is not None and (weight.shape != index.shape or weight.dtype != torch.float32):
        raise ValueError(
            f"gather_sum's weight must be float32 of the index's shape {tuple(index.shape)}, got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    if add is not None and (add.dim() != 2 or add.shape[0] > index.shape[0] or add.shape[1] != src.shape[1]):
        raise ValueError(f"gather_sum's add must be [at most {index.shape[0]}, {src.shape[1]}], got {tuple(add.shape)}")
    if out is not None and (out.shape != (index.shape[0], src.shape[1]) or not out.is_contiguous()):
        raise ValueError(
            f"gather_sum's out must be contiguous [{index.shape[0]}, {src.shape[1]}], got {tuple(out.shape)}"
            f"{'' if out.is_contiguous() else ' (not contiguous)'}"
        )


def _gather_sum_torch(
    src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None, add: torch.Tensor | None
) -> torch.Tensor:
    valid = index >= 0
    rows = torch.where(valid[..., None], src[index.clamp(min=0)].float(), 0.0)  # padding may hold anything
    if weight is not None:
        rows = rows * torch.where(valid, weight, 0.0)[..., None]
    out = rows.sum(dim=1)
    if add is not None:
        out[: len(add)] += add.float()
    return out


def _gather_sum_triton(
    src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None, add: torch.Tensor | None, out: torch.Tensor
) -> None:
    rows, k = index.shape
    hidden = src.shape[1]
    if rows == 0:
        return
    index = index.contiguous()
    if weight is not None and weight.stride(1) != 1:
        weight = weight.contiguous()
    block = min(_MAX_BLOCK_HIDDEN, triton.next_power_of_2(hidden))
    if add is not None:
        add = add.contiguous()
    in_place = add is not None and add.data_ptr() == out.data_ptr()
    _gather_sum_kernel[(rows, triton.cdiv(hidden, block))](
        src,
        index,
        index if weight is None else weight,
        out if add is None else add,
        out,
        hidden,
        src.stride(0),
        0 if weight is None else weight.stride(0),
        0 if add is None else len(add),
        K=k,
        HAS_WEIGHT=weight is not None,
        HAS_ADD=add is not None,
        IN_PLACE=in_place,
        BLOCK_HIDDEN=block,
        num_warps=4,
    )


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(
        src_ptr,
        index_ptr,
        weight_ptr,
        add_ptr,
        out_ptr,
        hidden,
        stride_src,
        stride_weight,
        add_rows,
        K: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_ADD: tl.constexpr,
        IN_PLACE: tl.constexpr,
        BLOCK_HIDDEN: tl.constexpr,
    ):
        """Output row ``program_id(0)``, columns block ``program_id(1)``: rows with a negative
        index are neither read nor added (their weight may be anything), nor is ``add`` from row
        ``add_rows`` on. A program reads its block of ``add`` before it writes the same block of
        ``out``, so the two may alias; when they do (``IN_PLACE``), a row of ``add`` with nothing
        to add already holds its sum and is neither read nor written: an expert group's sum
        over every row landed so far then moves only the rows of that group."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_HIDDEN + tl.arange(0, BLOCK_HIDDEN)
        in_row = cols < hidden
        if IN_PLACE:
            hits = tl.zeros([BLOCK_HIDDEN], dtype=tl.int32)
            for j in tl.static_range(K):
                hits += (cols * 0 + tl.load(index_ptr + row * K + j) >= 0).to(tl.int32)
            in_row = in_row & ((hits > 0) | (cols * 0 + row >= add_rows))
        if HAS_ADD:
            added = in_row & (cols * 0 + row < add_rows)  # a vector mask, as below
            acc = tl.load(add_ptr + row * hidden + cols, mask=added, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK_HIDDEN], dtype=tl.float32)
        for j in tl.static_range(K):
            source = tl.load(index_ptr + row * K + j)
            read = in_row & (cols * 0 + source >= 0)  # a vector mask: Triton's interpreter (3.9) takes no scalar in one
            values = tl.load(src_ptr + source * stride_src + cols, mask=read, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                values = values * tl.where(read, tl.load(weight_ptr + row * stride_weight + j), 0.0)
            acc += values
        tl.store(out_ptr + row * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)
