"""MoE capacity factors measured from routing: how full the router filled the fullest block
and the fullest expert on the runs it saw, times a margin.

Why: a capacity factor bounds the rows each rank sends each peer (and, under a padded expert
GEMM, the rows per expert), so it sets the all-to-all's payload: at 2.0 every dispatch moves
twice the rows a balanced router would send. A factor from measurement moves little more than
the real rows, and the runs that measured it show how much margin is left (``dropped_fraction``
in the bench: 0 where it held).

A call's fill is two ratios, each a count over its balanced share, and each sets its own factor:

- per (chunk, destination rank) block, of the dispatch (a chunk per expert group, by the earliest
  group of a token's experts there) and of the combine (by the latest): the rows this rank would
  send there (one per token with any expert there), over what a uniform router would send
  (``dispatch.balanced_chunk_rows``, what ``MoEFFN.capacity`` scales);
- per expert: this rank's rows for it, over ``tokens * top_k / num_experts``. A receiver's rows
  for an expert are the sum over senders, so if every sender stays within ratio r of its share,
  the receiver stays within r of its own (what ``MoEFFN.expert_capacity`` bounds).

Both are local to a rank: no collective runs while measuring, inside ubatches or not; the result
is the maximum over ranks.

Block fills are kept per call shape (expert-group count K and tokens per call) and per dispatch
chunk, and each chunk of each shape gets its own factor:

- with top-8 of 64 experts a late group's chunk holds few rows whose count varies a lot against
  its share, and one factor for every chunk and every K let those few rows set the capacity of
  the unsplit step's single chunk too (deepseek-bench in run 11: 2.1 for every mode);
- a split's ubatches route fewer tokens each, so their blocks fill more unevenly, and one factor
  for every call size made the unsplit step send the split's padding (moe-bench prefill at 4096
  tokens over the stand-in, run 17: with `split3` and `split4` measured beside it, the unsplit
  step's transfers took 1.22x as long as in a run that measured it alone, at one link setting).

Chunk c's factor covers its dispatch blocks and the combine chunk of the same size (K - 1 - c:
the combine's chunks take the dispatch sizes in reverse order). A call of a shape that was not
measured takes the largest factor of its K (of any K for one group).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ubatch.models.dispatch import balanced_chunk_rows, row_blocks

DEFAULT_MARGIN = 1.15
"""The measured fill is multiplied by this before rounding up: a step of other tokens routes
differently, and a split's ubatches (fewer tokens each) fill their blocks more unevenly."""

ROUNDING = 0.05  # capacity factors are rounded up to a multiple of this


