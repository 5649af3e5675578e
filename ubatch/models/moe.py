"""The MoE reference model: shared attention blocks, and a routed-expert FFN with expert
parallelism over an optional process group.

A token travels once to each destination rank that holds any of its experts, as DeepEP's dispatch
does, with or without expert groups (``ubatch.models.dispatch``): with fine-grained experts (top-8
of 64 over two ranks) that moves a quarter of the rows a row per expert would.

With a ``capacity_factor``, and in any CUDA-graph capture, dispatch and combine are shape-static:
every buffer's shape depends only on the number of tokens, so there is no host sync and the path
is graph-capturable. Each rank sends a fixed ``capacity`` rows per chunk to every destination rank,
and every row carries where it comes back, so the sender gathers the combine without any extra
routing message. Without a capacity factor an eager step exchanges its row counts first (one
small all-to-all and a host sync) and sends only its real rows, where the static path would send
the worst case, ``tokens`` rows to every destination. Expert-parallel ranks must run the same
number of tokens per step (the data-parallel coordinator pads them to the maximum).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ubatch import comm, islands, scheduler
from ubatch.context import in_static_collectives
from ubatch.link import is_link
from ubatch.models import expert_compute, send_rows
from ubatch.models.config import ModelConfig
from ubatch.models.dense import Decoder
from ubatch.models.dispatch import (
    BlockTables,
    balanced_chunk_rows,
    block_starts,
    consecutive_slices,
    counted_dispatch_plan,
    split_dispatch_rows,
    static_tables,
    token_pieces,
)
from ubatch.models.gather_sum import gather_sum
from ubatch.models.gemm_lanes import GemmLanes
from ubatch.models.layers import SwiGLUMLP, check_divisible, frozen, group_rank_world, init_weight
from ubatch.models.return_places import place_returns
from ubatch.models.router import route_top_k


def _start_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any,
    splits: tuple[list[int], list[int]] | None = None,
    link_rows: torch.Tensor | None = None,
) -> comm.CollectiveHandle | None:
    """``comm.all_to_all_single`` over ``group``, started without waiting (None: done already),
    with ``splits`` (rows received from, rows sent to each rank) or equal ones. No group means one
    rank even inside a multi-rank job, where ``comm`` would read None as the whole world.
    ``link_rows``: the rows to other ranks a padded buffer really holds (on the device), which a
    link stand-in that sizes transfers on the GPU charges instead of the padded size."""
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        output.copy_(input)
        return None
    received, sent = splits if splits is not None else (None, None)
    return comm.all_to_all_single(output, input, received, sent, group=group, async_op=True, link_rows=link_rows)


def _wait(handle: comm.CollectiveHandle | None) -> None:
    if handle is not None:
        handle.wait()


@dataclass
class _Dispatched:
    """One ubatch's rows in flight to the experts and back. Buffers are chunk-major (one chunk per
    expert group), then one block per rank (``ubatch.models.dispatch``); slices are rows of them.

    ``out`` holds each received row's weighted sum over its experts, in the received layout: with
    one expert group it is the combine's input itself, with several a float32 sum each group adds
    to, which ``comb_source`` (each combine row's received row, -1 none) gathers from once a row's
    latest group ran. ``row_block`` ([received rows]: its (chunk, source rank) block) and
    ``comb_starts`` (where each (chunk, source rank) block of the combine starts) place a received
    row in the combine. ``splits`` / ``comb_splits``: per chunk, (rows received per rank, rows
    sent per rank) where the counts were exchanged."""

    num_tokens: int
    send: torch.Tensor
    recv: torch.Tensor
    back: torch.Tensor
    recv_chunks: list[slice]
    comb_chunks: list[slice]
    back_chunks: list[slice]
    row_block: torch.Tensor | None
    comb_starts: torch.Tensor | None
    dispatches: list[comm.CollectiveHandle | None]
    # Per chunk, this rank's rows to its own experts in the send and the received buffer (the
    # all-to-all hands them over unchanged).
    own_sent: list[slice]
    own_received: list[slice]
    splits: list[tuple[list[int], list[int]]] | None = None
    comb_splits: list[tuple[list[int], list[int]]] | None = None
    out: torch.Tensor | None = None
    comb_source: torch.Tensor | None = None
    # The chunks are runs of the rows sent to each rank (static token chunks), not expert groups:
    # each goes through the experts on its own (_token_run_stage).
    token_runs: bool = False
    # The combines' inputs, held with ``send`` until the layer's combines are waited: freed while
    # a transfer still reads them, their blocks could go to new work on the stream that made them
    # (another ubatch's shared experts, the next expert group).
    combine_inputs: list[torch.Tensor] = field(default_factory=list)
    # Of a static dispatch over a link that sizes transfers on the GPU: per dispatch chunk and per
    # combine chunk, the rows to other ranks that hold a token (what each collective charges the
    # link), counted by the plan.
    link_rows: torch.Tensor | None = None
    comb_link_rows: torch.Tensor | None = None


_Layout = tuple[BlockTables | None, torch.Tensor | None]  # MoEFFN._static_layout's


class MoEFFN(nn.Module):
    """Top-k softmax router (renormalised top-k weights), routed SwiGLU experts split evenly
    across ``ep_group``, plus optional shared experts (one fused SwiGLU, tensor-parallel over
    ``tp_group`` like the dense MLP).

    ``overflow_count`` accumulates, on the device, the (token, expert) assignments dropped for
    lack of capacity; whoever reads it resets it. ``use_grouped_mm`` selects the expert compute:
    one grouped GEMM over rows sorted by expert, or a static-shape masked loop over local
    experts (the fallback where grouped GEMM is unsupported; it computes every local expert on
    every received row). ``join_ubatches`` joins the expert stages of a split step's ubatches:
    each ubatch routes and dispatches its own tokens (its attention ran under the others'
    transfers), then one grouped GEMM per expert group runs over every ubatch's rows, so a split
    no longer reads the expert weights once per ubatch (eager and FULL graphs); so do the shared
    experts where they are not tensor-parallel (``_joined_stage``).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        device: torch.device,
        ep_group: Any = None,
        tp_group: Any = None,
    ) -> None:
        super().__init__()
        rank, world = group_rank_world(ep_group)
        check_divisible("num_experts", config.num_experts, world, "expert-parallel")
        self.name = f"layers.{layer_idx}.moe"
        self.ep_group = ep_group
        self.ep_rank = rank
        self.ep_world = world
        self.top_k = config.top_k
        self.capacity_factor = config.capacity_factor
        self.num_local_experts = config.num_experts // world
        if self.num_local_experts > 256:
            raise ValueError(
                f"{self.num_local_experts} experts per rank: at most 256 (their ids travel as "
                f"bf16 values in the dispatch rows)"
            )
        hidden, inter = config.hidden_size, config.moe_intermediate_size

        def weight(name: str, shape: tuple[int, int], fan_in: int, dtype: torch.dtype) -> torch.Tensor:
            return init_weight(
                shape, seed=config.seed, name=f"{self.name}.{name}", std=fan_in**-0.5, dtype=dtype, device=device
            )

        self.router = frozen(weight("router", (config.num_experts, hidden), hidden, torch.float32))
        local = range(rank * self.num_local_experts, (rank + 1) * self.num_local_experts)
        self.w13 = frozen(
            torch.stack(
                [
                    torch.cat(
                        [
                            weight(f"experts.{e}.gate", (inter, hidden), hidden, config.dtype),
                            weight(f"experts.{e}.up", (inter, hidden), hidden, config.dtype),
                        ]
                    )
                    for e in local
                ]
            )
        )
        self.w2 = frozen(
            torch.stack([weight(f"experts.{e}.down", (hidden, inter), inter, config.dtype) for e in local])
        )
        self.shared = None
        if config.num_shared_experts:
            self.shared = SwiGLUMLP(
                hidden,
                config.num_shared_experts * inter,
                prefix=f"{self.name}.shared",
                seed=config.seed,
                dtype=config.dtype,
                device=device,
                tp_group=tp_group,
            )
        self.register_buffer("overflow_count", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self.expert_chunks = 1
        self.token_chunks = 1
        self.join_ubatches = False
        self.local_first = False
        self.expert_capacity_factor: float | None = None
        self.chunk_capacity_factors: dict[int, tuple[float, ...]] = {}
        self.shape_capacity_factors: dict[tuple[int, int], tuple[float, ...]] = {}
        self.use_grouped_mm = expert_compute.grouped_mm_supported(device, config.dtype, hidden, inter)
        self._layouts: dict[tuple[tuple[int, ...], torch.device], _Layout] = {}

    def capacity(self, num_tokens: int) -> list[int]:
        """Rows each rank sends each destination rank per dispatch chunk for ``num_tokens``
        tokens (a chunk per expert group, by the earliest group of a token's experts there; the
        combine's chunks, by the latest, take the same sizes in reverse order): the worst case,
        every token, or a capacity factor times what a uniform router sends there
        (``dispatch.balanced_chunk_rows``), at least 1 and at most the worst case. The factors per
        chunk are ``shape_capacity_factors[(expert_chunks, num_tokens)]``, else
        ``chunk_capacity_factors[expert_chunks]``, else ``capacity_factor`` for every chunk
        (``capacity.MeasuredCapacity`` sets all three)."""
        chunks = self.expert_chunks
        if self.capacity_factor is None:
            return [num_tokens] * chunks
        shape = (chunks, num_tokens)
        factors = self.shape_capacity_factors.get(shape)
        if factors is None:
            factors = self.chunk_capacity_factors.get(chunks, (self.capacity_factor,) * chunks)
        if len(factors) != chunks:
            in_shapes = shape in self.shape_capacity_factors
            name = f"shape_capacity_factors[{shape}]" if in_shapes else f"chunk_capacity_factors[{chunks}]"
            raise ValueError(f"{self.name}: {name} must hold {chunks} factors, got {factors}")
        experts = self.num_local_experts * self.ep_world
        shares = balanced_chunk_rows(num_tokens, experts, self.top_k, self.ep_world, chunks)
        return [max(1, min(num_tokens, math.ceil(f * share))) for f, share in zip(factors, shares)]

    @property
    def charges_real_rows(self) -> bool:
        """Whether the link is charged only the rows a dispatch or combine really holds: always
        without a capacity factor (the counted dispatch sends them alone), and under one where
        the expert-parallel group sizes its transfers on the GPU (``ProxyLink``), to which the
        static plan hands its counts."""
        return self.capacity_factor is None or self._link_sizes_on_device

    @property
    def _link_sizes_on_device(self) -> bool:
        return is_link(self.ep_group) and self.ep_group.sizes_on_device

    @property
    def expert_chunks(self) -> int:
        """Groups of local experts the dispatch -> experts -> combine chain is pipelined over."""
        return self._expert_chunks

    @expert_chunks.setter
    def expert_chunks(self, chunks: int) -> None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or self.num_local_experts % chunks:
            raise ValueError(
                f"expert_chunks must be a positive int dividing the {self.num_local_experts} local "
                f"experts, got {chunks!r}"
            )
        self._expert_chunks = chunks

    @property
    def token_chunks(self) -> int:
        """Chunks the dispatch -> experts -> combine chain is pipelined over: every chunk's
        dispatch starts first, then chunk c's expert GEMMs run while chunk c + 1's rows are in
        flight and chunk c - 1's come back. A chunk is a run of the rows sent to each rank, in
        token order: under a capacity, equal runs of the unsplit step's blocks; counted, the rows
        of a piece of the tokens. Each chunk reads the experts' weights again, so it pays where the
        GEMMs are compute-bound (prefill), and it works with one expert per rank, where expert
        groups cannot (the two do not combine, nor with joined experts)."""
        return self._token_chunks

    @token_chunks.setter
    def token_chunks(self, chunks: int) -> None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"token_chunks must be a positive int, got {chunks!r}")
        self._token_chunks = chunks

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32 summing to 1, expert ids [T, k])."""
        return route_top_k(x, self.router, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, dispatch, run the experts, combine; with ``expert_chunks`` k > 1 the chain runs
        per group of local experts, so group g's GEMMs run while the next chunk of rows is in
        flight, every expert's weights are still read once, and a token still travels once to each
        rank; with ``token_chunks`` it runs per chunk of the rows sent each rank, in token order
        (counted: per piece of the tokens, ``token_pieces``), every chunk's dispatch started
        before any expert GEMM. The shared experts run under the dispatches
        (single-batch overlap): they need only ``x``. With ``join_ubatches`` the expert stage waits
        for every ubatch of the step and runs once over all their rows, the shared experts'
        with it."""
        weights, ids = self.route(x)
        if self.token_chunks > 1 and (self.join_ubatches or self.expert_chunks > 1):
            raise ValueError(
                f"{self.name}: token_chunks={self.token_chunks} cuts the expert stage, as joined experts "
                f"(join_ubatches={self.join_ubatches}) and expert groups (expert_chunks={self.expert_chunks}) "
                f"do; use one of them"
            )
        if self.capacity_factor is None and not _static_only():
            pieces = token_pieces(len(x), self.token_chunks)
            sent = self._dispatch_counted(x, ids, weights, pieces)
        else:
            pieces = [slice(0, len(x))]
            sent = [self._dispatch_static(x, ids, weights)]

        if self.join_ubatches:
            if islands.recording_active():
                raise RuntimeError(
                    f"{self.name}: joined experts (join_ubatches=True) cannot be captured in a PIECEWISE graph, "
                    f"whose replay would run the join eagerly; use FULL graphs or run eagerly"
                )
            # shared experts with no collective of their own join the stage (once over every ubatch)
            joins_shared = self.shared is not None and self.shared.tp_group is None
            shared = self.shared(x) if self.shared is not None and not joins_shared else None
            handles, joined_shared = scheduler.join_ubatches(
                f"{self.name}.experts", (sent[0][1], x if joins_shared else None), self._joined_stage
            )
            combines = [handles]
            if joins_shared:
                shared = joined_shared
        else:
            shared = self.shared(x) if self.shared is not None else None
            combines = [self._expert_stage([dispatched])[0] for _, dispatched in sent]
        out = x.new_empty(x.shape)  # contiguous, whatever x is
        for piece, (back_slot, dispatched), handles in zip(pieces, sent, combines):
            for handle in handles:
                _wait(handle)
            combine_rows(dispatched.back, back_slot, None if shared is None else shared[piece], out=out[piece])
        return out

    def _dispatch_static(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, _Dispatched]:
        """Each (chunk, destination) block sent at its full capacity (graph-capturable)."""
        num_tokens, hidden = x.shape
        chunks, world = self.expert_chunks, self.ep_world
        caps = self.capacity(num_tokens)
        if self.token_chunks > 1:
            return self._dispatch_token_chunks(x, ids, weights, caps[0])
        tables, row_block = self._static_layout(caps, x.device)
        link = self._link_counts(chunks, x.device)
        back_slot, _, send = send_rows.static_plan(
            x,
            ids,
            weights,
            self.num_local_experts,
            chunks,
            world,
            tuple(caps),
            tables,
            counter=self.overflow_count,
            link_rows=link,
            own_rank=self.ep_rank,
        )
        recv_chunks = consecutive_slices([world * cap for cap in caps])
        back_chunks = consecutive_slices([world * cap for cap in reversed(caps)])
        link_rows, comb_link_rows = (None, None) if link is None else link
        recv, dispatches = self._start_dispatches(send, recv_chunks, recv_chunks, None, link_rows)
        own = _own_rows(recv_chunks, [[cap] * world for cap in caps], self.ep_rank)
        return back_slot, _Dispatched(
            num_tokens=num_tokens,
            send=send,
            recv=recv,
            back=x.new_empty(back_chunks[-1].stop, hidden),
            recv_chunks=recv_chunks,
            comb_chunks=back_chunks,  # every rank's blocks have the same sizes
            back_chunks=back_chunks,
            row_block=row_block,
            comb_starts=None if tables is None else tables.back_starts,
            dispatches=dispatches,
            own_sent=own,
            own_received=own,
            link_rows=link_rows,
            comb_link_rows=comb_link_rows,
        )

    def _link_counts(self, transfers: int, device: torch.device) -> torch.Tensor | None:
        """Room for a static plan to count, per dispatch and per combine all-to-all, the rows to
        other ranks that hold a token (``dispatch.count_link_rows``) where the group is a link that
        sizes its transfers on the GPU (``ProxyLink``): it charges those, not the padded blocks
        (each expert group's block pads for itself, 1.5-2x its rows at 256 decode tokens). None
        for any other group."""
        if not self._link_sizes_on_device:
            return None
        return torch.empty(2, transfers, dtype=torch.int64, device=device)

    def _dispatch_token_chunks(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, cap: int
    ) -> tuple[torch.Tensor, _Dispatched]:
        """The static dispatch of ``cap`` rows per destination (rounded up to a multiple of
        ``token_chunks``) sent in ``token_chunks`` equal runs of every destination's block, each
        run one all-to-all: a run holds the next rows in token order, so the chunks together send
        the unsplit step's padding, where chunks of the tokens would each pad for their own
        fullest block (1.6x balanced at 1024 tokens against 1.3x at 4096, moe-bench prefill over
        eight ranks, run 19)."""
        chunks, world = self.token_chunks, self.ep_world
        run = math.ceil(cap / chunks)
        link = self._link_counts(chunks, x.device)
        back_slot, _, send = send_rows.static_plan(
            x,
            ids,
            weights,
            self.num_local_experts,
            1,
            world,
            (run * chunks,),
            runs=chunks,
            counter=self.overflow_count,
            link_rows=link,
            own_rank=self.ep_rank,
        )
        runs = consecutive_slices([world * run] * chunks)
        link_rows, comb_link_rows = (None, None) if link is None else link
        recv, dispatches = self._start_dispatches(send, runs, runs, None, link_rows)
        own = _own_rows(runs, [[run] * world] * chunks, self.ep_rank)
        return back_slot, _Dispatched(
            num_tokens=len(x),
            send=send,
            recv=recv,
            back=x.new_empty(len(send), x.shape[1]),
            recv_chunks=runs,
            comb_chunks=runs,
            back_chunks=runs,
            row_block=None,
            comb_starts=None,
            dispatches=dispatches,
            own_sent=own,
            own_received=own,
            token_runs=True,
            link_rows=link_rows,
            comb_link_rows=comb_link_rows,
        )

    def _start_dispatches(
        self,
        send: torch.Tensor,
        send_chunks: list[slice],
        recv_chunks: list[slice],
        splits: list[tuple[list[int], list[int]]] | None,
        link_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[comm.CollectiveHandle | None]]:
        """The receive buffer and each chunk's all-to-all, started (``link_rows``: per chunk, see
        ``_start_all_to_all``). One rank receives what it sends: the send buffer itself, with
        nothing to start or wait for."""
        if self.ep_world == 1:
            return send, [None] * len(recv_chunks)
        recv = send.new_empty(recv_chunks[-1].stop, send.shape[1])
        dispatches = [
            _start_all_to_all(
                recv[r],
                send[b],
                self.ep_group,
                None if splits is None else splits[c],
                None if link_rows is None else link_rows[c : c + 1],
            )
            for c, (r, b) in enumerate(zip(recv_chunks, send_chunks))
        ]
        return recv, dispatches

    def _static_layout(self, caps: list[int], device: torch.device) -> _Layout:
        """With expert groups, the block tables of dispatch chunks of ``caps`` rows per rank
        (``dispatch.static_tables``) and each received row's block, on ``device``; one group needs
        neither. Kept per layout when made outside a graph capture (a capture records kernels
        without running them, so its tensors hold nothing until a replay)."""
        if len(caps) == 1:
            return None, None
        key = (tuple(caps), device)
        if key in self._layouts:
            return self._layouts[key]
        tables = static_tables(caps, self.ep_world, device)
        row_block = torch.arange(len(tables.sizes), device=device).repeat_interleave(
            tables.sizes, output_size=self.ep_world * sum(caps)
        )
        layout = tables, row_block
        if not _capturing():
            self._layouts[key] = layout
        return layout

    def _dispatch_counted(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pieces: list[slice]
    ) -> list[tuple[torch.Tensor, _Dispatched]]:
        """Only the real rows, per token piece: every rank's rows per (chunk, destination) block,
        and the rows it expects back per combine block, exchanged first for every piece at once
        (one small all-to-all and one host sync), then each chunk's all-to-all with those splits.
        Nothing is dropped."""
        k, world = self.expert_chunks, self.ep_world
        plans = [counted_dispatch_plan(x[p], ids[p], weights[p], self.num_local_experts, k, world) for p in pieces]
        # [destination rank, piece, 2k]: the rows this rank sends it per chunk, then those it expects back
        counts = torch.stack(
            [torch.cat([sizes.view(k, world), back.view(k, world)]).t() for _, sizes, back, _ in plans], dim=1
        ).contiguous()
        received = counts
        if world > 1:
            received = torch.empty_like(counts)
            comm.all_to_all_single(received, counts, group=self.ep_group)
        host = torch.cat([counts, received]).tolist()  # the splits, on the host
        return [
            self._start_counted(
                piece, plan, [row[i] for row in host[:world]], [row[i] for row in host[world:]], received[:, i]
            )
            for i, (piece, plan) in enumerate(zip(pieces, plans))
        ]

    def _start_counted(
        self,
        piece: slice,
        plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        sent: list[list[int]],
        got: list[list[int]],
        got_device: torch.Tensor,
    ) -> tuple[torch.Tensor, _Dispatched]:
        """One piece's dispatches started with its exchanged counts: ``sent`` / ``got`` [rank][2k]
        (rows to / from each rank per chunk, then rows back per combine chunk), ``got_device`` the
        same received counts on the device."""
        k, world = self.expert_chunks, self.ep_world
        back_slot, _, _, send = plan
        sent_rows = [[sent[d][c] for d in range(world)] for c in range(k)]
        back_rows = [[sent[d][k + c] for d in range(world)] for c in range(k)]
        received_rows = [[got[s][c] for s in range(world)] for c in range(k)]
        comb_rows = [[got[s][k + c] for s in range(world)] for c in range(k)]
        send_chunks = consecutive_slices([sum(rows) for rows in sent_rows])
        recv_chunks = consecutive_slices([sum(rows) for rows in received_rows])
        splits = list(zip(received_rows, sent_rows))
        recv, dispatches = self._start_dispatches(send, send_chunks, recv_chunks, splits)
        row_block = comb_starts = None
        if k > 1:  # where a landed row goes in the combine (_combine_chunk)
            blocks = got_device[:, :k].t().flatten()  # rows per received (chunk, source) block
            row_block = torch.arange(k * world, device=send.device).repeat_interleave(
                blocks, output_size=recv_chunks[-1].stop
            )
            comb_starts = block_starts(got_device[:, k:].t().flatten())
        back_chunks = consecutive_slices([sum(rows) for rows in back_rows])
        return back_slot, _Dispatched(
            num_tokens=piece.stop - piece.start,
            send=send,
            recv=recv,
            back=send.new_empty(back_chunks[-1].stop, self.w2.shape[1]),
            recv_chunks=recv_chunks,
            comb_chunks=consecutive_slices([sum(rows) for rows in comb_rows]),
            back_chunks=back_chunks,
            row_block=row_block,
            comb_starts=comb_starts,
            dispatches=dispatches,
            own_sent=_own_rows(send_chunks, sent_rows, self.ep_rank),
            own_received=_own_rows(recv_chunks, received_rows, self.ep_rank),
            splits=splits,
            comb_splits=list(zip(back_rows, comb_rows)),
        )

    def _joined_stage(
        self, values: list[tuple[_Dispatched, torch.Tensor | None]]
    ) -> list[tuple[list[comm.CollectiveHandle | None], torch.Tensor | None]]:
        """The expert stage joined over every ubatch (``_expert_stage``), each ubatch's handles
        with its shared experts' output. Where the ubatches hand in their rows (shared experts with
        no collective of their own) the shared experts run here once over all of them, before the
        expert groups: their weights are read once, and they run while the last ubatch's dispatch
        is in flight, when nothing else has work."""
        rows = [x for _, x in values]
        shared: list[torch.Tensor | None] = [None] * len(values)
        if rows[0] is not None:
            joined = rows[0] if len(rows) == 1 else torch.cat(rows)
            shared = list(self.shared(joined).split([len(x) for x in rows]))
        return list(zip(self._expert_stage([part for part, _ in values]), shared))

    def _expert_stage(self, parts: list[_Dispatched]) -> list[list[comm.CollectiveHandle | None]]:
        """Each expert group's GEMMs over the received rows of every part (one per ubatch when
        the ubatches' expert stages are joined, so the weights are read once for all of them),
        then the combine of the rows whose latest group that was; the combines' handles, per part.
        Group g reads every row of chunks 0..g where it landed (a row's chunk is its earliest
        group). With ``local_first`` the rows a rank routed to its own experts go first, from the
        send buffer, while the group's dispatch is still in flight."""
        if parts[0].token_runs:  # token chunks never join, so one part
            return [self._token_run_stage(parts[0])]
        chunks = self.expert_chunks
        hidden = self.w2.shape[1]
        one_rank = self.ep_world == 1  # the combine's rows are its input: written in place
        for part in parts:
            if chunks == 1:
                part.out = part.back if one_rank else part.recv.new_empty(len(part.recv), hidden)
            else:  # no zeros: a row's first group writes its sum (_run_rows)
                part.out = torch.empty(len(part.recv), hidden, dtype=torch.float32, device=part.recv.device)
                part.comb_source = torch.full((part.comb_chunks[-1].stop + 1,), -1, device=part.recv.device)
        combines: list[list[comm.CollectiveHandle | None]] = [[] for _ in parts]
        num_tokens = sum(part.num_tokens for part in parts)
        lanes = GemmLanes(parts[0].recv.device, chunks, rows=sum(len(part.recv) for part in parts))
        for g in range(chunks):
            if self.local_first and self.ep_world > 1:
                self._local_first_group(parts, g, num_tokens)
            else:
                pieces = []
                for part in parts:
                    rows = part.recv_chunks[g]  # the chunks before it hold earlier groups' sums
                    pieces.append((part.recv[: rows.stop], part.out[: rows.stop], rows.start))
                self._run_rows(pieces, g, num_tokens, lanes.stage(g, [part.dispatches[g] for part in parts]))
            for part, handles in zip(parts, combines):
                if one_rank:
                    if chunks > 1:
                        self._combine_chunk(part, g, part.back[part.back_chunks[g]])
                    continue
                rows = part.out if chunks == 1 else self._combine_chunk(part, g)
                part.combine_inputs.append(rows)
                splits = None if part.comb_splits is None else part.comb_splits[g]
                back = part.back[part.back_chunks[g]]
                link_rows = None if part.comb_link_rows is None else part.comb_link_rows[g : g + 1]
                handles.append(_start_all_to_all(back, rows, self.ep_group, splits, link_rows))
        return combines

    def _token_run_stage(self, part: _Dispatched) -> list[comm.CollectiveHandle | None]:
        """Per run of rows (``_dispatch_token_chunks``): its rows through the experts once they
        landed (with ``local_first`` this rank's own rows first, from the send buffer), then its
        combine started; the combines' handles."""
        one_rank = self.ep_world == 1
        part.out = part.back if one_rank else part.recv.new_empty(len(part.recv), self.w2.shape[1])
        handles = []
        lanes = GemmLanes(part.recv.device, len(part.recv_chunks), rows=len(part.recv))
        for c, rows in enumerate(part.recv_chunks):
            if self.local_first and not one_rank:
                own = part.own_received[c]
                self._run_rows([(part.send[part.own_sent[c]], part.out[own], 0)], 0, part.num_tokens)
                _wait(part.dispatches[c])
                peers = (slice(rows.start, own.start), slice(own.stop, rows.stop))
                self._run_rows([(part.recv[p], part.out[p], 0) for p in peers], 0, part.num_tokens)
            else:
                pieces = [(part.recv[rows], part.out[rows], 0)]
                self._run_rows(pieces, 0, part.num_tokens, lanes.stage(c, [part.dispatches[c]]))
            if not one_rank:
                link_rows = None if part.comb_link_rows is None else part.comb_link_rows[c : c + 1]
                handles.append(_start_all_to_all(part.back[rows], part.out[rows], self.ep_group, None, link_rows))
        return handles

    def _combine_chunk(self, part: _Dispatched, chunk: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of combine chunk ``chunk`` (those whose latest expert group it is), in the
        rows' dtype (written to ``out`` where given), once the rows of dispatch chunk ``chunk``, the
        last to land, have their place in the combine (``return_places``)."""
        rows = part.recv_chunks[chunk]
        place_returns(
            part.recv[rows],
            rows.start,
            self.w2.shape[1],
            self.top_k,
            self.num_local_experts // self.expert_chunks,
            self.ep_world,
            part.row_block,
            part.comb_starts,
            part.comb_source,
        )
        source = part.comb_source[part.comb_chunks[chunk]]
        if out is None:
            out = part.recv.new_empty(len(source), part.out.shape[1])
        return gather_sum(part.out, source[:, None], out=out)

    def _local_first_group(self, parts: list[_Dispatched], g: int, num_tokens: int) -> None:
        """Group ``g`` with the own rows of chunk ``g`` (from the send buffer) and the rows of the
        chunks before it before the chunk's dispatch is waited, the other ranks' rows of chunk ``g``
        after."""
        first = []
        for part in parts:
            landed, own = part.recv_chunks[g].start, part.own_received[g]
            first += [(part.recv[:landed], part.out[:landed], landed), (part.send[part.own_sent[g]], part.out[own], 0)]
        self._run_rows(first, g, num_tokens)
        peers = []
        for part in parts:
            _wait(part.dispatches[g])
            rows, own = part.recv_chunks[g], part.own_received[g]
            for piece in (slice(rows.start, own.start), slice(own.stop, rows.stop)):
                peers.append((part.recv[piece], part.out[piece], 0))
        self._run_rows(peers, g, num_tokens)

    def _run_rows(
        self,
        pieces: list[tuple[torch.Tensor, torch.Tensor, int]],
        g: int,
        num_tokens: int,
        lane: contextlib.AbstractContextManager[None] | None = None,
    ) -> None:
        """Expert group ``g`` over the dispatch rows of every (rows, out, written) piece in one
        call: each row through each of its experts of the group, weighted and summed into its row
        of ``out``, added to the sums earlier groups wrote in its first ``written`` rows. The
        GEMMs run inside ``lane`` (``GemmLanes.stage``, which waits for the rows), the sums after
        it on the current stream."""
        with contextlib.nullcontext() if lane is None else lane:
            pieces = [piece for piece in pieces if len(piece[0])]
            if not pieces:
                return
            joined = pieces[0][0] if len(pieces) == 1 else torch.cat([rows for rows, _, _ in pieces])
            x, ids, weights = split_dispatch_rows(joined, self.w2.shape[1], self.top_k)
            src, index, weights = self._experts(x, ids, weights, g, num_tokens)
        start = 0
        for rows, out, written in pieces:
            stop = start + len(rows)
            weight = None if weights is None else weights[start:stop]
            gather_sum(src, index[start:stop], weight, add=out[:written] if written else None, out=out)
            start = stop

    def _experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group: int, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Expert group ``group`` over rows routed from ``num_tokens`` tokens per rank
        (``expert_compute.group_outputs``), its dropped pairs counted."""
        size = self.num_local_experts // self.expert_chunks
        experts = slice(group * size, (group + 1) * size)
        return expert_compute.group_outputs(
            x,
            ids,
            weights,
            self.w13[experts],
            self.w2[experts],
            first=group * size,
            capacity=self.expert_capacity(num_tokens, ids.numel()),
            use_grouped_mm=self.use_grouped_mm,
            dropped=self.overflow_count,
        )

    def static_rows(self, num_tokens: int) -> int:
        """Rows a static dispatch of ``num_tokens`` tokens sends each destination rank in the
        layer's current mode: every expert group's capacity; with token chunks the call's capacity
        rounded up to a multiple of them (``_dispatch_token_chunks``' runs)."""
        caps = self.capacity(num_tokens)
        if self.token_chunks > 1:
            return self.token_chunks * math.ceil(caps[0] / self.token_chunks)
        return sum(caps)

    def expert_capacity(self, num_tokens: int, num_rows: int) -> int | None:
        """Rows per local expert of the padded batched GEMM for ``num_rows`` received rows routed
        from ``num_tokens`` tokens per rank (``expert_compute.padded_capacity``), or None where the
        grouped GEMM runs, as always without a ``capacity_factor`` (no row may be dropped).
        ``expert_capacity_factor`` (None: ``capacity_factor``) scales a balanced expert's rows;
        rows past the capacity are dropped and counted like the dispatch's. (One expert's rows vary
        more than a dispatch block of many experts, so a measured factor for the experts is
        larger: ``ubatch.models.capacity``.)"""
        if self.capacity_factor is None:
            return None
        factor = self.capacity_factor if self.expert_capacity_factor is None else self.expert_capacity_factor
        balanced = num_tokens * self.top_k / self.num_local_experts  # every rank's tokens over all experts
        return expert_compute.padded_capacity(balanced, num_rows, factor, pipelined=self.expert_chunks > 1)


def _own_rows(chunks: list[slice], rows_per_rank: list[list[int]], rank: int) -> list[slice]:
    """Per chunk, the rows of ``rank``'s block, for blocks of ``rows_per_rank[chunk][rank]`` rows."""
    return [
        slice(chunk.start + sum(rows[:rank]), chunk.start + sum(rows[: rank + 1]))
        for chunk, rows in zip(chunks, rows_per_rank)
    ]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _static_only() -> bool:
    """Whether the dispatch must be shape-static: a CUDA graph (FULL or PIECEWISE) is being
    recorded or warmed up for (no host sync, fixed shapes), or the step must issue the collectives
    a replay would (``static_collectives``: peers may be replaying it)."""
    return in_static_collectives() or islands.recording_active() or _capturing()


def combine_rows(
    back: torch.Tensor, slot: torch.Tensor, shared: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each token's rows gathered back from their slots [tokens, world] (each already its
    experts' weighted sum at one destination; -1: none) and summed in float32, with the shared
    experts' output (written to ``out`` where given)."""
    return gather_sum(back, slot, add=shared, out=out)


class MoEDecoder(Decoder):
    """DeepSeek/Mixtral-style decoder: attention blocks as in the dense model, MoE FFNs with
    expert parallelism over ``ep_group``.

    ``moe_layers`` maps each MoE layer's name to the layer; ``overflow_counters()`` exposes their
    dropped-assignment counters for the runner to check after each step.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str,
        tp_group: Any = None,
        ep_group: Any = None,
        attn_backend: Any = None,
    ) -> None:
        if not config.num_experts:
            raise ValueError("MoEDecoder needs a config with num_experts > 0, got num_experts=0")
        device = torch.device(device)

        def make_moe(i: int) -> nn.Module:
            return MoEFFN(config, i, device=device, ep_group=ep_group, tp_group=tp_group)

        super().__init__(config, make_moe, device=device, tp_group=tp_group, attn_backend=attn_backend)
        self.moe_layers: dict[str, MoEFFN] = {layer.ffn.name: layer.ffn for layer in self.layers}

    def overflow_counters(self) -> dict[str, torch.Tensor]:
        """Layer name -> device counter of assignments dropped for lack of capacity."""
        return {name: layer.overflow_count for name, layer in self.moe_layers.items()}
