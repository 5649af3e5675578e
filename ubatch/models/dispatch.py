"""Which rows a MoE layer sends to which rank, and where each comes back: the dispatch plans.

A token travels once to each destination rank that holds any of its experts, as DeepEP's dispatch
does, not once per expert: its row carries the local ids and router weights of all its experts
there in extra columns, the destination runs the row through each of them and returns one row,
their weighted sum, and the sender adds up its rows from every destination.

With the local experts in ``chunks`` groups (expert pipelining) the row still travels once. It goes
in the dispatch chunk of the earliest group holding any of its experts there, so group g's GEMMs
start once chunks 0..g have landed, and it comes back in the combine chunk of its latest group,
once its weighted sum is complete. (Sending a row to every group that needs it would move up to
``chunks`` times the rows: with top-2 of 8 experts over two ranks, two groups sent 1.18x the rows
of one, four 1.27x; with top-8 of 64 nearly ``chunks`` times.) Each row carries its return
position, its rank among its sender's rows to that destination with the same latest group, so the
destination places it in the combine without a scan of its own.

Buffers are chunk-major, then one block per rank. Static plans (CUDA graphs, capacity factors)
give every (chunk, rank) block a fixed size; counted plans pack the real rows and exchange counts.
"""

from __future__ import annotations

import math

import torch

from ubatch.models.fusion import fused


def row_groups(
    ids: torch.Tensor, n_local: int, chunks: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first, last, count), each [tokens, world]: the earliest and latest expert group among a
    token's experts on each rank (``chunks`` and -1 where it has none there) and how many of its
    experts that rank holds (0: no row goes there)."""
    dest = ids // n_local
    group = ids % n_local // (n_local // chunks)
    on = dest[:, :, None] == torch.arange(world, device=ids.device)  # [token, expert, rank]
    first = torch.where(on, group[:, :, None], chunks).amin(dim=1)
    last = torch.where(on, group[:, :, None], -1).amax(dim=1)
    return first, last, on.sum(dim=1)


def balanced_chunk_rows(num_tokens: int, num_experts: int, top_k: int, world: int, chunks: int) -> list[float]:
    """Rows each dispatch chunk gets per destination from ``num_tokens`` tokens routed uniformly
    (top-``top_k`` of ``num_experts`` distinct experts): chunk c holds the tokens with none of
    their experts there in groups 0..c-1 and some in group c. The combine's chunks, by the latest
    group, get the same shares in reverse order."""
    size = num_experts // (world * chunks)
    total = math.comb(num_experts, top_k)

    def missed(groups: int) -> float:
        return math.comb(num_experts - groups * size, top_k) / total

    return [num_tokens * (missed(c) - missed(c + 1)) for c in range(chunks)]


def rank_within_key(key: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each element's rank among the elements of ``key`` [n] with its key, in order; each key's
    count [num_keys]). Keys outside [0, num_keys) are counted nowhere and their rank means nothing.
    A one-hot scan along the inner dimension (an outer-dimension one is ~19x slower on an H200:
    benchmarks/h200x2/explore/moe_dispatch_scan.log)."""
    onehot = key[None, :] == torch.arange(num_keys, device=key.device)[:, None]
    ranks = onehot.cumsum(dim=1)
    rank = ranks.gather(0, key.clamp(0, num_keys - 1)[None])[0] - 1
    return rank, onehot.sum(dim=1)


def block_starts(sizes: torch.Tensor) -> torch.Tensor:
    """Where each block starts in a buffer of blocks of ``sizes`` rows laid end to end."""
    return sizes.cumsum(0) - sizes


def _int32_columns(dtype: torch.dtype) -> int:
    """Columns of ``dtype`` that hold one int32, bit for bit."""
    return 32 // torch.finfo(dtype).bits


def _weight_columns(top_k: int, dtype: torch.dtype) -> int:
    """Columns of ``dtype`` that hold ``top_k`` float32 router weights, bit for bit."""
    return top_k * _int32_columns(dtype)


