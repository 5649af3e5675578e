"""The overlap mode a ModelRunner serves with (``ubatch.overlap``), resolved and checked once at
start-up: its ubatch count, the MoE layers' expert groups and joining, whether unsplit steps
still run as a ubatch (single-batch overlap), and its SM partition.

Every data-parallel rank must serve with the same mode: expert groups change how many
collectives a MoE layer issues, so ranks in different modes would wait on each other forever.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ubatch.overlap import OverlapMode
from ubatch.sm import SMPartition


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
        raise TypeError(f"overlap_mode must be an OverlapMode, its name or None, got {type(overlap_mode).__name__}")
    if num_ubatches not in (1, mode.num_ubatches):
        raise ValueError(
            f"num_ubatches={num_ubatches} disagrees with overlap_mode={mode.name} "
            f"({mode.num_ubatches} ubatches); give the mode alone"
        )
    return mode


def mode_partition(mode: OverlapMode, device: torch.device) -> SMPartition | None:
    """The green SM partition a mode's ``@greenK`` asks for (None without one)."""
    return None if mode.comm_sms is None else SMPartition("green", mode.comm_sms, device)


def check_same_mode_across_dp(mode: OverlapMode, group: Any) -> None:
    """ValueError on every rank of ``group`` if the ranks were given different modes."""
    names: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, mode.name, group=group)
    if len(set(names)) > 1:
        raise ValueError(
            f"every data-parallel rank must serve with the same overlap_mode (its collectives differ), "
            f"got {', '.join(f'rank {r}: {name}' for r, name in enumerate(names))}"
        )
