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
position, its rank in token order among its sender's rows to that destination with the same
latest group, so the destination places it in the combine without a scan of its own.

Buffers are chunk-major, then one block per rank. Static plans (CUDA graphs, capacity factors)
give every (chunk, rank) block a fixed size; counted plans pack the real rows and exchange counts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ubatch.models.fusion import fused


def row_blocks(
    ids: torch.Tensor, n_local: int, chunks: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts per (token, rank) [tokens, world], each (token, rank) row's dispatch block (its
    earliest expert group's chunk, then the rank: ``chunk * world + rank``) and combine block (its
    latest group's), ``2 * chunks * world`` where no row goes): with one chunk both blocks are the
    rank."""
    on = (ids // n_local)[:, :, None] == torch.arange(world, device=ids.device)
    count = on.sum(dim=1)
    rank = torch.arange(world, device=ids.device)
    none = _none(chunks, world)
    if chunks == 1:
        block = torch.where(count > 0, rank, none)
        return count, block, block
    group = (ids % n_local // (n_local // chunks))[:, :, None]
    first = torch.where(on, group, chunks).amin(dim=1)
    last = torch.where(on, group, -1).amax(dim=1)
    present = count > 0
    return count, torch.where(present, first * world + rank, none), torch.where(present, last * world + rank, none)


def _none(chunks: int, world: int) -> int:
    """The block of a (token, rank) pair with no row: past every block, also once a second set of
    ``chunks * world`` keys is laid after the first (``_positions``)."""
    return 2 * chunks * world


class BlockTables(NamedTuple):
    """A static layout's blocks, each [chunks * world], chunk-major: where each dispatch block
    starts and how many rows it holds, and the same for the combine's."""

    starts: torch.Tensor
    sizes: torch.Tensor
    back_starts: torch.Tensor
    back_sizes: torch.Tensor


def _positions(
    block: torch.Tensor, back_block: torch.Tensor, chunks: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's position in its dispatch block, in its combine block (both in token order),
    rows per dispatch block, rows per combine block): with expert groups both from one scan over
    the two keys laid end to end."""
    blocks = chunks * world
    if chunks == 1:
        pos, sizes = rank_within_key(block.flatten(), blocks)
        return pos.view_as(block), pos.view_as(block), sizes, sizes
    rank, sizes = rank_within_key(torch.cat([block.flatten(), back_block.flatten() + blocks]), 2 * blocks)
    pos, back_pos = rank.view(2, *block.shape)
    return pos, back_pos, sizes[:blocks], sizes[blocks:]


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


def token_pieces(num_tokens: int, chunks: int) -> list[slice]:
    """``num_tokens`` cut into ``chunks`` consecutive slices as even as possible, the larger first
    (fewer where there are fewer tokens; one, maybe empty, for none): ``MoEFFN.token_chunks``'s
    dispatches."""
    chunks = max(1, min(chunks, num_tokens))
    base, extra = divmod(num_tokens, chunks)
    return consecutive_slices([base + 1] * extra + [base] * (chunks - extra))


def check_runs(runs: int, chunks: int, caps: tuple[int, ...]) -> None:
    """ValueError unless ``runs`` is a positive int, and above 1 only with one expert group
    (``chunks``) whose capacity it divides."""
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be a positive int, got {runs!r}")
    if runs > 1 and (chunks != 1 or caps[0] % runs):
        raise ValueError(
            f"runs={runs} needs one expert group whose capacity it divides, got chunks={chunks}, caps={caps}"
        )


def chunk_major_slots(slot: torch.Tensor, cap: int, world: int, chunks: int) -> torch.Tensor:
    """Slots ``rank * cap + position`` of blocks of ``cap`` rows (-1: none, kept) laid out in
    ``chunks`` runs of ``q = cap / chunks`` rows per block, run-major: ``run * world * q + rank * q
    + position % q``, so each run of every rank's block is contiguous and one all-to-all sends it
    (``MoEFFN.token_chunks``). With one run, the slots as they are."""
    if chunks == 1:
        return slot
    q = cap // chunks
    rank, position = slot // cap, slot % cap
    moved = (position // q) * (world * q) + rank * q + position % q
    return torch.where(slot >= 0, moved, slot)


def consecutive_slices(rows: list[int]) -> list[slice]:
    """Slices of consecutive runs of ``rows`` rows each, from row 0."""
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


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
    dispatch rows [rows, width]; the weights are a view of the rows where they are 4-byte aligned."""
    position, ids = row_column_offsets(hidden, top_k, rows.dtype)
    per_float = _int32_columns(rows.dtype)
    if hidden % per_float or rows.stride(0) % per_float:  # the weights' bits straddle two floats
        weights = rows[:, hidden:position].contiguous().view(torch.float32)
    else:
        weights = rows.view(torch.float32)[:, hidden // per_float : position // per_float]
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


@fused
def dispatch_plan(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The static plan for dispatch chunks of ``caps`` rows per rank (the combine's chunks take
    them in reverse order): (each (token, rank) row's slot in the combine buffer [tokens, world], -1
    where none comes back; (token, expert) assignments dropped for lack of room; the send buffer
    [world * sum(caps), row width]). With expert groups, ``tables`` holds the blocks
    (``static_tables``); with one, ``runs`` > 1 lays each rank's block out in that many runs,
    run-major (``chunk_major_slots``; the combine's slots alike).

    A row past its dispatch or its combine block's room is dropped, with every expert of its
    token there; a position it held in the other block stays empty. A padding row's hidden state
    is any finite row (no expert reads it): here a token's, in ``send_rows``' kernels zeros."""
    check_runs(runs, chunks, caps)
    count, block, back_block = row_blocks(ids, n_local, chunks, world)
    pos, back_pos, _, _ = _positions(block, back_block, chunks, world)
    present = count > 0
    if chunks == 1:
        cap = caps[0]
        returned = present & (pos < cap)
        slot = back_slot = chunk_major_slots(torch.where(returned, block * cap + pos, -1), cap, world, runs)
    else:
        starts, sizes, back_starts, back_sizes = tables
        block, back_block = block.clamp(max=chunks * world - 1), back_block.clamp(max=chunks * world - 1)
        returned = present & (pos < sizes[block]) & (back_pos < back_sizes[back_block])
        slot = torch.where(returned, starts[block] + pos, -1)
        back_slot = torch.where(returned, back_starts[back_block] + back_pos, -1)
    dropped = torch.where(present & ~returned, count, 0).sum()
    columns = _row_columns(x, ids, weights, n_local, world, back_pos)
    return back_slot, dropped, _gather_send(x, columns, slot, world * sum(caps))


def count_link_rows(
    link_rows: torch.Tensor,
    ids: torch.Tensor,
    back_slot: torch.Tensor,
    n_local: int,
    chunks: int,
    world: int,
    caps: tuple[int, ...],
    *,
    runs: int = 1,
    own_rank: int = 0,
) -> torch.Tensor:
    """Write into ``link_rows`` [2, n] (int64) the rows of a static plan (``dispatch_plan``'s
    ``back_slot``) that go to ranks other than ``own_rank``: row 0 per dispatch all-to-all, row 1
    per combine, n being ``chunks`` expert groups (a row travels with its earliest group on the
    rank and returns with its latest) or, with one group, ``runs``. A link that sizes transfers
    on the GPU charges these instead of the padded blocks. Counted with scatters, not masks, so
    that a graph can capture it; ``send_rows``' kernel counts the same in its placing pass."""
    check_runs(runs, chunks, caps)
    check_link_rows(link_rows, chunks, runs)
    rank = torch.arange(world, device=back_slot.device)
    to_others = ((back_slot >= 0) & (rank != own_rank)).long().flatten()
    if chunks == 1:  # back_slot is run-major (chunk_major_slots): its run is the transfer
        per_run = world * (caps[0] // runs)
        sent = returned = (back_slot.clamp(min=0) // per_run).flatten()
    else:
        _, block, back_block = row_blocks(ids, n_local, chunks, world)
        sent = (block // world).clamp(max=chunks - 1).flatten()  # a row not sent adds nothing
        returned = (back_block // world).clamp(max=chunks - 1).flatten()
    index = torch.cat([sent, link_rows.shape[1] + returned])
    link_rows.zero_().view(-1).scatter_add_(0, index, to_others.repeat(2))
    return link_rows


def check_link_rows(link_rows: torch.Tensor, chunks: int, runs: int) -> None:
    """ValueError unless ``link_rows`` is an int64 [2, transfers] tensor, one column per dispatch
    (and combine) all-to-all: ``chunks`` expert groups, or with one group ``runs``."""
    transfers = chunks if chunks > 1 else runs
    if link_rows.dtype != torch.int64 or tuple(link_rows.shape) != (2, transfers) or not link_rows.is_contiguous():
        raise ValueError(
            f"link_rows must be a contiguous int64 tensor of shape (2, {transfers}), got "
            f"{link_rows.dtype} of shape {tuple(link_rows.shape)}"
        )


def static_tables(caps: list[int], world: int, device: torch.device) -> BlockTables:
    """The blocks of dispatch chunks of ``caps`` rows per rank (the combine's chunks take them in
    reverse order), on ``device``, filled there (a copy from host memory would synchronize, and a
    graph capture cannot record one from pageable memory)."""
    sizes = _device_ints([cap for cap in caps for _ in range(world)], device)
    back_sizes = _device_ints([cap for cap in reversed(caps) for _ in range(world)], device)
    return BlockTables(block_starts(sizes), sizes, block_starts(back_sizes), back_sizes)


def _device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.stack([torch.full((), v, dtype=torch.int64, device=device) for v in values])


def counted_dispatch_plan(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_local: int, chunks: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan of the real rows only: (each (token, rank) row's slot in the combine buffer
    [tokens, world], -1 where none; rows per dispatch block and per combine block, each
    [chunks * world]; the send buffer [tokens * min(top_k, world), row width]), the blocks packed
    one after another from the first row: ``dispatch_plan``'s layout without capacity."""
    num_tokens, top_k = ids.shape
    count, block, back_block = row_blocks(ids, n_local, chunks, world)
    pos, back_pos, sizes, back_sizes = _positions(block, back_block, chunks, world)
    present = count > 0
    last_block = chunks * world - 1
    slot = torch.where(present, block_starts(sizes)[block.clamp(max=last_block)] + pos, -1)
    if chunks == 1:
        back_slot = slot
    else:
        back_slot = torch.where(present, block_starts(back_sizes)[back_block.clamp(max=last_block)] + back_pos, -1)
    columns = _row_columns(x, ids, weights, n_local, world, back_pos)
    return back_slot, sizes, back_sizes, _gather_send(x, columns, slot, num_tokens * min(top_k, world))
