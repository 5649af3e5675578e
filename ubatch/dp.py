"""Data-parallel step coordination: every rank takes the same ubatch / graph / padding decision.

In a data-parallel + expert-parallel deployment each rank schedules its own requests, but the
expert all-to-alls (and, per ubatch, every collective) must match across ranks. So each step every
rank, idle ones included, votes once, over a CPU (gloo) group so the vote never waits on the
device, and all ranks apply the same rules to the gathered votes.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ubatch.context import CUDAGraphMode, DPMetadata
from ubatch.slicing import split_batch

logger = logging.getLogger(__name__)

__all__ = ["DPBatchDecision", "DPMetadata", "coordinate_batch_across_dp", "dp_cpu_group", "local_batch_decision"]

# (id of the default group, member ranks, timeout) -> weak references to (that default group, the
# gloo group). new_group is collective, so each group is created once and reused every step;
# torch.distributed itself keeps it until destroy_process_group. Weak, so the cache never keeps a
# process group past that: one left for interpreter exit can make gloo's teardown abort.
_cpu_groups: dict[tuple[int, tuple[int, ...], float | None], tuple[weakref.ref, weakref.ref]] = {}
_VOTE_LEN = 5  # fields in _Vote.as_list()


@dataclass(frozen=True)
class DPBatchDecision:
    """What every data-parallel rank does this step (identical on all ranks).

    ``num_tokens_across_dp[r]`` is the token count rank r runs, padding included: the maximum
    padded count on every rank when ubatching or graphing, else each rank's own padded count.
    """

    should_ubatch: bool
    num_tokens_across_dp: list[int]
    cudagraph_mode: CUDAGraphMode


@dataclass(frozen=True)
class _Vote:
    """One rank's input to the step decision; ``as_list`` is what travels in the collective."""

    num_tokens_unpadded: int
    num_tokens_padded: int
    wants_ubatch: bool
    cudagraph_mode: CUDAGraphMode
    num_ubatches: int

    def as_list(self) -> list[int]:
        return [
            self.num_tokens_unpadded,
            self.num_tokens_padded,
            int(self.wants_ubatch),
            int(self.cudagraph_mode),
            self.num_ubatches,
        ]

    @classmethod
    def from_list(cls, values: list[int]) -> _Vote:
        unpadded, padded, wants, mode, n = values
        return cls(unpadded, padded, bool(wants), CUDAGraphMode(mode), n)