def dispatch_row_width(hidden: int, top_k: int, dtype: torch.dtype) -> int:
    """Columns of a dispatch row: the hidden state, the weights, the return position, the ids,
    rounded up so that a row is a multiple of 16 bytes (NCCL is far slower on misaligned per-peer
    chunks). The weights and the position stay 4-byte aligned for an even ``hidden``."""
    per_16_bytes = 128 // torch.finfo(dtype).bits
    width = hidden + _weight_columns(top_k, dtype) + top_k + _int32_columns(dtype)
    return -(-width // per_16_bytes) * per_16_bytes


def row_column_offsets(hidden: int, top_k: int, dtype: torch.dtype) -> tuple[int, int]:
    """(first column of the return position, first column of the ids) in a dispatch row."""
    position = hidden + _weight_columns(top_k, dtype)
    return position, position + _int32_columns(dtype)


def split_dispatch_rows(rows: torch.Tensor, hidden: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states, expert ids [rows, top_k] (int64, -1 where none), float32 weights) of
    dispatch rows."""
    position, ids = row_column_offsets(hidden, top_k, rows.dtype)
    weights = rows[:, hidden:position].contiguous().view(torch.float32)
    return rows[:, :hidden], rows[:, ids : ids + top_k].long(), weights


def _row_columns(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_local: int, world: int, position: torch.Tensor
) -> torch.Tensor:
    """The extra columns of each (token, rank) row [tokens * world + 1, extra]: the router
    weights (float32 bits) and local ids (-1 for the others) of the token's experts on that rank,
    and the row's return ``position`` [tokens, world]. The last row is a padding row's: ids -1."""
    num_tokens, top_k = ids.shape
    on = (ids // n_local)[:, None, :] == torch.arange(world, device=ids.device)[None, :, None]  # [token, rank, expert]
    weight_cols = torch.where(on, weights[:, None, :], 0.0).reshape(num_tokens * world, top_k)
    id_cols = torch.where(on, (ids % n_local)[:, None, :], -1).reshape(num_tokens * world, top_k)
    hidden = x.shape[1]
    position_at, ids_at = (at - hidden for at in row_column_offsets(hidden, top_k, x.dtype))
    columns = x.new_zeros(num_tokens * world + 1, dispatch_row_width(hidden, top_k, x.dtype) - hidden)
    columns[:-1, :position_at] = weight_cols.contiguous().view(x.dtype)
    # one int32 a row: viewed flat (a [n, 1] view of another element size has no unit stride to
    # compile against)
    columns[:-1, position_at:ids_at] = position.to(torch.int32).flatten().view(x.dtype).view(-1, ids_at - position_at)
    columns[:-1, ids_at : ids_at + top_k] = id_cols.to(x.dtype)
    columns[-1, ids_at : ids_at + top_k] = -1
    return columns


def _gather_send(x: torch.Tensor, columns: torch.Tensor, slot: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The send buffer [num_rows, row width]: each slot's row gathered from the (token, rank) row
    whose ``slot`` [tokens, world] it is, padding rows (ids -1) where none is."""
    num_tokens, world = slot.shape
    padding = num_tokens * world  # the padding row of ``columns``
    targets = torch.where(slot >= 0, slot, num_rows).flatten()
    source = torch.full((num_rows + 1,), padding, dtype=torch.int64, device=x.device)
    source = source.scatter_(0, targets, torch.arange(padding, device=x.device))[:num_rows]
    if num_tokens == 0:
        return torch.cat([x.new_zeros(num_rows, x.shape[1]), columns[source]], dim=1)
    token = (source // world).clamp(max=num_tokens - 1)
    return torch.cat([x[token], columns[source]], dim=1)


def _return_positions(
    slot: torch.Tensor, sent: torch.Tensor, last: torch.Tensor, chunks: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each sent row's position in its combine block, that block [tokens, world], rows per
    combine block): a row comes back in the block of (its latest group, its destination), in the
    order it was sent (slot order), which is the order its destination received it in."""
    world = slot.shape[1]
    blocks = chunks * world
    block = torch.where(sent, last * world + torch.arange(world, device=slot.device), blocks)
    at_slot = torch.full((num_slots + 1,), blocks, dtype=torch.int64, device=slot.device)
    at_slot = at_slot.scatter_(0, torch.where(sent, slot, num_slots).flatten(), block.flatten())[:num_slots]
    rank, counts = rank_within_key(at_slot, blocks)
    return rank[slot.clamp(min=0)], block, counts


@fused
def dispatch_plan(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    n_local: int,
    chunks: int,
    sizes: torch.Tensor,
    back_sizes: torch.Tensor,
    num_slots: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The static plan, for dispatch blocks of ``sizes`` rows and combine blocks of ``back_sizes``
    (each [chunks * world], chunk-major; ``num_slots`` rows in all): (each (token, rank) row's slot
    in the combine buffer [tokens, world], -1 where none comes back; (token, expert) assignments
    dropped for lack of room; the send buffer [num_slots, row width]).

    Rows go to their block in token order; one past its dispatch block's size is dropped, and so
    is one past its combine block's (the last of that block's rows in slot order, so the others'
    positions stand). The sizes are tensors, not kept: a captured graph keeps its own, whatever
    ``expert_chunks`` is set to later."""
    world = len(sizes) // chunks
    first, last, count = row_groups(ids, n_local, chunks, world)
    present = count > 0
    block = torch.where(present, first * world + torch.arange(world, device=x.device), chunks * world)
    pos = rank_within_key(block.flatten(), chunks * world)[0].view_as(block)
    block = block.clamp(max=chunks * world - 1)
    kept = present & (pos < sizes[block])
    slot = torch.where(kept, block_starts(sizes)[block] + pos, -1)
    if chunks == 1:
        position, back_block = pos, block
    else:
        position, back_block, _ = _return_positions(slot, kept, last, chunks, num_slots)
        back_block = back_block.clamp(max=chunks * world - 1)
    returned = kept & (position < back_sizes[back_block])
    back_slot = torch.where(returned, block_starts(back_sizes)[back_block] + position, -1)
    dropped = torch.where(present & ~returned, count, 0).sum()
    columns = _row_columns(x, ids, weights, n_local, world, position)
    return back_slot, dropped, _gather_send(x, columns, torch.where(returned, slot, -1), num_slots)


def counted_dispatch_plan(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_local: int, chunks: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan of the real rows only: (each (token, rank) row's slot in the combine buffer
    [tokens, world], -1 where none; rows per dispatch block and per combine block, each
    [chunks * world]; the send buffer [tokens * min(top_k, world), row width]), the blocks packed
    one after another from the first row: ``dispatch_plan``'s layout without capacity."""
    num_tokens, top_k = ids.shape
    first, last, count = row_groups(ids, n_local, chunks, world)
    present = count > 0
    block = torch.where(present, first * world + torch.arange(world, device=x.device), chunks * world)
    pos, sizes = rank_within_key(block.flatten(), chunks * world)
    pos = pos.view_as(block)
    slot = torch.where(present, block_starts(sizes)[block.clamp(max=chunks * world - 1)] + pos, -1)
    num_slots = num_tokens * min(top_k, world)
    if chunks == 1:
        position, back_block, back_sizes = pos, block, sizes
    else:
        position, back_block, back_sizes = _return_positions(slot, present, last, chunks, num_slots)
    back_start = block_starts(back_sizes)[back_block.clamp(max=chunks * world - 1)]
    back_slot = torch.where(present, back_start + position, -1)
    columns = _row_columns(x, ids, weights, n_local, world, position)
    return back_slot, sizes, back_sizes, _gather_send(x, columns, slot, num_slots)
