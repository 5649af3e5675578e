"""Collectives that overlap with other ubatches' compute.

Each function has torch.distributed's signature (plus ``timeout``). Outside a ubatch it is the
plain torch.distributed call. Inside one, it launches on the scheduler's comm stream after the
compute that produced its input, yields to the next ubatch while the transfer is in flight, and
makes the compute stream wait for the result before returning. With no process group (or a
group of one rank) the collective is a local copy, so the reference models run in one process.

Outputs are passed in by the caller, who allocates them on the compute stream that consumes
them, and the input is held until the compute stream has waited for the transfer: the comm
stream never owns a block that the compute stream could reuse too early (the cross-stream
allocator hazard, docs/design.md#invariants).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ubatch import scheduler
from ubatch.islands import run_island
from ubatch.link import is_link

ReduceOp = dist.ReduceOp


def _world_size(group: Any) -> int:
    if is_link(group):
        return group.size()
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


issuing: contextvars.ContextVar[bool] = contextvars.ContextVar("ubatch_comm_issuing", default=False)
"""True while this module calls torch.distributed: ``ubatch.intercept`` leaves such calls alone."""


def _call(op_name: str, group: Any, *args: Any, async_op: bool, producer: Any = None, **kwargs: Any) -> Any:
    """torch.distributed's ``op_name`` over ``group``, or the link stand-in's method of that name.

    ``producer``: the stream that made the input, where the stand-in copies the part of the
    output that stays on the rank (see ``ubatch.link``); None for collectives without one."""
    if is_link(group):
        if producer is not None:
            kwargs["own_part_stream"] = producer
        return getattr(group, op_name)(*args, async_op=async_op, **kwargs)
    token = issuing.set(True)
    try:
        return getattr(dist, op_name)(*args, group=group, async_op=async_op, **kwargs)
    finally:
        issuing.reset(token)


def _check_tensor(name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _local_copy(op_name: str, output: torch.Tensor, input: torch.Tensor) -> None:
    """A gather or scatter over one rank: the input, unchanged, in the output's shape."""
    if output.numel() != input.numel():
        raise ValueError(
            f"{op_name} with one rank needs equal sizes, got {output.numel()} and {input.numel()} elements"
        )
    output.view(-1).copy_(input.reshape(-1))


class CollectiveHandle:
    """A collective started with ``async_op=True``; call ``wait()`` before reading its output.

    Work issued between the start and ``wait()`` runs while the transfer is in flight: in an
    unsplit step run as one ubatch that is single-batch overlap (the shared experts under the
    dispatch), in a split step the other ubatches run too, since ``wait()`` yields first.
    Outside a ubatch it wraps torch.distributed's work object (or nothing, on one rank).
    """

    def __init__(self, op_name: str) -> None:
        self.op_name = op_name
        self.pending: scheduler.PendingCollective | None = None
        self.work: Any = None
        self.timeout: timedelta | None = None
        self._waited = False

    def wait(self, timeout: timedelta | None = None, *, stream: Any = None) -> bool:
        """Wait for the collective (once; later calls return at once), as ``Work.wait``: inside a
        ubatch on CPU ``timeout`` replaces the scheduler's. On CUDA the stream that waits is the
        ubatch's compute stream (outside ubatches the current one), or ``stream``: work that runs
        beside the compute stream on a stream of its own. Always True."""
        if not self._waited:
            self._waited = True
            self.timeout = timeout
            if timeout is not None and self.pending is not None:
                self.pending.timeout = timeout.total_seconds()
            run_island(self._finish, stream)
        return True

    def is_completed(self) -> bool:
        return self._waited

    def _finish(self, stream: Any = None) -> None:
        """The wait proper, an eager island: a piecewise replay re-runs it after its launch."""
        if self.pending is not None:
            scheduler.current_ubatch().finish_collective(self.pending, stream)
        elif self.work is not None:
            with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
                self.work.wait() if self.timeout is None else self.work.wait(self.timeout)


Launch = Callable[[bool, Any, Any], Any]
"""``launch(is_async, group, producer)``: start the collective; ``producer`` as in ``_call``."""