def routing_fill(ids: torch.Tensor, num_experts: int, world: int, chunks: int) -> torch.Tensor:
    """([chunks + 1] float64 on ``ids``' device, no host sync; float64 so that a factor rounded up
    from it never falls below it) for expert ids ``[tokens, top_k]`` routed on one rank: per
    dispatch chunk c, the fullest of its blocks and of combine chunk ``chunks - 1 - c``'s (each
    rows over its balanced share), then the fullest expert's fill."""
    tokens, top_k = ids.shape
    _, first, last = row_blocks(ids, num_experts // world, chunks, world)  # blocks; none past them
    blocks = chunks * world
    shares = torch.tensor(balanced_chunk_rows(tokens, num_experts, top_k, world, chunks), dtype=torch.float64)
    per_chunk = []
    for block, share in ((first, shares), (last, shares.flip(0))):
        rows = torch.bincount(block.flatten(), minlength=2 * blocks + 1)[:blocks].double()
        balanced = share.repeat_interleave(world).to(ids.device)
        per_chunk.append(torch.where(balanced > 0, rows / balanced, 0.0).view(chunks, world).amax(dim=1))
    dispatch, combine = per_chunk
    per_expert = torch.bincount(ids.flatten(), minlength=num_experts)
    expert = per_expert.max().double() / (tokens * top_k / num_experts)
    return torch.cat([torch.maximum(dispatch, combine.flip(0)), expert[None]])


Shape = tuple[int, int]
"""A MoE layer call's (expert-group count, tokens): what its dispatch blocks are sized by."""


@dataclass(frozen=True)
class MeasuredCapacity:
    """Capacity factors from measured fills, each its fill times the margin, rounded up:
    ``shape_dispatch`` per dispatch chunk for each call shape (K, tokens) that ran
    (``MoEFFN.shape_capacity_factors``); for calls of other shapes, ``dispatch`` (the largest
    one-group factor, ``MoEFFN.capacity_factor``) and ``chunk_dispatch`` per chunk for each
    expert-group count K > 1 (the largest over its sizes, ``MoEFFN.chunk_capacity_factors``);
    ``expert`` for the rows of one expert in the padded expert GEMM
    (``MoEFFN.expert_capacity_factor``; one expert's rows vary more than a block of many experts),
    the largest over every call. Where no one-group call ran, ``dispatch`` covers every chunk seen."""

    dispatch: float
    expert: float
    dispatch_fill: float
    expert_fill: float
    margin: float
    chunk_dispatch: dict[int, tuple[float, ...]] = field(default_factory=dict)
    chunk_dispatch_fill: dict[int, tuple[float, ...]] = field(default_factory=dict)
    shape_dispatch: dict[Shape, tuple[float, ...]] = field(default_factory=dict)
    shape_dispatch_fill: dict[Shape, tuple[float, ...]] = field(default_factory=dict)

    def apply(self, model: Any) -> None:
        """Set every MoE layer of ``model`` to these factors."""
        for layer in model.moe_layers.values():
            layer.capacity_factor = self.dispatch
            layer.expert_capacity_factor = self.expert
            layer.chunk_capacity_factors = dict(self.chunk_dispatch)
            layer.shape_capacity_factors = dict(self.shape_dispatch)

    def report(self) -> dict[str, Any]:
        """The factors and fills for a JSON report (chunk counts as string keys), rounded."""

        def rounded(values: tuple[float, ...]) -> list[float]:
            return [round(v, 4) for v in values]

        return {
            "dispatch": round(self.dispatch, 4),
            "expert": round(self.expert, 4),
            "dispatch_fill": round(self.dispatch_fill, 4),
            "expert_fill": round(self.expert_fill, 4),
            "margin": round(self.margin, 4),
            "chunk_dispatch": {str(k): rounded(v) for k, v in self.chunk_dispatch.items()},
            "chunk_dispatch_fill": {str(k): rounded(v) for k, v in self.chunk_dispatch_fill.items()},
            "shape_dispatch": {shape_key(s): rounded(v) for s, v in sorted(self.shape_dispatch.items())},
            "shape_dispatch_fill": {shape_key(s): rounded(v) for s, v in sorted(self.shape_dispatch_fill.items())},
        }


def shape_key(shape: Shape) -> str:
    """A call shape as a report's key: "K:tokens" (expert groups, tokens per call)."""
    return f"{shape[0]}:{shape[1]}"


class RoutingFill:
    """While open, records the routing fill of every call of every MoE layer of ``model`` (a
    forward pre-hook per layer that routes the layer's input again; measurement only), per call
    shape (expert-group count, tokens)."""

    def __init__(self, model: Any) -> None:
        self.layers = list(getattr(model, "moe_layers", {}).values())
        if not self.layers:
            raise ValueError("RoutingFill needs a MoE model (one with moe_layers); this one has none")
        self._fills: dict[Shape, list[torch.Tensor]] = {}
        self._hooks: list[Any] = []

    def __enter__(self) -> RoutingFill:
        for layer in self.layers:
            self._hooks.append(layer.register_forward_pre_hook(self._record))
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _record(self, layer: Any, args: tuple[Any, ...]) -> None:
        x = args[0]
        if x.shape[0] == 0:
            return
        _, ids = layer.route(x)
        num_experts = layer.num_local_experts * layer.ep_world
        chunks = layer.expert_chunks  # token chunks cut the whole call's blocks: its shape
        shape = (chunks, x.shape[0])
        self._fills.setdefault(shape, []).append(routing_fill(ids, num_experts, layer.ep_world, chunks))

    def fills(self, group: Any = None) -> tuple[dict[Shape, tuple[float, ...]], float]:
        """(per call shape (expert-group count, tokens), the fullest block fill per dispatch
        chunk; the fullest expert's fill): the largest recorded, over every rank of ``group`` when
        distributed (every rank calls this alike); RuntimeError if no MoE layer ran, or if the
        ranks ran calls of different shapes."""
        if not self._fills:
            raise RuntimeError("RoutingFill recorded no MoE layer call: run the model inside the with block")
        shapes = sorted(self._fills)
        fill = torch.cat([torch.stack(self._fills[s]).amax(dim=0).to(torch.float64) for s in shapes])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            every = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, shapes, group=group)  # fills of other lengths would hang the max
            if any(other != shapes for other in every):
                raise RuntimeError(
                    f"ranks measured calls of different shapes (expert groups, tokens): {every}; "
                    "run the same modes on the same tokens per rank on each"
                )
            dist.all_reduce(fill, op=dist.ReduceOp.MAX, group=group)
        values = fill.tolist()
        shape_fills: dict[Shape, tuple[float, ...]] = {}
        expert = 0.0
        for shape in shapes:
            k = shape[0]
            shape_fills[shape], expert = tuple(values[:k]), max(expert, values[k])
            values = values[k + 1 :]
        return shape_fills, expert