def _validate(
    num_tokens_unpadded: Any, num_tokens_padded: Any, wants_ubatch: Any, cudagraph_mode: Any, num_ubatches: Any
) -> _Vote:
    for name, value, minimum in (
        ("num_tokens_unpadded", num_tokens_unpadded, 0),
        ("num_tokens_padded", num_tokens_padded, 0),
        ("num_ubatches", num_ubatches, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if num_tokens_padded < num_tokens_unpadded:
        raise ValueError(
            f"num_tokens_padded ({num_tokens_padded}) is less than num_tokens_unpadded ({num_tokens_unpadded})"
        )
    if not isinstance(wants_ubatch, bool):
        raise ValueError(f"wants_ubatch must be a bool, got {wants_ubatch!r}")
    try:
        mode = CUDAGraphMode(cudagraph_mode)
    except ValueError:
        raise ValueError(
            f"cudagraph_mode must be a CUDAGraphMode ({[m.name for m in CUDAGraphMode]}), got {cudagraph_mode!r}"
        ) from None
    return _Vote(num_tokens_unpadded, num_tokens_padded, wants_ubatch, mode, num_ubatches)


def _has_real_token_in_every_ubatch(num_real: int, total: int, num_ubatches: int) -> bool:
    """Whether ``split_batch`` can split ``num_real`` tokens padded to ``total`` (its own rule)."""
    try:
        split_batch([num_real], num_ubatches, total)
    except ValueError:
        return False
    return True


def _decide(votes: list[_Vote]) -> DPBatchDecision:
    """The rules, applied alike on every rank to the gathered votes."""
    counts = {v.num_ubatches for v in votes}
    if len(counts) > 1:
        raise ValueError(f"data-parallel ranks disagree on num_ubatches: {[v.num_ubatches for v in votes]}")
    num_ubatches = counts.pop()
    max_padded = max(v.num_tokens_padded for v in votes)
    should_ubatch = num_ubatches >= 2 and all(
        v.wants_ubatch and _has_real_token_in_every_ubatch(v.num_tokens_unpadded, max_padded, num_ubatches)
        for v in votes
    )
    mode = min(v.cudagraph_mode for v in votes)
    if should_ubatch or mode != CUDAGraphMode.NONE:
        across = [max_padded] * len(votes)
    else:
        across = [v.num_tokens_padded for v in votes]
    return DPBatchDecision(should_ubatch, across, mode)


def local_batch_decision(
    num_tokens_unpadded: int,
    num_tokens_padded: int,
    *,
    wants_ubatch: bool,
    cudagraph_mode: CUDAGraphMode | int,
    num_ubatches: int = 2,
) -> DPBatchDecision:
    """The decision of a single rank, with no collective (what one rank would agree with itself)."""
    vote = _validate(num_tokens_unpadded, num_tokens_padded, wants_ubatch, cudagraph_mode, num_ubatches)
    return _decide([vote])


def dp_cpu_group(group: Any = None, *, timeout_s: float | None = None) -> Any:
    """A gloo group over ``group``'s ranks (default: the whole world), cached while in use.

    ``group`` itself when it is already gloo and no timeout is asked for. A new group is created
    only by its members (``use_local_synchronization``), so a DP group that is a subgroup works.
    The cache holds it weakly: it lives until ``destroy_process_group`` (torch keeps it) or its
    last user lets go, whichever is later. None when there is no process group.
    """
    if not dist.is_initialized():
        return None
    if group is None:
        group = dist.group.WORLD
    if timeout_s is None and dist.get_backend(group) == "gloo":
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    # An entry belongs to the default group it was made under (a new init may reuse the id).
    key = (id(dist.group.WORLD), ranks, timeout_s)
    world_ref, group_ref = _cpu_groups.get(key, (lambda: None, lambda: None))
    cpu_group = group_ref() if world_ref() is dist.group.WORLD else None
    if cpu_group is None:
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        cpu_group = dist.new_group(list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)
        _cpu_groups[key] = (weakref.ref(dist.group.WORLD), weakref.ref(cpu_group))
        logger.debug("created a gloo group over ranks %s for DP coordination", ranks)
    return cpu_group


def _gather_votes(vote: _Vote, group: Any) -> list[_Vote]:
    """All ranks' votes: one all-gather of a few int64s on the CPU group."""
    world = dist.get_world_size(group)
    out = [torch.empty(_VOTE_LEN, dtype=torch.int64) for _ in range(world)]
    try:
        dist.all_gather(out, torch.tensor(vote.as_list(), dtype=torch.int64), group=group)
    except RuntimeError as exc:
        raise RuntimeError(
            f"data-parallel step vote failed on rank {dist.get_rank(group)} of {world}: a peer rank "
            f"failed, exited, timed out or stopped calling coordinate_batch_across_dp every step: {exc}"
        ) from exc
    return [_Vote.from_list(row.tolist()) for row in out]


def coordinate_batch_across_dp(
    num_tokens_unpadded: int,
    num_tokens_padded: int,
    *,
    wants_ubatch: bool,
    cudagraph_mode: CUDAGraphMode | int,
    num_ubatches: int = 2,
    group: Any = None,
) -> DPBatchDecision:
    """Agree with every data-parallel rank on this step's ubatching, graph mode and padding.

    Call it every step on every rank of ``group`` (idle ranks with 0 tokens too). Rules: all
    ranks ubatch or none (none if any rank refuses, or would get a ubatch of padding only once
    padded to the maximum); the graph mode is the minimum over ranks; when ubatching or graphing
    every rank runs the maximum padded count. ``group`` is the DP group (default: the world); the
    vote runs on a gloo group over its ranks (see ``dp_cpu_group``). One rank, or no process
    group: decided locally.
    """
    vote = _validate(num_tokens_unpadded, num_tokens_padded, wants_ubatch, cudagraph_mode, num_ubatches)
    cpu_group = dp_cpu_group(group)
    if cpu_group is None or dist.get_world_size(cpu_group) == 1:
        return _decide([vote])
    return _decide(_gather_votes(vote, cpu_group))