def _run(
    op_name: str,
    launch: Launch,
    local: Callable[[], None],
    group: Any,
    async_op: bool,
    timeout: float | None,
) -> CollectiveHandle | None:
    """Run one collective (an eager island): plainly, locally (one rank), or overlapped."""
    handle = CollectiveHandle(op_name) if async_op else None
    run_island(_collective, op_name, launch, local, group, handle, timeout)
    return handle


def _collective(
    op_name: str,
    launch: Launch,
    local: Callable[[], None],
    group: Any,
    handle: CollectiveHandle | None,
    timeout: float | None,
) -> None:
    ubatch = scheduler.current_ubatch()
    if ubatch is not None:
        group = ubatch.scheduler.resolve_group(group)
    if _world_size(group) == 1:
        local()
        if ubatch is not None and handle is None:
            scheduler.yield_ubatch()
        return
    if ubatch is None:
        work = launch(handle is not None, group, None)
        if handle is not None:
            handle.work = work
        return
    producer = ubatch.compute_stream

    def start_on_comm_stream(is_async: bool) -> Any:
        return launch(is_async, group, producer)

    start = functools.partial(ubatch.start_collective, op_name, start_on_comm_stream, timeout)
    if handle is None:
        ubatch.finish_collective(start())
    else:
        handle.pending = start(handle.pending)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: float | None = None,
    link_rows: torch.Tensor | None = None,
) -> Any:
    """``dist.all_to_all_single``, overlapped inside a ubatch. ``link_rows``: the rows of ``input``
    the transfer really moves to other ranks, a one-element int64 tensor on the device (a padded
    buffer's real rows), for a link stand-in that sizes its transfers on the GPU
    (``sizes_on_device``: ``ubatch.proxy_link.ProxyLink``); any other group sends what the splits
    say and ignores it."""
    _check_tensor("output", output)
    _check_tensor("input", input)

    def launch(is_async: bool, group: Any, producer: Any) -> Any:
        sized = link_rows is not None and is_link(group) and group.sizes_on_device
        return _call(
            "all_to_all_single",
            group,
            output,
            input,
            output_split_sizes,
            input_split_sizes,
            async_op=is_async,
            producer=producer,
            **({"moved_rows": link_rows} if sized else {}),
        )

    def local() -> None:
        if output.shape != input.shape:
            raise ValueError(
                f"all_to_all_single with one rank needs output.shape == input.shape, "
                f"got {tuple(output.shape)} and {tuple(input.shape)}"
            )
        output.copy_(input)

    return _run("all_to_all_single", launch, local, group, async_op, timeout)


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: float | None = None,
) -> Any:
    """``dist.all_reduce`` (in place), overlapped inside a ubatch."""
    _check_tensor("tensor", tensor)

    def launch(is_async: bool, group: Any, producer: Any) -> Any:
        return _call("all_reduce", group, tensor, op=op, async_op=is_async)  # in place: no own part

    return _run("all_reduce", launch, lambda: None, group, async_op, timeout)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: float | None = None,
) -> Any:
    """``dist.all_gather_into_tensor``, overlapped inside a ubatch."""
    _check_tensor("output_tensor", output_tensor)
    _check_tensor("input_tensor", input_tensor)

    def launch(is_async: bool, group: Any, producer: Any) -> Any:
        return _call("all_gather_into_tensor", group, output_tensor, input_tensor, async_op=is_async, producer=producer)

    local = functools.partial(_local_copy, "all_gather_into_tensor", output_tensor, input_tensor)
    return _run("all_gather_into_tensor", launch, local, group, async_op, timeout)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    *,
    timeout: float | None = None,
) -> Any:
    """``dist.reduce_scatter_tensor``, overlapped inside a ubatch."""
    _check_tensor("output", output)
    _check_tensor("input", input)

    def launch(is_async: bool, group: Any, producer: Any) -> Any:
        return _call("reduce_scatter_tensor", group, output, input, op=op, async_op=is_async, producer=producer)

    local = functools.partial(_local_copy, "reduce_scatter_tensor", output, input)
    return _run("reduce_scatter_tensor", launch, local, group, async_op, timeout)
