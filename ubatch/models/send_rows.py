"""The static dispatch plan (``dispatch.dispatch_plan``) in three Triton kernels on CUDA.

Why: in torch ops the sender's plan is about 30 small kernels per layer with one expert group
(each (token, rank) row's block, a one-hot scan for its position, the slot, the extra columns, the
gather of the send buffer) and about 50 with several; inside a CUDA graph each costs a few
microseconds whatever its size, and the pipelined modes' extra ones were most of what they cost
over the unsplit step with no communication (benchmarks/RESULTS.md, run 10). Here a first pass
counts each block of (token, rank) rows per key, a second places every row after the rows of the
blocks before its own and the earlier rows of its own (the torch scan's positions, so the same
slots), both spread over as many programs as there are blocks of rows: a plan walked by one
program took longer the more tokens a layer routed, before any row could leave (token chunks as
runs of the whole call's blocks lost to chunks planned one by one, run 19). A third kernel writes
every send row, in the plan's order or, for token chunks, run-major (it reads each row's slot in
the plan, so the plan's scatter stays the one the GPU tests cover).
"""

from __future__ import annotations

import torch

from ubatch._triton import tl, triton, triton_available
from ubatch.models.dispatch import (
    BlockTables,
    check_link_rows,
    check_runs,
    chunk_major_slots,
    count_link_rows,
    dispatch_plan,
    dispatch_row_width,
    row_column_offsets,
)

_MAX_TOP_K = 16  # experts a token may have here; more take the torch path
_MAX_KEYS = 128  # (chunk, rank) blocks the scan counts at once, dispatch and combine together
_BLOCK_ROWS = 256  # (token, rank) rows each program of the plan's two passes takes, at most
_TILE = 4096
"""Keys times rows of a plan program's one-hot: with many keys (eight expert groups over eight
ranks are 128) a program takes fewer rows, so the passes spread over more programs (256 rows
against 128 keys made eight programs of 0.1 ms each in a 256-token decode layer over eight
ranks, benchmarks/h100/run23)."""
_BASE_TILE = 32  # earlier blocks' counts a plan program sums per loop step
_MAX_BLOCK_HIDDEN = 1024  # row elements copied per loop step
_ROW_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_takes(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, chunks: int, world: int) -> bool:
    """Whether the kernels handle this plan: CUDA with Triton, dense rows, contiguous int64 ids and
    float32 weights of at most ``_MAX_TOP_K`` experts a token, at most ``_MAX_KEYS`` keys."""
    return (
        triton_available(x.device)
        and x.dim() == 2
        and x.stride(1) == 1
        and x.dtype in _ROW_DTYPES
        and ids.is_contiguous()
        and ids.dtype == torch.int64
        and weights.is_contiguous()
        and weights.dtype == torch.float32
        and ids.shape[1] <= _MAX_TOP_K
        and _scan_keys(chunks, world) <= _MAX_KEYS
    )


def _scan_keys(chunks: int, world: int) -> int:
    """Keys the plan's scan counts: a dispatch block per (chunk, rank), and with expert groups a
    combine block per (chunk, rank) after them (with one group the two are the same block)."""
    return chunks * world * (1 if chunks == 1 else 2)


