"""One Triton kernel that places each received row in its expert's block of the padded batched
expert GEMM's input, on CUDA.

Why: in plain torch ops (``expert_compute.pad_expert_rows``) that takes about a dozen small kernels per
expert group and layer (a one-hot scan for each row's rank among its expert's rows, masks, an
index copy); inside a CUDA graph each small kernel costs a few microseconds whatever its size, and
expert pipelining pays them once per group. The kernel gives the same slots, rows and dropped
count, so outputs are bitwise those of the torch path.
"""

from __future__ import annotations

import torch

from ubatch._triton import tl, triton, triton_available

_MAX_BLOCK_HIDDEN = 1024  # row elements copied per loop step: 8 bf16 (16 bytes) per thread, 4 warps
_BLOCK_RANK = 1024  # earlier rows compared per loop step when counting a row's rank
_ROW_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_EXPERT_DTYPES = (torch.int32, torch.int64)


def kernel_takes(x: torch.Tensor, expert: torch.Tensor) -> bool:
    """Whether the kernel handles these inputs: CUDA with Triton, rows whose elements are dense
    (a column slice of a wider buffer qualifies), contiguous integer expert ids, the same number
    for every row of ``x`` (``expert_compute.pad_expert_rows``)."""
    return (
        triton_available(x.device)
        and x.dim() == 2
        and x.stride(1) == 1
        and x.dtype in _ROW_DTYPES
        and expert.dim() == 1
        and expert.is_contiguous()
        and expert.dtype in _EXPERT_DTYPES
        and expert.device == x.device
        and (len(expert) % len(x) == 0 if len(x) else len(expert) == 0)
    )


def pad_expert_rows_kernel(
    x: torch.Tensor,
    expert: torch.Tensor,
    num_experts: int,
    capacity: int,
    first: int = 0,
    *,
    counter: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``expert_compute.pad_expert_rows`` in one launch: (rows in [experts, capacity, hidden] blocks, each
    (row, expert) pair's slot there or -1 for padding (an expert outside
    ``first`` .. ``first + num_experts - 1``) and past its expert's capacity, how many real pairs
    were dropped: added atomically to ``counter``, an int64 device scalar, and returned as it,
    where one is given). Slots no pair takes are left unwritten, as in the torch path."""
    hidden = x.shape[1]
    num_rows = len(expert)
    per_row = num_rows // len(x) if len(x) else 1
    padded = x.new_empty(num_experts * capacity, hidden)
    slot = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    dropped = torch.zeros((), dtype=torch.int64, device=x.device) if counter is None else counter
    if num_rows:
        _pad_rows[(num_rows,)](
            x,
            expert,
            padded,
            slot,
            dropped,
            num_rows,
            per_row,
            hidden,
            x.stride(0),
            capacity,
            first,
            first + num_experts,
            BLOCK_RANK=_BLOCK_RANK,
            BLOCK_HIDDEN=min(_MAX_BLOCK_HIDDEN, triton.next_power_of_2(hidden)),
            num_warps=4,
        )
    return padded.view(num_experts, capacity, hidden), slot, dropped


if triton is not None:

    @triton.jit
    def _pad_rows(
        x_ptr,
        expert_ptr,
        out_ptr,
        slot_ptr,
        dropped_ptr,
        num_rows,
        per_row,
        hidden,
        stride_x,
        capacity,
        first,
        end,
        BLOCK_RANK: tl.constexpr,
        BLOCK_HIDDEN: tl.constexpr,
    ):
        """Pair ``program_id(0)``: its rank is the number of earlier pairs with the same expert (the
        torch path's scan, so the same slots), then its row of ``x`` (every ``per_row`` pairs
        share one) goes to its slot if it is kept. Experts outside [first, end) are padding; the
        scan compares the ids as given, which equal where the shifted ones do."""
        row = tl.program_id(0)
        given = tl.load(expert_ptr + row).to(tl.int64)
        expert = tl.where((given >= first) & (given < end), given - first, -1)
        rank = row * 0  # an int32 scalar the loop may carry
        for start in tl.range(0, num_rows, BLOCK_RANK):
            earlier = start + tl.arange(0, BLOCK_RANK)
            others = tl.load(expert_ptr + earlier, mask=earlier < row, other=-1).to(tl.int64)
            rank += tl.sum((others == given).to(tl.int32), axis=0)
        real = expert >= 0
        kept = real & (rank < capacity)
        slot = tl.where(kept, expert * capacity + rank, -1)
        tl.store(slot_ptr + row, slot)
        tl.atomic_add(dropped_ptr, 1, mask=real & (rank >= capacity))
        source = x_ptr + (row // per_row).to(tl.int64) * stride_x
        target = out_ptr + slot * hidden
        for start in tl.range(0, hidden, BLOCK_HIDDEN):
            cols = start + tl.arange(0, BLOCK_HIDDEN)
            mask = (cols < hidden) & (cols * 0 + slot >= 0)  # a vector mask, as in gather_sum
            tl.store(target + cols, tl.load(source + cols, mask=mask), mask=mask)