def _factor(fill: float, margin: float) -> float:
    """``fill`` times ``margin``, rounded up; a fill below the balanced share counts as the share
    (a small chunk may have held no rows at all while measuring)."""
    value = max(fill, 1.0) * margin
    return round(math.ceil(round(value / ROUNDING, 6)) * ROUNDING, 6)


def measure_capacity(
    model: Any, runs: Iterable[Callable[[], Any]], *, margin: float = DEFAULT_MARGIN, group: Any = None
) -> MeasuredCapacity:
    """Each run called once with every MoE layer at worst-case capacity (nothing dropped while
    measuring; the layers' factors are restored after), and the factors its fills ask for."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 1:
        raise ValueError(f"margin must be a number >= 1, got {margin!r}")
    recorder = RoutingFill(model)
    names = ("capacity_factor", "expert_capacity_factor", "chunk_capacity_factors", "shape_capacity_factors")
    saved = [{name: getattr(layer, name) for name in names} for layer in recorder.layers]
    try:
        for layer in recorder.layers:
            layer.capacity_factor = layer.expert_capacity_factor = None
            layer.chunk_capacity_factors, layer.shape_capacity_factors = {}, {}
        with recorder, torch.inference_mode():
            for run in runs:
                run()
    finally:
        for layer, factors in zip(recorder.layers, saved):
            for name, value in factors.items():
                setattr(layer, name, value)
    shape_fills, expert_fill = recorder.fills(group)
    chunk_fills: dict[int, tuple[float, ...]] = {}  # per K, the largest over its sizes
    for (k, _), fills in shape_fills.items():
        chunk_fills[k] = tuple(map(max, zip(chunk_fills.get(k, fills), fills)))
    one_group = chunk_fills.get(1) or (max(max(fills) for fills in chunk_fills.values()),)
    grouped = {k: fills for k, fills in chunk_fills.items() if k > 1}

    def factors(fills: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(_factor(f, margin) for f in fills)

    return MeasuredCapacity(
        dispatch=_factor(one_group[0], margin),
        expert=_factor(expert_fill, margin),
        dispatch_fill=one_group[0],
        expert_fill=expert_fill,
        margin=margin,
        chunk_dispatch={k: factors(fills) for k, fills in grouped.items()},
        chunk_dispatch_fill=grouped,
        shape_dispatch={shape: factors(fills) for shape, fills in shape_fills.items()},
        shape_dispatch_fill=shape_fills,
    )
