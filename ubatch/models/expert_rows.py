"""Triton kernels that place each received row where an expert GEMM reads it, on CUDA: in its
expert's block of the padded batched GEMM's input (``pad_expert_rows_kernel``, one launch), or
sorted by expert for the grouped GEMM (``sort_by_expert_kernel``, four).

Why: in plain torch ops (``expert_compute.pad_expert_rows``, ``expert_compute.sort_by_expert``)
each takes about a dozen small kernels per expert group and layer (a one-hot scan or a sort for
each row's rank among its expert's rows, masks, index copies, the inverse permutation); inside a
CUDA graph each small kernel costs a few microseconds whatever its size, and expert pipelining
pays them once per group. The kernels give the same slots, rows and counts, so outputs are
bitwise those of the torch path.
"""

from __future__ import annotations

import torch

from ubatch._triton import tl, triton, triton_available

_MAX_BLOCK_HIDDEN = 1024  # row elements copied per loop step: 8 bf16 (16 bytes) per thread, 4 warps
_BLOCK_RANK = 1024  # earlier rows compared per loop step when counting a row's rank
_BLOCK_SCAN = 256  # (row, expert) pairs each program of the sort counts and places
_BASE_TILE = 32  # blocks of pairs the sort's one program of block bases takes per loop step
_MAX_SORT_EXPERTS = 128  # experts the scan counts at once
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


