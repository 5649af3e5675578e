"""The MoE reference model: shared attention blocks, and a routed-expert FFN with expert
parallelism over an optional process group.

A token travels once to each destination rank (per expert group) that holds any of its experts,
as DeepEP's dispatch does, not once per expert: its row carries the local ids and router weights
of all its experts there in extra columns, the destination runs the row through each of them and
returns one row, their weighted sum, and the sender adds up its rows from every destination. With
fine-grained experts (top-8 of 64 over two ranks) that moves a quarter of the rows a row per
expert would.

With a ``capacity_factor``, and in any CUDA-graph capture, dispatch and combine are shape-static:
every buffer's shape depends only on the number of tokens, so there is no host sync and the path
is graph-capturable. Each rank sends a fixed ``capacity`` rows to every destination rank, and the
combine returns rows to the slots they were sent from, so the sender gathers them back without any
extra routing message. Without a capacity factor an eager step exchanges its row counts first (one
small all-to-all and a host sync) and sends only its real rows, where the static path would send
the worst case, ``tokens`` rows to every destination. Expert-parallel ranks must run the same
number of tokens per step (the data-parallel coordinator pads them to the maximum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ubatch import comm, islands, scheduler
from ubatch.context import in_static_collectives
from ubatch.models import expert_rows
from ubatch.models.config import ModelConfig
from ubatch.models.dense import Decoder
from ubatch.models.fusion import fused
from ubatch.models.gather_sum import gather_sum
from ubatch.models.layers import SwiGLUMLP, check_divisible, frozen, group_rank_world, init_weight
from ubatch.models.swiglu import swiglu

PADDED_ROWS_STEP = 64
PADDED_MAX_ROWS = 128
"""Up to this many rows per expert, a batched GEMM over every expert's rows padded to one
capacity reads the weights at ~3.8-4.0 TB/s on an H200, where the grouped GEMM reaches 2.6-3.0
(16-64 rows; scripts/bench_expert_gemm.py): at these sizes the GEMM is a weight read, and the
padding rows ride along for free. Capacities are rounded up to ``PADDED_ROWS_STEP``."""
PADDED_MAX_ROWS_PIPELINED = 256
"""The same limit where the experts run in groups (``expert_chunks`` > 1): one grouped GEMM per
group costs ~0.17 ms more per layer above 128 rows per expert, one batched GEMM per group only
0.02-0.04 ms (scripts/probe_flag_gemm.py, 128-256 rows on an H200), so the padding pays up to
256 rows there (the pipelined 256-token decode modes over 10 GB/s ran 8-20% faster:
benchmarks/h200/padded_groups_ab)."""


def _start_all_to_all(
    output: torch.Tensor, input: torch.Tensor, group: Any, splits: tuple[list[int], list[int]] | None = None
) -> comm.CollectiveHandle | None:
    """``comm.all_to_all_single`` over ``group``, started without waiting (None: done already),
    with ``splits`` (rows received from, rows sent to each rank) or equal ones. No group means one
    rank even inside a multi-rank job, where ``comm`` would read None as the whole world."""
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        output.copy_(input)
        return None
    received, sent = splits if splits is not None else (None, None)
    return comm.all_to_all_single(output, input, received, sent, group=group, async_op=True)


def _wait(handle: comm.CollectiveHandle | None) -> None:
    if handle is not None:
        handle.wait()


@dataclass
class _Dispatched:
    """One ubatch's rows in flight to the experts: receive and combine buffers, each expert
    group's rows in them (``recv_groups``, ``back_groups``), the group's dispatch, and, where the
    counts were exchanged, each group's (rows received per rank, rows sent per rank)."""

    num_tokens: int
    recv: torch.Tensor
    back: torch.Tensor
    recv_groups: list[slice]
    back_groups: list[slice]
    dispatches: list[comm.CollectiveHandle | None]
    splits: list[tuple[list[int], list[int]]] | None = None
    # Per expert group, this rank's rows to its own experts: where they sit in the send buffer
    # and within the group's received rows (the all-to-all hands them over unchanged).
    own_sent: list[slice] = field(default_factory=list)
    own_received: list[slice] = field(default_factory=list)
    # The dispatch's send buffer and the combines' inputs, held until the layer's combines are
    # waited: freed while a transfer still reads them, their blocks could go to new work on the
    # stream that made them (another ubatch's shared experts, the next expert group).
    send: torch.Tensor | None = None
    combine_inputs: list[torch.Tensor] = field(default_factory=list)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` runs here: CPU, or bf16 on a Hopper-or-newer GPU, with
    every row 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any(d * torch.finfo(dtype).bits // 8 % 16 for d in dims):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)


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
    no longer reads the expert weights once per ubatch (eager and FULL graphs).
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
        self.join_ubatches = False
        self.local_first = False
        self.expert_capacity_factor: float | None = None
        self.use_grouped_mm = grouped_mm_supported(device, config.dtype, hidden, inter)

    def capacity(self, num_tokens: int) -> int:
        """Rows each rank sends to each destination rank per expert group for ``num_tokens``
        tokens: the worst case (every token, one row each), or ``capacity_factor`` times what a
        uniform router sends there (``balanced_bucket_rows``), at most the worst case."""
        if self.capacity_factor is None:
            return num_tokens
        experts = self.num_local_experts * self.ep_world
        balanced = balanced_bucket_rows(num_tokens, experts, self.top_k, self.ep_world, self.expert_chunks)
        return max(1, min(num_tokens, math.ceil(self.capacity_factor * balanced)))

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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32 summing to 1, expert ids [T, k])."""
        return route_top_k(x, self.router, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, dispatch, run the experts, combine; with ``expert_chunks`` k > 1 the chain runs
        per group of local experts, so group g's GEMMs run while group g+1's rows are in flight
        and every expert's weights are still read once. The shared experts run under the
        dispatch (single-batch overlap): they need only ``x``. With ``join_ubatches`` the expert
        stage waits for every ubatch of the step and runs once over all their rows."""
        weights, ids = self.route(x)
        if self.capacity_factor is None and not _static_only():
            slot, dispatched = self._dispatch_counted(x, ids, weights)
        else:
            slot, dispatched = self._dispatch_static(x, ids, weights)

        shared = self.shared(x) if self.shared is not None else None

        if self.join_ubatches:
            if islands.recording_active():
                raise RuntimeError(
                    f"{self.name}: joined experts (join_ubatches=True) cannot be captured in a PIECEWISE graph, "
                    f"whose replay would run the join eagerly; use FULL graphs or run eagerly"
                )
            combines = scheduler.join_ubatches(f"{self.name}.experts", dispatched, self._expert_stage)
        else:
            combines = self._expert_stage([dispatched])[0]
        for handle in combines:
            _wait(handle)

        return combine_rows(dispatched.back, slot, shared)

    def _dispatch_static(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, _Dispatched]:
        """Each (group, destination) bucket sent at its full capacity (graph-capturable)."""
        num_tokens, hidden = x.shape
        k, world = self.expert_chunks, self.ep_world
        cap = self.capacity(num_tokens)
        group_rows = world * cap
        slot, dropped, send = dispatch_plan(x, ids, weights, self.num_local_experts, k, world, cap)
        if cap < num_tokens:
            self.overflow_count += dropped
        recv = torch.empty_like(send)
        groups = [slice(g * group_rows, (g + 1) * group_rows) for g in range(k)]
        dispatches = [_start_all_to_all(recv[rows], send[rows], self.ep_group) for rows in groups]
        back = x.new_empty(k * group_rows, hidden)
        own = [slice((g * world + self.ep_rank) * cap, (g * world + self.ep_rank + 1) * cap) for g in range(k)]
        within = [slice(self.ep_rank * cap, (self.ep_rank + 1) * cap)] * k
        return slot, _Dispatched(num_tokens, recv, back, groups, groups, dispatches, None, own, within, send)

    def _dispatch_counted(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, _Dispatched]:
        """Only the real rows: every rank's count per (group, destination) exchanged first (a
        host sync), then each group's all-to-all with those splits. Nothing is dropped."""
        num_tokens, hidden = x.shape
        k, world = self.expert_chunks, self.ep_world
        slot, counts, send = counted_dispatch_plan(x, ids, weights, self.num_local_experts, k, world)
        sent = counts.view(k, world)
        received = sent
        if world > 1:
            received = torch.empty_like(sent.t().contiguous())
            comm.all_to_all_single(received, sent.t().contiguous(), group=self.ep_group)
            received = received.t()
        sent_rows, received_rows = sent.tolist(), received.tolist()  # the splits, on the host
        splits = list(zip(received_rows, sent_rows))
        send_at, recv_at = _offsets(sent_rows), _offsets(received_rows)
        back_groups = [slice(send_at[g], send_at[g + 1]) for g in range(k)]
        recv_groups = [slice(recv_at[g], recv_at[g + 1]) for g in range(k)]
        recv = send.new_empty(recv_at[-1], send.shape[1])
        dispatches = [
            _start_all_to_all(recv[r], send[b], self.ep_group, split)
            for r, b, split in zip(recv_groups, back_groups, splits)
        ]
        back = x.new_empty(send.shape[0], hidden)
        r = self.ep_rank
        own = [slice(send_at[g] + sum(sent_rows[g][:r]), send_at[g] + sum(sent_rows[g][: r + 1])) for g in range(k)]
        within = [slice(sum(received_rows[g][:r]), sum(received_rows[g][: r + 1])) for g in range(k)]
        return slot, _Dispatched(
            num_tokens, recv, back, recv_groups, back_groups, dispatches, splits, own, within, send
        )

    def _expert_stage(self, parts: list[_Dispatched]) -> list[list[comm.CollectiveHandle | None]]:
        """Each expert group's GEMMs over the received rows of every part (one per ubatch when
        the ubatches' expert stages are joined, so the weights are read once for all of them),
        then that group's combine of every part; the combines' handles, per part. With
        ``local_first`` the rows a rank routed to its own experts go first, from the send buffer,
        while the group's dispatch is still in flight."""
        combines: list[list[comm.CollectiveHandle | None]] = [[] for _ in parts]
        num_tokens = sum(part.num_tokens for part in parts)
        for g in range(self.expert_chunks):
            outputs = self._local_first_group(parts, g, num_tokens) if self.local_first else None
            if outputs is None:
                for part in parts:
                    _wait(part.dispatches[g])
                outputs = self._run_rows([part.recv[part.recv_groups[g]] for part in parts], g, num_tokens)
            for part, out, handles in zip(parts, outputs, combines):
                part.combine_inputs.append(out)
                # the combine's splits are the dispatch's, reversed
                splits = None if part.splits is None else part.splits[g][::-1]
                handles.append(_start_all_to_all(part.back[part.back_groups[g]], out, self.ep_group, splits))
        return combines

    def _local_first_group(self, parts: list[_Dispatched], g: int, num_tokens: int) -> list[torch.Tensor] | None:
        """Group ``g``'s expert outputs per part, in received order: the own rows' GEMMs before
        the dispatch is waited, the other ranks' rows' after. None where one rank has no peers."""
        if self.ep_world == 1:
            return None
        own = self._run_rows([part.send[part.own_sent[g]] for part in parts], g, num_tokens)
        for part in parts:
            _wait(part.dispatches[g])
        received = [part.recv[part.recv_groups[g]] for part in parts]
        peers = [
            torch.cat([rows[: part.own_received[g].start], rows[part.own_received[g].stop :]])
            for part, rows in zip(parts, received)
        ]
        others = self._run_rows(peers, g, num_tokens)
        outputs = []
        for part, mine, theirs in zip(parts, own, others):
            cut = part.own_received[g].start
            outputs.append(torch.cat([theirs[:cut], mine, theirs[cut:]]))
        return outputs

    def _run_rows(self, rows: list[torch.Tensor], g: int, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """Expert group ``g`` over every part's dispatch rows in one call: each row through each
        of its experts, weighted and summed into one output row; the outputs split back per part."""
        joined = rows[0] if len(rows) == 1 else torch.cat(rows)
        x, ids, weights = split_dispatch_rows(joined, self.w2.shape[1], self.top_k)
        return self._experts(x, ids, weights, g, num_tokens).split([len(r) for r in rows])

    def _experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group: int, num_tokens: int
    ) -> torch.Tensor:
        """Each row's weighted sum over its local experts (SwiGLU) of group ``group``, for rows
        routed from ``num_tokens`` tokens per rank; ``ids`` [rows, top_k] holds each row's
        expert ids, negative where the row has no expert in that column (padding rows have none,
        and their outputs are never read)."""
        size = self.num_local_experts // self.expert_chunks
        experts = slice(group * size, (group + 1) * size)
        ids = ids - group * size
        w13, w2 = self.w13[experts], self.w2[experts]
        capacity = self.expert_capacity(num_tokens, ids.numel())
        if capacity is not None:
            out, position = self._experts_padded(x, ids.flatten(), w13, w2, capacity)
        elif self.use_grouped_mm:
            out, position = self._experts_grouped(x, ids, w13, w2)
        else:
            return self._experts_masked(x, ids, weights, w13, w2)
        return gather_sum(out, torch.where(ids >= 0, position.view_as(ids), -1), weights)

    def expert_capacity(self, num_tokens: int, num_rows: int) -> int | None:
        """Rows per local expert of the padded batched GEMM for ``num_rows`` received rows routed
        from ``num_tokens`` tokens per rank, or None where the grouped GEMM runs: without a
        ``capacity_factor`` (no row may be dropped) or above ``PADDED_MAX_ROWS`` rows per expert
        (``PADDED_MAX_ROWS_PIPELINED`` where the experts run in groups).
        ``expert_capacity_factor`` (None: ``capacity_factor``) times a balanced expert's rows,
        rounded up to ``PADDED_ROWS_STEP``; rows past it are dropped and counted like the
        dispatch's. (One expert's rows vary more than a dispatch bucket of many experts, so a
        measured factor for the experts is larger: ``ubatch.models.capacity``.)"""
        if self.capacity_factor is None:
            return None
        factor = self.capacity_factor if self.expert_capacity_factor is None else self.expert_capacity_factor
        balanced = num_tokens * self.top_k / self.num_local_experts  # every rank's tokens over all experts
        wanted = math.ceil(factor * balanced / PADDED_ROWS_STEP) * PADDED_ROWS_STEP
        capacity = min(num_rows, max(PADDED_ROWS_STEP, wanted))
        limit = PADDED_MAX_ROWS if self.expert_chunks == 1 else PADDED_MAX_ROWS_PIPELINED
        return capacity if capacity <= limit else None

    def _experts_padded(
        self, x: torch.Tensor, expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batched GEMM per projection over [experts, capacity] padded rows, for ``expert``
        [rows * top_k], each row's experts in turn: each (row, expert) pair's slot is its expert's
        block plus its rank among that expert's pairs (one Triton kernel on CUDA, ``expert_rows``,
        which reads each row where it lies; elsewhere a fast inner-dimension scan, as in the
        dispatch). Returns the [experts * capacity, hidden] outputs and each pair's slot among
        them (-1: dropped or padding)."""
        n = w13.shape[0]
        place = expert_rows.pad_expert_rows_kernel if expert_rows.kernel_takes(x, expert) else pad_expert_rows
        padded, slot, dropped = place(x, expert, n, capacity)
        self.overflow_count += dropped
        gate_up = torch.bmm(padded, w13.transpose(1, 2))
        act = swiglu(gate_up.view(n * capacity, -1)).view(n, capacity, -1)
        out = torch.bmm(act, w2.transpose(1, 2)).view(n * capacity, -1)
        return out, torch.where(slot < n * capacity, slot, -1)

    @staticmethod
    def _experts_grouped(
        x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (row, column) of ``ids`` [rows, top_k] through its expert, the rows gathered
        sorted by expert straight from ``x`` (never expanded first); returns the sorted outputs
        and where among them each (row, column), flattened, landed (columns without an expert
        land among rows that hold anything)."""
        rows, order, offsets = sort_by_expert(x, ids, w13.shape[0])
        gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
        # Rows past the last offset are padding: neither grouped GEMM reads them, nor does swiglu.
        hidden = swiglu(gate_up, offsets[-1:], zero_padding=False)
        sorted_out = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offsets)
        return sorted_out, torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))

    @staticmethod
    def _experts_masked(
        x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(w13.shape[0]):
            gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
            weight = torch.where(ids == e, weights, 0).sum(dim=1, keepdim=True)
            out += torch.where(weight != 0, F.linear(F.silu(gate) * up, w2[e]).float() * weight, 0)
        return out.to(x.dtype)


def route_top_k(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left unfused: a token's experts must not depend on how its batch was cut, and a compiled
    kernel's reduction order may change with the shapes it was specialised for, flipping a
    near-tie. The router stays in float32 for the same reason (bf16 logits flip them too)."""
    probs = F.linear(x.float(), router).softmax(dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def balanced_bucket_rows(num_tokens: int, num_experts: int, top_k: int, world: int, chunks: int) -> float:
    """Rows one (expert group, destination) bucket gets from ``num_tokens`` tokens routed
    uniformly: a token sends one if any of its ``top_k`` distinct experts is among the bucket's
    ``num_experts / (world * chunks)``. With fine-grained experts nearly every token does, and
    more expert groups (fewer experts a bucket) take more rows in all."""
    in_bucket = num_experts // (world * chunks)
    missed = math.comb(num_experts - in_bucket, top_k) / math.comb(num_experts, top_k)
    return num_tokens * (1 - missed)


def expert_buckets(ids: torch.Tensor, n_local: int, chunks: int, world: int) -> torch.Tensor:
    """The (expert group, destination rank) bucket of each assignment, group-major."""
    local = ids % n_local
    return local // (n_local // chunks) * world + ids // n_local


def _row_columns(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_local: int, bucket: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each assignment is the first of its token's to its bucket, the extra columns of
    each assignment's dispatch row [tokens * top_k + 1, extra]): the router weights of the
    token's experts in that bucket (float32 bits) and their local ids (-1 for the others). Only a
    first assignment's row travels; the others ride in it. The last row is a padding row's
    columns: ids -1."""
    num_tokens, top_k = ids.shape
    same = bucket[:, :, None] == bucket[:, None, :]  # [token, assignment, other assignment]
    first = ~same.tril(-1).any(dim=2)
    weight_cols = torch.where(same, weights[:, None, :], 0.0).reshape(num_tokens * top_k, top_k)
    id_cols = torch.where(same, (ids % n_local)[:, None, :], -1).reshape(num_tokens * top_k, top_k)
    hidden, weight_end = x.shape[1], _weight_columns(top_k, x.dtype)
    columns = x.new_zeros(num_tokens * top_k + 1, dispatch_row_width(hidden, top_k, x.dtype) - hidden)
    columns[:-1, :weight_end] = weight_cols.contiguous().view(x.dtype)
    columns[:-1, weight_end : weight_end + top_k] = id_cols.to(x.dtype)
    columns[-1, weight_end : weight_end + top_k] = -1
    return first, columns


def _bucket_rows(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_local: int, chunks: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both dispatch plans start from, per assignment [tokens, top_k]: its bucket, whether it
    is its token's first to that bucket, its row's extra columns (``_row_columns``); the rows per
    bucket; and its row's position in its bucket. The count runs along one contiguous row per
    bucket, a fast inner-dimension scan (an outer-dimension one is ~19x slower on an H200:
    benchmarks/h200x2/explore/moe_dispatch_scan.log)."""
    bucket = expert_buckets(ids, n_local, chunks, world)
    first, columns = _row_columns(x, ids, weights, n_local, bucket)
    in_bucket = (bucket[None] == torch.arange(chunks * world, device=x.device)[:, None, None]).any(dim=2)
    pos = (in_bucket.cumsum(1) - 1).t().gather(1, bucket)
    return bucket, first, columns, in_bucket.sum(1), pos


def _gather_send(x: torch.Tensor, columns: torch.Tensor, slot: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The send buffer [num_rows, row width]: each slot's row gathered from the assignment whose
    ``slot`` it is (tokens' hidden states and the assignments' columns), padding rows where no
    assignment has it (their ids -1, their hidden state any token's). Built by gathering into the
    send buffer's rows, so a token's further assignments to a bucket cost nothing."""
    num_tokens, top_k = slot.shape
    padding = num_tokens * top_k  # the padding row of ``columns``
    targets = torch.where(slot >= 0, slot, num_rows).flatten()
    assignment = torch.full((num_rows + 1,), padding, dtype=torch.int64, device=x.device)
    assignment = assignment.scatter_(0, targets, torch.arange(padding, device=x.device))[:num_rows]
    if num_tokens == 0:
        return torch.cat([x.new_zeros(num_rows, x.shape[1]), columns[assignment]], dim=1)
    token = (assignment // top_k).clamp(max=num_tokens - 1)
    return torch.cat([x[token], columns[assignment]], dim=1)


def _weight_columns(top_k: int, dtype: torch.dtype) -> int:
    """Columns of ``dtype`` that hold ``top_k`` float32 router weights, bit for bit."""
    return top_k * 32 // torch.finfo(dtype).bits


def dispatch_row_width(hidden: int, top_k: int, dtype: torch.dtype) -> int:
    """Columns of a dispatch row: the hidden state, the weights, the ids, rounded up so that a row
    is a multiple of 16 bytes (NCCL is far slower on misaligned per-peer chunks)."""
    per_16_bytes = 128 // torch.finfo(dtype).bits
    width = hidden + _weight_columns(top_k, dtype) + top_k
    return -(-width // per_16_bytes) * per_16_bytes


def split_dispatch_rows(rows: torch.Tensor, hidden: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states, expert ids [rows, top_k] (int64, -1 where none), float32 weights) of
    dispatch rows."""
    columns = _weight_columns(top_k, rows.dtype)
    weights = rows[:, hidden : hidden + columns].contiguous().view(torch.float32)
    ids = rows[:, hidden + columns : hidden + columns + top_k].long()
    return rows[:, :hidden], ids, weights


@fused
def dispatch_plan(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_local: int, chunks: int, world: int, cap: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each (token, expert) assignment's slot in the send buffer [tokens, top_k], -1 for all but
    a token's first assignment to a bucket and for rows past capacity; assignments dropped; the
    send buffer [chunks * world * cap, row width] with every kept row in its slot).

    A token sends one row per bucket its experts fall in (``_row_columns``), and its output comes
    back in that row, summed over those experts. Slots are group-major, then destination, in
    token order within a (group, destination) bucket. The bucket ids are made per call, not kept:
    a captured graph keeps its own, whatever expert_chunks is set to later.
    """
    bucket, first, columns, _, pos = _bucket_rows(x, ids, weights, n_local, chunks, world)
    kept = pos < cap
    slot = torch.where(kept & first, bucket * cap + pos, -1)
    return slot, (~kept).sum(), _gather_send(x, columns, slot, chunks * world * cap)


@fused
def sort_by_expert(
    x: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(for every (row, column) of ``ids`` [rows, top_k], the row of ``x`` [rows, hidden], sorted
    by expert with the columns that have none (ids < 0) last; the order that sorts them, among
    rows * top_k; each expert's end offset among them as int32): what the grouped GEMM takes."""
    key = torch.where(ids < 0, num_experts, ids).flatten()
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    return x[order // ids.shape[1]], order, counts[:num_experts].cumsum(0).to(torch.int32)


def counted_dispatch_plan(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_local: int, chunks: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each assignment's slot, -1 for all but a token's first to a bucket; rows per (group,
    destination) bucket [chunks * world]; the send buffer [tokens * min(top_k, buckets), row
    width]) with the buckets packed one after another in group-major, destination order from the
    first row: ``dispatch_plan``'s layout without capacity."""
    num_tokens, top_k = ids.shape
    bucket, first, columns, counts, pos = _bucket_rows(x, ids, weights, n_local, chunks, world)
    slot = torch.where(first, (counts.cumsum(0) - counts)[bucket] + pos, -1)
    return slot, counts, _gather_send(x, columns, slot, num_tokens * min(top_k, chunks * world))


def _offsets(rows: list[list[int]]) -> list[int]:
    """Where each group's rows start (and, last, where they end) in a packed buffer, from the
    rows per (group, rank)."""
    starts = [0]
    for group in rows:
        starts.append(starts[-1] + sum(group))
    return starts


def _static_only() -> bool:
    """Whether the dispatch must be shape-static: a CUDA graph (FULL or PIECEWISE) is being
    recorded or warmed up for (no host sync, fixed shapes), or the step must issue the collectives
    a replay would (``static_collectives``: peers may be replaying it)."""
    return (
        in_static_collectives()
        or islands.recording_active()
        or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    )


def combine_rows(back: torch.Tensor, slot: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's rows gathered back from their slots (each already its experts' weighted sum
    at one destination; -1: none) and summed in float32, with the shared experts' output."""
    return gather_sum(back, slot, add=shared)


@fused
def pad_expert_rows(
    x: torch.Tensor, expert: torch.Tensor, num_experts: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows in [experts, capacity, hidden] blocks, each (row, expert) pair's slot there or the
    trash slot past them, pairs dropped) for ``expert`` [rows * k], the experts of each row of
    ``x`` in turn: a pair's slot is its expert's block plus its rank among that expert's pairs
    (the dispatch's inner-dimension scan). Padding (expert < 0) goes to the trash slot."""
    if len(x) and len(expert) != len(x):
        x = x.repeat_interleave(len(expert) // len(x), dim=0)
    trash = num_experts * capacity
    ids = torch.arange(num_experts, device=x.device)[:, None]
    rank = (expert == ids).cumsum(1).gather(0, expert.clamp(min=0)[None])[0] - 1
    kept = (expert >= 0) & (rank < capacity)
    slot = torch.where(kept, expert * capacity + rank, trash)
    padded = x.new_empty(trash + 1, x.shape[1]).index_copy_(0, slot, x)[:trash]
    return padded.view(num_experts, capacity, x.shape[1]), slot, ((expert >= 0) & ~kept).sum()


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
