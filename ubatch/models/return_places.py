"""Where each received dispatch row goes in the combine: one Triton kernel on CUDA, torch elsewhere.

Why: with expert groups a row comes back in the combine chunk of its latest group, in the block of
the rank that sent it, at the return position it carries (``ubatch.models.dispatch``). In torch ops
that is about fifteen small kernels per landed chunk (the ids' latest group, the sender's block,
a table lookup, a scatter); inside a CUDA graph each costs a few microseconds whatever its size,
paid once per expert group and layer.
"""

from __future__ import annotations

import torch

from ubatch._triton import tl, triton, triton_available
from ubatch.models.dispatch import row_column_offsets

_BLOCK_K = 16  # id columns the kernel reads per row; a larger top_k takes the torch path


def place_returns(
    rows: torch.Tensor,
    first_row: int,
    hidden: int,
    top_k: int,
    group_size: int,
    world: int,
    row_block: torch.Tensor,
    comb_starts: torch.Tensor,
    comb_source: torch.Tensor,
) -> None:
    """For each dispatch row of ``rows`` (received rows ``first_row`` on), with experts in groups
    of ``group_size`` over ``world`` ranks: ``comb_source[i] = its received row`` at
    ``i = comb_starts[latest group * world + sender] + its return position``, where ``row_block``
    [received rows] holds each received row's (chunk, sender) block. Rows without an expert go to
    ``comb_source``'s last entry, a trash slot; every other entry is left as it was."""
    if not len(rows):
        return
    if triton_available(rows.device) and rows.stride(1) == 1 and top_k <= _BLOCK_K:
        position_at, ids_at = row_column_offsets(hidden, top_k, rows.dtype)
        _place_returns_kernel[(len(rows),)](
            rows,
            rows.stride(0),
            position_at,
            ids_at,
            first_row,
            row_block,
            comb_starts,
            comb_source,
            len(comb_source) - 1,
            top_k,
            group_size,
            world,
            BLOCK_K=_BLOCK_K,
            num_warps=1,
        )
        return
    position_at, ids_at = row_column_offsets(hidden, top_k, rows.dtype)
    ids = rows[:, ids_at : ids_at + top_k].long()
    position = rows[:, position_at:ids_at].contiguous().view(torch.int32)[:, 0].long()
    last = torch.where(ids >= 0, ids // group_size, -1).amax(dim=1)
    sender = row_block[first_row : first_row + len(rows)] % world
    target = torch.where(last >= 0, comb_starts[(last * world + sender).clamp(min=0)] + position, len(comb_source) - 1)
    comb_source.scatter_(0, target, torch.arange(first_row, first_row + len(rows), device=rows.device))


if triton is not None:

    @triton.jit
    def _place_returns_kernel(
        rows_ptr,
        stride_row,
        position_at,
        ids_at,
        first_row,
        row_block_ptr,
        comb_starts_ptr,
        comb_source_ptr,
        trash,
        top_k,
        group_size,
        world,
        BLOCK_K: tl.constexpr,
    ):
        """Row ``program_id(0)`` of ``rows``: its latest expert group from its id columns, its
        sender from its block, and the return position it carries (int32 bits)."""
        i = tl.program_id(0)
        base = rows_ptr + i.to(tl.int64) * stride_row
        cols = tl.arange(0, BLOCK_K)
        ids = tl.load(base + ids_at + cols, mask=cols < top_k, other=-1.0).to(tl.int32)
        last = tl.max(tl.where(ids >= 0, ids // group_size, -1), axis=0)
        position = tl.load((base + position_at).to(tl.pointer_type(tl.int32)))
        row = first_row + i
        sender = tl.load(row_block_ptr + row) % world
        start = tl.load(comb_starts_ptr + tl.maximum(last, 0) * world + sender)
        tl.store(comb_source_ptr + tl.where(last >= 0, start + position, trash), row.to(tl.int64))
