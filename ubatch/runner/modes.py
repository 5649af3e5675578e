"""The overlap modes a ModelRunner serves with (``ubatch.overlap``): one for every step, or a
``ModePolicy`` choosing per step among the modes it was calibrated on. Each mode brings its
ubatch count, the MoE layers' expert groups and joining, whether unsplit steps still run as a
ubatch (single-batch overlap), its SM partition, the runnable that serves it and its graphs.

Every data-parallel rank must serve with the same modes and pick the same one each step:
expert groups change how many collectives a MoE layer issues, so ranks in different modes would
wait on each other forever. A policy's pick is made from the largest token count over the ranks,
so every rank picks alike; the modes (and a policy's timings) are checked equal at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ubatch.overlap import OverlapMode, apply_mode
from ubatch.policy import ModePolicy
from ubatch.sm import SMPartition
from ubatch.wrapper import UBatchWrapper


@dataclass
class ServingMode:
    """One mode the runner can serve a step in: the mode, what runs it eagerly (the model, or a
    UBatchWrapper with the mode's ubatch count and SM partition), whether its unsplit steps run
    as one ubatch, its partition, and its graphs (None without ``cudagraph_capture_sizes``)."""

    mode: OverlapMode
    runnable: Any
    single_batch: bool
    sm_partition: SMPartition | None
    graphs: Any = None


def resolve_modes(
    overlap_mode: OverlapMode | str | ModePolicy | None, num_ubatches: int
) -> tuple[list[OverlapMode], ModePolicy | None]:
    """The modes to serve and the policy choosing among them (None: the one mode, every step).
    ``overlap_mode`` is a mode, its name, a ``ModePolicy`` over mode names, or None (the plain
    ``num_ubatches``-way split); ValueError where ``num_ubatches`` disagrees."""
    if isinstance(overlap_mode, ModePolicy):
        if num_ubatches != 1:
            raise ValueError(
                f"num_ubatches={num_ubatches} with a mode policy: each of its modes sets its own; give the policy alone"
            )
        return [OverlapMode.parse(name) for name in overlap_mode.timings_ms], overlap_mode
    return [resolve_mode(overlap_mode, num_ubatches)], None


def resolve_mode(overlap_mode: OverlapMode | str | None, num_ubatches: int) -> OverlapMode:
    """The mode ``overlap_mode`` names (an ``OverlapMode`` or its name), or, without one, the
    plain ``num_ubatches``-way split; ValueError if both are given and disagree."""
    if overlap_mode is None:
        return OverlapMode(num_ubatches=num_ubatches)
    if isinstance(overlap_mode, str):
        mode = OverlapMode.parse(overlap_mode)
    elif isinstance(overlap_mode, OverlapMode):
        mode = overlap_mode
    else:
        raise TypeError(
            f"overlap_mode must be an OverlapMode, its name, a ModePolicy or None, got {type(overlap_mode).__name__}"
        )
    if num_ubatches not in (1, mode.num_ubatches):
        raise ValueError(
            f"num_ubatches={num_ubatches} disagrees with overlap_mode={mode.name} "
            f"({mode.num_ubatches} ubatches); give the mode alone"
        )
    return mode


def serving_mode(model: Any, mode: OverlapMode, device: torch.device, timeout_s: float) -> ServingMode:
    """What serving ``model`` in ``mode`` needs (the mode is applied to the model to check it
    fits, e.g. MoE-only modes on a dense model raise here)."""
    apply_mode(model, mode)
    partition = None if mode.comm_sms is None else SMPartition("green", mode.comm_sms, device)
    runnable = (
        UBatchWrapper(model, num_ubatches=mode.num_ubatches, device=device, timeout_s=timeout_s, sm_partition=partition)
        if mode.runs_as_ubatches
        else model
    )
    # single-batch overlap and expert pipelining run every step as one ubatch; a split whose
    # step is not split (too small, or a DP rank declined) runs it plain
    single_batch = mode.runs_as_ubatches and mode.num_ubatches == 1
    return ServingMode(mode, runnable, single_batch, partition)


def most_tokens_across_dp(num_tokens: int, group: Any) -> int:
    """The largest of every DP rank's ``num_tokens`` (one small all-reduce on the gloo vote
    group), what a mode policy picks from so that every rank picks alike."""
    if group is None:
        return num_tokens
    most = torch.tensor([num_tokens], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return int(most)


def check_same_modes_across_dp(modes: list[OverlapMode], policy: ModePolicy | None, group: Any) -> None:
    """ValueError on every rank of ``group`` if the ranks were given different modes (or mode
    policies that could pick differently)."""
    mine = [m.name for m in modes] if policy is None else {"policy": policy.timings_ms, "min_gain": policy.min_gain}
    given: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(given, mine, group=group)
    if any(g != given[0] for g in given):
        raise ValueError(
            f"every data-parallel rank must serve with the same overlap_mode (its collectives differ), "
            f"got {', '.join(f'rank {r}: {_describe(g)}' for r, g in enumerate(given))}"
        )


def _describe(given: Any) -> str:
    return ",".join(given) if isinstance(given, list) else f"a mode policy over {','.join(given['policy'])}"