def sort_kernel_takes(x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> bool:
    """Whether ``sort_by_expert_kernel`` handles these inputs: CUDA with Triton, dense row
    elements, contiguous int64 ids [rows, top_k], at most ``_MAX_SORT_EXPERTS`` experts."""
    return (
        triton_available(x.device)
        and x.dim() == 2
        and x.stride(1) == 1
        and x.dtype in _ROW_DTYPES
        and ids.dim() == 2
        and len(ids) == len(x)
        and ids.is_contiguous()
        and ids.dtype == torch.int64
        and ids.device == x.device
        and num_experts <= _MAX_SORT_EXPERTS
    )


def sort_by_expert_kernel(
    x: torch.Tensor, ids: torch.Tensor, num_experts: int, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped GEMM's input in four launches: (every (row, column) pair of ``ids`` [rows,
    top_k] whose expert lies in ``first`` .. ``first + num_experts - 1``, its row of ``x``, sorted
    by expert and in pair order within one, [rows * min(top_k, num_experts), hidden] (a row names
    each expert once; the rows past the last expert's end are left unwritten); each pair's
    position there [rows, top_k], -1 for the others; each expert's end offset among them, int32
    [num_experts]). The positions are a stable sort's, as ``expert_compute.sort_by_expert`` gives
    them. A counting sort over blocks of pairs, linear in the pairs: each block counts its pairs
    per expert, one program turns the counts into each block's first position per expert and the
    experts' ends, each block places its pairs, and a program per pair copies its row, so only
    the pairs of these experts move a row (a group's slice of many rows reads their ids alone)."""
    rows, top_k = ids.shape
    hidden = x.shape[1]
    pairs = rows * top_k
    sorted_rows = x.new_empty(rows * min(top_k, num_experts), hidden)
    position = torch.empty(rows, top_k, dtype=torch.int64, device=x.device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=x.device)  # _sort_bases writes every end
    if pairs == 0 or num_experts == 0:
        return sorted_rows, position.fill_(-1), ends.zero_()
    keys = max(2, triton.next_power_of_2(num_experts))
    blocks = triton.cdiv(pairs, _BLOCK_SCAN)
    counts = torch.empty(blocks, keys, dtype=torch.int32, device=x.device)
    _sort_count[(blocks,)](ids, counts, pairs, first, num_experts, KEYS=keys, BLOCK=_BLOCK_SCAN, num_warps=4)
    _sort_bases[(1,)](counts, ends, blocks, num_experts, KEYS=keys, TILE=_BASE_TILE, num_warps=4)
    _sort_place[(blocks,)](ids, counts, position, pairs, first, num_experts, KEYS=keys, BLOCK=_BLOCK_SCAN, num_warps=4)
    _sort_copy[(pairs,)](
        x,
        position,
        sorted_rows,
        len(sorted_rows),
        top_k,
        hidden,
        x.stride(0),
        BLOCK_HIDDEN=min(_MAX_BLOCK_HIDDEN, triton.next_power_of_2(max(hidden, 1))),
        num_warps=4,
    )
    return sorted_rows, position, ends


if triton is not None:

    @triton.jit
    def _block_hits(ids_ptr, block, pairs, first, num_experts, KEYS: tl.constexpr, BLOCK: tl.constexpr):
        """The pairs of block ``block``: their indices, whether each is a pair of an expert here,
        its expert (-1 none) and the one-hot [KEYS, BLOCK] of expert by pair. The experts are keys
        along the outer dimension and the pairs along the inner one, the scans' (a scan along the
        outer dimension with a single key gave wrong positions on an H200, ``send_rows``)."""
        i = block * BLOCK + tl.arange(0, BLOCK)
        live = i < pairs
        given = tl.load(ids_ptr + i, mask=live, other=-1)
        expert = tl.where((given >= first) & (given < first + num_experts), given - first, -1).to(tl.int32)
        keys = tl.arange(0, KEYS)
        hit = (keys[:, None] == expert[None, :]) & live[None, :]
        return i, live, expert, hit

    @triton.jit
    def _sort_count(ids_ptr, counts_ptr, pairs, first, num_experts, KEYS: tl.constexpr, BLOCK: tl.constexpr):
        """Block ``program_id(0)``'s pairs per expert, a row of ``counts`` [blocks, KEYS]."""
        block = tl.program_id(0)
        _, _, _, hit = _block_hits(ids_ptr, block, pairs, first, num_experts, KEYS, BLOCK)
        tl.store(counts_ptr + block * KEYS + tl.arange(0, KEYS), tl.sum(hit.to(tl.int32), axis=1))

    @triton.jit
    def _sort_bases(counts_ptr, ends_ptr, blocks, num_experts, KEYS: tl.constexpr, TILE: tl.constexpr):
        """One program: the experts' ends (the running sum of their totals), then each block's
        row of ``counts`` replaced by where its first pair of each expert goes (the expert's start
        plus the pairs of earlier blocks). ``TILE`` blocks a step, keys along the outer dimension."""
        keys = tl.arange(0, KEYS)
        total = tl.zeros((KEYS,), dtype=tl.int32)
        for start in tl.range(0, blocks, TILE):
            block = start + tl.arange(0, TILE)
            tile = tl.load(counts_ptr + block[None, :] * KEYS + keys[:, None], mask=block[None, :] < blocks, other=0)
            total += tl.sum(tile, axis=1)
        ends = tl.cumsum(total, axis=0)
        tl.store(ends_ptr + keys, ends, mask=keys < num_experts)
        base = ends - total
        for start in tl.range(0, blocks, TILE):
            block = start + tl.arange(0, TILE)
            where = counts_ptr + block[None, :] * KEYS + keys[:, None]
            live = block[None, :] < blocks
            tile = tl.load(where, mask=live, other=0)
            tl.store(where, base[:, None] + tl.cumsum(tile, axis=1) - tile, mask=live)
            base += tl.sum(tile, axis=1)

    @triton.jit
    def _sort_place(
        ids_ptr, bases_ptr, position_ptr, pairs, first, num_experts, KEYS: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Block ``program_id(0)``: each pair's position is its block's base for its expert plus
        its rank among the block's earlier pairs of that expert; -1 for a pair of no expert here."""
        block = tl.program_id(0)
        i, live, expert, hit = _block_hits(ids_ptr, block, pairs, first, num_experts, KEYS, BLOCK)
        hits = hit.to(tl.int32)
        base = tl.load(bases_ptr + block * KEYS + tl.arange(0, KEYS))
        before = base[:, None] + tl.cumsum(hits, axis=1) - hits
        place = tl.sum(tl.where(hit, before, 0), axis=0)
        tl.store(position_ptr + i, tl.where(expert >= 0, place, -1).to(tl.int64), mask=live)

    @triton.jit
    def _sort_copy(x_ptr, position_ptr, out_ptr, out_rows, top_k, hidden, stride_x, BLOCK_HIDDEN: tl.constexpr):
        """Pair ``program_id(0)``: its row of ``x`` goes to its position; a pair of no expert here
        (-1) copies nothing, nor one past the output's rows (ids naming an expert twice in a row,
        which routing never gives: never a write out of bounds)."""
        pair = tl.program_id(0).to(tl.int64)
        place = tl.load(position_ptr + pair)
        place = tl.where(place < out_rows, place, -1)
        source = x_ptr + (pair // top_k) * stride_x
        target = out_ptr + place * hidden
        for offset in tl.range(0, hidden, BLOCK_HIDDEN):
            cols = offset + tl.arange(0, BLOCK_HIDDEN)
            mask = (cols < hidden) & (cols * 0 + place >= 0)  # a vector mask, as in _pad_rows
            tl.store(target + cols, tl.load(source + cols, mask=mask), mask=mask)

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