def static_plan(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    n_local: int,
    chunks: int,
    world: int,
    caps: tuple[int, ...],
    tables: BlockTables | None = None,
    *,
    runs: int = 1,
    counter: torch.Tensor | None = None,
    link_rows: torch.Tensor | None = None,
    own_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dispatch.dispatch_plan``: by the kernels where they take the inputs, else in torch. The
    dropped count is added to ``counter`` (an int64 device scalar, then returned in its place)
    where one is given, and each transfer's rows to ranks other than ``own_rank`` are written to
    ``link_rows`` (``dispatch.count_link_rows``)."""
    if kernel_takes(x, ids, weights, chunks, world):
        return dispatch_plan_kernel(
            x,
            ids,
            weights,
            n_local,
            chunks,
            world,
            caps,
            tables,
            runs=runs,
            counter=counter,
            link_rows=link_rows,
            own_rank=own_rank,
        )
    back_slot, dropped, send = dispatch_plan(x, ids, weights, n_local, chunks, world, caps, tables, runs=runs)
    if link_rows is not None:
        count_link_rows(link_rows, ids, back_slot, n_local, chunks, world, caps, runs=runs, own_rank=own_rank)
    return back_slot, dropped if counter is None else counter.add_(dropped), send


def dispatch_plan_kernel(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    n_local: int,
    chunks: int,
    world: int,
    caps: tuple[int, ...],
    tables: BlockTables | None = None,
    *,
    runs: int = 1,
    counter: torch.Tensor | None = None,
    link_rows: torch.Tensor | None = None,
    own_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dispatch.dispatch_plan`` in three kernels and two small torch ops, with the same slots,
    dropped count and rows, except that a padding row's hidden state is zeros (no expert reads
    it). With a ``counter`` the plan adds the dropped count to it atomically (ubatches on other
    streams may count into the same one), and returns it as the count. Into ``link_rows`` the
    passes write each transfer's kept rows to ranks other than ``own_rank``
    (``dispatch.count_link_rows``), so a link that sizes transfers on the GPU costs no kernel more."""
    check_runs(runs, chunks, caps)
    transfers = chunks if chunks > 1 else runs  # all-to-alls of the dispatch, and of the combine
    if link_rows is not None:
        check_link_rows(link_rows, chunks, runs)
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_slots = world * sum(caps)
    width = dispatch_row_width(hidden, top_k, x.dtype)
    position_at, ids_at = row_column_offsets(hidden, top_k, x.dtype)
    back_slot = torch.empty(num_tokens, world, dtype=torch.int64, device=x.device)
    back_pos = torch.empty(num_tokens * world, dtype=torch.int32, device=x.device)
    source = torch.empty(num_slots, dtype=torch.int32, device=x.device)
    dropped = torch.zeros((), dtype=torch.int64, device=x.device) if counter is None else counter
    send = x.new_empty(num_slots, width)
    if num_tokens == 0:  # every slot a padding row; the kernels would read from empty tensors
        send.zero_()[:, ids_at : ids_at + top_k] = -1
        if link_rows is not None:
            link_rows.zero_()
        return back_slot, dropped, send
    if chunks == 1:
        starts = sizes = back_starts = back_sizes = back_slot  # unread: one chunk has no tables
    else:
        starts, sizes, back_starts, back_sizes = tables
    scan = (
        ids,
        num_tokens * world,
        top_k,
        n_local,
        n_local // chunks,
        world,
    )
    keys = max(2, triton.next_power_of_2(_scan_keys(chunks, world)))
    block_rows = max(16, min(_BLOCK_ROWS, _TILE // keys))
    meta = dict(CHUNKS=chunks, KEYS=keys, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_ROWS=block_rows, num_warps=4)
    programs = triton.cdiv(num_tokens * world, block_rows)
    counts = torch.empty(programs, meta["KEYS"], dtype=torch.int32, device=x.device)
    link = dict(LINK=link_rows is not None, TRANSFERS=triton.next_power_of_2(transfers))
    link_ptr = dropped if link_rows is None else link_rows  # unread without LINK
    _count_kernel[(programs,)](
        *scan, counts, source, num_slots, triton.cdiv(num_slots, programs), link_ptr, transfers, **link, **meta
    )
    _place_kernel[(programs,)](
        *scan,
        counts,
        back_slot,
        back_pos,
        source,
        dropped,
        starts,
        sizes,
        back_starts,
        back_sizes,
        caps[0],
        link_ptr,
        own_rank,
        caps[0] // runs,
        transfers,
        BASE_TILE=_BASE_TILE,
        **link,
        **meta,
    )
    if num_slots:
        _send_rows_kernel[(num_slots,)](
            x,
            ids,
            weights,
            back_pos,
            source,
            send,
            x.stride(0),
            hidden,
            width,
            position_at,
            ids_at,
            top_k,
            n_local,
            world,
            caps[0] // runs,
            RUNS=runs,
            BLOCK_HIDDEN=min(_MAX_BLOCK_HIDDEN, triton.next_power_of_2(max(hidden, 1))),
            BLOCK_TAIL=triton.next_power_of_2(width - ids_at),
            num_warps=4,
        )
    return chunk_major_slots(back_slot, caps[0], world, runs), dropped, send


if triton is not None:

    @triton.jit
    def _row_keys(
        ids_ptr,
        num_rows,
        top_k,
        n_local,
        group_size,
        world,
        CHUNKS: tl.constexpr,
        KEYS: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
    ):
        """The (token, rank) rows ``i = token * world + rank`` of this program's block: (i, live,
        the token's experts on the rank, whether a row goes there, its dispatch block (its earliest
        expert group's chunk, then the rank), its combine key (with expert groups its latest
        group's block, counted after the dispatch blocks; else the dispatch block), the one-hot of
        a row's keys [KEYS, BLOCK_ROWS], and of its dispatch and its combine key alone)."""
        i = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = i < num_rows
        token = i // world
        rank = i % world
        cols = tl.arange(0, BLOCK_K)
        ids = tl.load(
            ids_ptr + token[:, None].to(tl.int64) * top_k + cols[None, :],
            mask=live[:, None] & (cols[None, :] < top_k),
            other=-1,
        ).to(tl.int32)  # int64 division is many times slower
        on = (ids >= 0) & (ids // n_local == rank[:, None])
        count = tl.sum(on.to(tl.int32), axis=1)
        present = live & (count > 0)
        if CHUNKS == 1:
            block = rank
            back_key = rank
        else:
            group = (ids % n_local) // group_size
            first = tl.min(tl.where(on, group, CHUNKS), axis=1)
            last = tl.max(tl.where(on, group, -1), axis=1)
            block = first * world + rank
            back_key = last * world + rank + CHUNKS * world
        keys = tl.arange(0, KEYS)
        at_block = keys[:, None] == block[None, :]
        at_back = keys[:, None] == back_key[None, :]
        hit = present[None, :] & (at_block | at_back)
        return i, live, count, present, block, back_key, hit, at_block, at_back

    @triton.jit
    def _count_kernel(
        ids_ptr,
        num_rows,
        top_k,
        n_local,
        group_size,
        world,
        counts_ptr,
        source_ptr,
        num_slots,
        slots_per_program,
        link_ptr,
        num_transfers,
        CHUNKS: tl.constexpr,
        KEYS: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        LINK: tl.constexpr,
        TRANSFERS: tl.constexpr,
    ):
        """Pass one: this block's rows per key, ``counts[program, key]``; and this program's share
        of the send slots cleared to -1 (no row), before pass two writes the kept rows' ones; with
        ``LINK`` the first program clears the [2, ``num_transfers``] link counts pass two adds to."""
        if LINK:
            if tl.program_id(0) == 0:
                every = tl.arange(0, 2 * TRANSFERS)
                tl.store(link_ptr + every, tl.zeros((2 * TRANSFERS,), tl.int64), mask=every < 2 * num_transfers)
        keys = tl.arange(0, KEYS)
        _, _, _, _, _, _, hit, _, _ = _row_keys(
            ids_ptr, num_rows, top_k, n_local, group_size, world, CHUNKS, KEYS, BLOCK_K, BLOCK_ROWS
        )
        tl.store(counts_ptr + tl.program_id(0) * KEYS + keys, tl.sum(hit.to(tl.int32), axis=1))
        first = tl.program_id(0) * slots_per_program
        for start in tl.range(0, slots_per_program, BLOCK_ROWS):
            slot = first + start + tl.arange(0, BLOCK_ROWS)
            live = (slot < first + slots_per_program) & (slot < num_slots)
            tl.store(source_ptr + slot, tl.full((BLOCK_ROWS,), -1, tl.int32), mask=live)

    @triton.jit
    def _place_kernel(
        ids_ptr,
        num_rows,
        top_k,
        n_local,
        group_size,
        world,
        counts_ptr,
        back_slot_ptr,
        back_pos_ptr,
        source_ptr,
        dropped_ptr,
        starts_ptr,
        sizes_ptr,
        back_starts_ptr,
        back_sizes_ptr,
        cap,
        link_ptr,
        own_rank,
        run,
        num_transfers,
        CHUNKS: tl.constexpr,
        KEYS: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BASE_TILE: tl.constexpr,
        LINK: tl.constexpr,
        TRANSFERS: tl.constexpr,
    ):
        """Pass two: each row's position in its dispatch and combine block among the earlier rows
        (the blocks before this one's, summed from their ``counts`` ``BASE_TILE`` blocks a step,
        then this block's, in order), its slots, and ``source[slot] = i`` for every kept row (pass
        one cleared the slots to -1). A row past either block's room is dropped with all its
        experts there. With ``LINK`` the kept rows to ranks other than ``own_rank`` are added to
        ``link`` [2, transfers] per dispatch and per combine transfer: with expert groups its
        earliest and its latest group's, with one group its run of ``run`` rows."""
        i, live, count, present, block, back_key, hit, at_block, at_back = _row_keys(
            ids_ptr, num_rows, top_k, n_local, group_size, world, CHUNKS, KEYS, BLOCK_K, BLOCK_ROWS
        )
        keys = tl.arange(0, KEYS)
        hits = hit.to(tl.int32)
        seen = tl.zeros((KEYS,), dtype=tl.int32)
        # every earlier program's counts, BASE_TILE a step: quadratic in the programs, which are
        # tens in decode and at most about a thousand in a 4096-token prefill with 128 keys
        for start in tl.range(0, tl.program_id(0), BASE_TILE):
            program = start + tl.arange(0, BASE_TILE)
            earlier = program[None, :] < tl.program_id(0)
            tile = tl.load(counts_ptr + program[None, :] * KEYS + keys[:, None], mask=earlier, other=0)
            seen += tl.sum(tile, axis=1)
        before = seen[:, None] + tl.cumsum(hits, axis=1) - hits  # earlier rows with each key
        pos = tl.sum(tl.where(hit & at_block, before, 0), axis=0)
        back_pos = tl.sum(tl.where(hit & at_back, before, 0), axis=0)
        if CHUNKS == 1:
            returned = present & (pos < cap)
            slot = block * cap + pos
            back_slot = slot
        else:
            back_block = back_key - CHUNKS * world
            room = tl.load(sizes_ptr + block, mask=present, other=0)
            back_room = tl.load(back_sizes_ptr + back_block, mask=present, other=0)
            returned = present & (pos < room) & (back_pos < back_room)
            slot = tl.load(starts_ptr + block, mask=present, other=0) + pos
            back_slot = tl.load(back_starts_ptr + back_block, mask=present, other=0) + back_pos
        tl.store(back_slot_ptr + i, tl.where(returned, back_slot, -1).to(tl.int64), mask=live)
        tl.store(back_pos_ptr + i, back_pos.to(tl.int32), mask=live)
        tl.store(source_ptr + slot, i.to(tl.int32), mask=returned)
        dropped = tl.sum(tl.where(present & ~returned, count, 0).to(tl.int64), axis=0)
        tl.atomic_add(dropped_ptr, dropped)
        if LINK:
            to_others = returned & (i % world != own_rank)
            if CHUNKS == 1:
                sent = pos // run
                back = sent
            else:
                sent = block // world
                back = back_block // world
            transfers = tl.arange(0, TRANSFERS)
            add_sent = tl.sum(((transfers[:, None] == sent[None, :]) & to_others[None, :]).to(tl.int64), axis=1)
            add_back = tl.sum(((transfers[:, None] == back[None, :]) & to_others[None, :]).to(tl.int64), axis=1)
            tl.atomic_add(link_ptr + transfers, add_sent, mask=transfers < num_transfers)
            tl.atomic_add(link_ptr + num_transfers + transfers, add_back, mask=transfers < num_transfers)

    @triton.jit
    def _send_rows_kernel(
        x_ptr,
        ids_ptr,
        weights_ptr,
        back_pos_ptr,
        source_ptr,
        send_ptr,
        stride_x,
        hidden,
        width,
        position_at,
        ids_at,
        top_k,
        n_local,
        world,
        run,
        RUNS: tl.constexpr,
        BLOCK_HIDDEN: tl.constexpr,
        BLOCK_TAIL: tl.constexpr,
    ):
        """Send row ``program_id(0)``: the hidden state of the (token, rank) row its slot holds,
        that token's router weights (float32 bits) and local ids of its experts on that rank, the
        row's return position (int32 bits), zeros after; a slot no row holds gets zeros and ids
        -1. With ``RUNS`` > 1 the rows go out run-major (``dispatch.chunk_major_slots``): row s is
        position ``s % run`` of run ``s // (world * run)`` of rank ``s // run % world``'s block,
        whose slot in the plan (block-major) it reads."""
        s = tl.program_id(0)
        slot = s
        if RUNS > 1:
            slot = (s // run) % world * (run * RUNS) + s // (world * run) * run + s % run
        i = tl.load(source_ptr + slot)
        real = i >= 0
        token = tl.maximum(i, 0) // world
        rank = tl.maximum(i, 0) % world
        row = send_ptr + s.to(tl.int64) * width
        source = x_ptr + token.to(tl.int64) * stride_x
        for start in tl.range(0, hidden, BLOCK_HIDDEN):
            cols = start + tl.arange(0, BLOCK_HIDDEN)
            inside = cols < hidden
            real_cols = cols * 0 + i >= 0  # a vector mask (a scalar one fails under the interpreter)
            tl.store(row + cols, tl.load(source + cols, mask=inside & real_cols, other=0.0), mask=inside)
        k = tl.arange(0, BLOCK_TAIL)  # at least top_k: the ids and the padding after them
        in_k = k < top_k
        real_k = in_k & (k * 0 + i >= 0)
        ids = tl.load(ids_ptr + token.to(tl.int64) * top_k + k, mask=real_k, other=-1).to(tl.int32)
        on = (ids >= 0) & (ids // n_local == rank)
        weights = tl.load(weights_ptr + token.to(tl.int64) * top_k + k, mask=real_k, other=0.0)
        tl.store((row + hidden).to(tl.pointer_type(tl.float32)) + k, tl.where(on, weights, 0.0), mask=in_k)
        position = tl.where(real, tl.load(back_pos_ptr + tl.maximum(i, 0)), 0)
        tl.store((row + position_at).to(tl.pointer_type(tl.int32)), position)
        # The ids go out as floats built as floats: with one local expert (n_local specialized to
        # 1, ids % 1 folded to 0) an int -1 chosen by the selects came out +1.0 once converted.
        local = tl.where(on, (ids % n_local).to(tl.float32), tl.where(in_k, -1.0, 0.0))
        tl.store(row + ids_at + k, local.to(send_ptr.dtype.element_ty), mask=ids_at + k < width)
