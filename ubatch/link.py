"""A process-group look-alike whose collectives move real bytes over a host-staged link, so one
GPU (or one CPU process) can measure overlap against a transfer that takes no SMs.

Numerically a ``HostLink`` is a world of ONE: every collective leaves the values a single rank
would (all-to-all and the gather / scatter copy input to output, all-reduce leaves the tensor as
it is). Physically it moves the bytes one rank of a world of ``world_size`` W sends (and, at the
same time, receives), per collective:

- ``all_to_all_single``: the rows addressed to the other W - 1 ranks, (W-1)/W of the input;
- ``all_reduce`` (ring): 2(W-1)/W of the tensor;
- ``all_gather_into_tensor`` / ``reduce_scatter_tensor``: (W-1)/W of the full buffer.

``size()`` is W and ``rank()`` 0, so a model sizes its shards as one rank of W: its compute load
is a real rank's (an expert-parallel rank holds 1/W of the experts and receives W capacity blocks;
a tensor-parallel rank holds 1/W of the heads), while its outputs are one rank's partial results,
not the W-rank model's. Compare times against a real group, not outputs.

Bandwidth is in GB/s (1e9 bytes per second) per direction: 400 Gb/s InfiniBand is 50 GB/s,
100 Gb/s Ethernet 12.5 GB/s.

CUDA: the moved bytes go device -> pinned host slot (D2H, on the caller's current stream) ->
device (H2D, on a side stream), in chunks pipelined through a ring of pinned slots, so D2H and
H2D run at once on their own copy engines; events order each slot's reuse. All work forks from
and joins back to the current stream, needs no host sync and can be captured in a CUDA graph.
A collective's tensors stay reserved until its transfer is done (``record_stream``, as a process
group keeps them), so a caller may drop an input right after an async start.
The part of an all-to-all (or gather / scatter) that stays on the rank is a same-device copy, and
that is a kernel: on the comm stream it would wait for free SMs behind whatever kernel holds them
all (a persistent grouped GEMM) and hold up every transfer queued after it, so a collective takes
``own_part_stream``, the stream to copy that part on (``ubatch.comm`` passes the one that produced
the input).
The all-to-all and gather / scatter outputs are written by the transfer itself, so a consumer
that does not wait for the collective reads stale data, as it would over a real link. The first
use outside a capture (or ``prepare()``) allocates the ring and side stream and calibrates: it
synchronises the device and times a few round trips of 1 and 64 MiB (tens of ms).
A bandwidth below what the copies reach is enforced on the copy engine itself: before its first
chunk a collective has the D2H stream copy padding bytes from a device scratch buffer into pinned
memory, so every payload, large or small, takes its bytes over the set bandwidth (plus the
copies' own latency), no SM runs anything for it, and the pacing does not depend on what the SMs
are doing. The padding is ``pad_ratio`` times the payload (the copy engines' rate over the set
bandwidth, corrected from padded measurements until one lands within 5% of it) less the last
chunk, whose H2D runs after the D2H engine is done. Because that tail is paid for, a paced link
cuts a payload into as few chunks as the padding can cover (two where the ratio allows): a real
collective costs the host one launch, and the stand-in should cost it few, since pipelined modes
issue dozens per step. A link that calibrates further than ``REACHED_TOLERANCE`` from its set
bandwidth says so in a warning.

CPU: nothing moves. A collective sets the values (identity) and returns a ``LinkWork`` that
completes ``bytes / bandwidth`` seconds after the link is free (transfers queue one after
another, as on one communicator); ``wait`` sleeps until then, using no CPU. With no bandwidth
set the CPU link runs at ``DEFAULT_CPU_GBPS``.

Like a communicator's, one link's collectives must be ordered: issue them on one stream (the
scheduler's comm stream) or on streams the caller orders, and keep the link alive as long as
any CUDA graph that captured it. An eager collective on a new stream waits for the previous one.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ubatch.streams import named_stream

DEFAULT_CPU_GBPS = 10.0  # a memcpy's speed: the CPU link's bandwidth when none is set
DEFAULT_CHUNK_BYTES = 16 << 20  # largest chunk per copy, and the size of each pinned slot
RING_SLOTS = 4  # pinned slots: D2H runs up to this many chunks ahead of H2D
MIN_CHUNK_BYTES = 256 << 10
CHUNK_ALIGN = 64 << 10
MIN_PIECES = 4  # an unpaced link cuts payloads into at least this many chunks (unless they get too small)
PACED_MIN_PIECES = 2  # a paced link, whose padding pays for the last chunk's H2D, this many where it can
CALIBRATION_BYTES = (1 << 20, 64 << 20)  # payloads whose bandwidth describe() reports
CALIBRATION_REPEATS = 4
HOLD_CYCLES = 50_000_000  # ~25 ms at ~2 GHz: the calibration's streams wait while the host enqueues
MAX_PAD_CHUNKS = 4  # the padding scratch buffers hold at most this many chunks (more padding: more copies)
PAD_CORRECTIONS = 3  # padded calibration measurements at most, each correcting the padding
PAD_TOLERANCE = 0.05  # a padded measurement this close to the set bandwidth ends the correction
REACHED_TOLERANCE = 0.15  # a calibrated link further than this from its set bandwidth is reported

logger = logging.getLogger(__name__)

_ONE_RANK_OPS = (
    dist.ReduceOp.SUM,
    dist.ReduceOp.AVG,
    dist.ReduceOp.PRODUCT,
    dist.ReduceOp.MIN,
    dist.ReduceOp.MAX,
    dist.ReduceOp.BAND,
    dist.ReduceOp.BOR,
    dist.ReduceOp.BXOR,
)


class LinkWork:
    """A collective in flight on a HostLink, shaped like ``torch.distributed``'s Work.

    On CPU it completes at ``deadline`` (``time.monotonic()`` seconds). On CUDA it is complete
    when returned: the work is on the stream, and the stream order carries the dependency.
    ``nbytes`` is what the collective moved; ``seconds`` its transfer time on a CPU link (None on
    CUDA).
    """

    def __init__(self, op_name: str, nbytes: int, seconds: float | None, deadline: float) -> None:
        self.op_name = op_name
        self.nbytes = nbytes
        self.seconds = seconds
        self.deadline = deadline

    def is_completed(self) -> bool:
        return time.monotonic() >= self.deadline

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Sleep until the transfer is done; RuntimeError at once if it would outlast ``timeout``
        (None or ``timedelta(0)``: no limit, as in torch.distributed)."""
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")
        remaining = self.deadline - time.monotonic()
        if timeout is not None and timeout > timedelta(0) and remaining > timeout.total_seconds():
            raise RuntimeError(
                f"HostLink {self.op_name} of {self.nbytes} bytes needs {remaining:.3f} s more, "
                f"past the wait timeout of {timeout.total_seconds():g} s"
            )
        while remaining > 0:
            time.sleep(remaining)
            remaining = self.deadline - time.monotonic()
        return True


def is_link(group: Any) -> bool:
    """Whether ``group`` is a HostLink (whose collectives ``ubatch.comm`` hands to it)."""
    return isinstance(group, HostLink)


def parse_link(text: str) -> HostLink | None:
    """A link stand-in from a CLI flag: ``host`` (copy-engine speed, world 2), ``host:25`` (25 GB/s),
    ``host:25:w4`` (world size 4), ``host::w4`` (copy-engine speed, world 4); ``proxy:100:w8`` (a
    ``ubatch.proxy_link.ProxyLink`` at 100 GB/s, world 8; it needs a bandwidth), ``proxy:100:w8:warp``
    (the same, its transfers waited for in one warp, seen in traces); ``none``: None."""
    if not isinstance(text, str):
        raise TypeError(f"link must be a str, got {type(text).__name__}")
    if text == "none":
        return None
    usage = (
        f"link {text!r}: expected none, host, host:GBPS, host:GBPS:wWORLD, host::wWORLD (e.g. host:25:w4) "
        "or proxy:GBPS[:wWORLD][:warp]"
    )
    parts = text.split(":")
    wait = "stream"
    if parts[0] == "proxy" and len(parts) == 4:
        wait = parts.pop()
        if wait not in ("stream", "warp"):
            raise ValueError(f"{usage}; a proxy link waits in the stream or in a warp, got {wait!r}")
    if parts[0] not in ("host", "proxy") or len(parts) > 3 or (len(parts) == 2 and not parts[1]):
        raise ValueError(usage)
    bandwidth = None
    if len(parts) > 1 and parts[1]:
        try:
            bandwidth = float(parts[1])
        except ValueError:
            raise ValueError(f"{usage}; bandwidth {parts[1]!r} is not a number") from None
        if not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"{usage}; bandwidth {parts[1]!r} must be a positive number of GB/s")
    world_size = 2
    if len(parts) == 3:
        world = parts[2]
        if not (world.startswith("w") and world[1:].isdigit() and int(world[1:]) >= 1):
            raise ValueError(f"{usage}; world size {world!r} must be w followed by an integer >= 1")
        world_size = int(world[1:])
    if parts[0] == "proxy":
        if bandwidth is None:
            raise ValueError(f"{usage}; a proxy link needs a bandwidth (proxy:GBPS)")
        from ubatch.proxy_link import ProxyLink

        return ProxyLink(world_size, bandwidth, wait=wait)
    return HostLink(world_size, bandwidth)


def chunk_plan(total: int, length: int, chunk_bytes: int, min_pieces: int = MIN_PIECES) -> list[tuple[int, int]]:
    """(offset, size) of each copy that moves ``total`` bytes through a ``length``-byte buffer,
    going round it again while bytes remain: at least ``min_pieces`` chunks where they can be
    ``MIN_CHUNK_BYTES`` or more, none larger than ``chunk_bytes`` and none crossing the end."""
    if total == 0:
        return []
    if length <= 0:
        raise ValueError(f"cannot move {total} bytes through a buffer of {length} bytes")
    size = -(-total // min_pieces)
    size = -(-size // CHUNK_ALIGN) * CHUNK_ALIGN
    size = min(chunk_bytes, max(size, min(MIN_CHUNK_BYTES, chunk_bytes)))
    pieces, position = [], 0
    while position < total:
        offset = position % length
        n = min(size, total - position, length - offset)
        pieces.append((offset, n))
        position += n
    return pieces


class _CudaStaging:
    """The CUDA side of one HostLink on one device: the pinned ring, the H2D side stream, the
    events that order each slot's reuse, and the padding copies that set the throttle."""

    def __init__(self, device: torch.device, chunk_bytes: int, bandwidth_gbps: float | None) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "HostLink was first used inside a CUDA graph capture: it must allocate pinned memory and "
                "calibrate outside one. Call link.prepare() (or run the step once eagerly) before capturing"
            )
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.side = named_stream(device, "link-copy")
        ring = torch.empty(RING_SLOTS * chunk_bytes, dtype=torch.uint8, pin_memory=True)
        self.slots = [ring[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(RING_SLOTS)]
        self.staged = [torch.cuda.Event() for _ in range(RING_SLOTS)]  # D2H of the slot done
        self.drained = [torch.cuda.Event() for _ in range(RING_SLOTS)]  # H2D of the slot done
        self.done = torch.cuda.Event()
        self.last_stream: Any = None
        self.pad_ratio = 0.0  # padding bytes the D2H engine copies per byte moved
        self.min_pieces = MIN_PIECES
        self.pad_src = self.pad_dst = torch.empty(0, dtype=torch.uint8)
        self.copy_gbps = self._measure(CALIBRATION_BYTES[-1])
        if bandwidth_gbps is not None and bandwidth_gbps < self.copy_gbps:
            self._pace(bandwidth_gbps)
        self.reached_gbps = {nbytes: self._measure(nbytes) for nbytes in CALIBRATION_BYTES}
        expected = min(bandwidth_gbps or self.copy_gbps, self.copy_gbps)
        reached = self.reached_gbps[CALIBRATION_BYTES[-1]]
        if abs(reached / expected - 1) > REACHED_TOLERANCE:
            logger.warning(
                "link stand-in calibrated to %.1f GB/s at %d MiB where %.1f was expected (set %s, copy engines %.1f): "
                "its transfers will not take the set time",
                reached,
                CALIBRATION_BYTES[-1] >> 20,
                expected,
                bandwidth_gbps,
                self.copy_gbps,
            )

    def _pace(self, bandwidth_gbps: float) -> None:
        """Set the padding that slows the copies to ``bandwidth_gbps``: first from the copy
        engines' own speed, then corrected from padded measurements (padding shares the engine's
        per-copy costs) until one lands within ``PAD_TOLERANCE``, at most ``PAD_CORRECTIONS``
        times, so one noisy measurement cannot leave the link unpaced."""
        self.pad_ratio = self.copy_gbps / bandwidth_gbps - 1
        # As few chunks as the padding can pay the last one's H2D for: 1 / pad_ratio of them.
        self.min_pieces = min(MIN_PIECES, max(PACED_MIN_PIECES, math.ceil(1 / self.pad_ratio)))
        pad_bytes = self.chunk_bytes * min(MAX_PAD_CHUNKS, math.ceil(self.pad_ratio * RING_SLOTS))
        self.pad_src = torch.empty(pad_bytes, dtype=torch.uint8, device=self.device)
        self.pad_dst = torch.empty(pad_bytes, dtype=torch.uint8, pin_memory=True)
        for _ in range(PAD_CORRECTIONS):
            measured = self._measure(CALIBRATION_BYTES[-1])
            if abs(measured / bandwidth_gbps - 1) <= PAD_TOLERANCE:
                return
            self.pad_ratio = max(0.0, (1 + self.pad_ratio) * measured / bandwidth_gbps - 1)

    def _measure(self, nbytes: int) -> float:
        """GB/s of back-to-back round trips of ``nbytes`` on an idle device, on a private stream
        held behind a sleep while the host enqueues them, so the figure is the device's and not
        the Python launch rate."""
        torch.cuda.synchronize(self.device)
        stream = named_stream(self.device, "link-calibration")
        with torch.cuda.stream(stream):
            scratch = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self.round_trip(scratch, scratch, nbytes)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOLD_CYCLES)
            start.record()
            for _ in range(CALIBRATION_REPEATS):
                self.round_trip(scratch, scratch, nbytes)
            end.record()
            end.synchronize()
        return CALIBRATION_REPEATS * nbytes / max(start.elapsed_time(end) / 1e3, 1e-9) / 1e9

    def _pad(self, total: int, tail: int) -> None:
        """Hold the D2H engine for ``pad_ratio * total`` bytes less the ``tail`` whose H2D runs
        after it (copies of a scratch buffer into pinned memory), so a payload of ``total`` bytes
        takes as long as the set bandwidth allows."""
        remaining = round(self.pad_ratio * total) - tail
        while remaining > 0:
            n = min(remaining, len(self.pad_src))
            self.pad_dst[:n].copy_(self.pad_src[:n], non_blocking=True)
            remaining -= n

    def round_trip(self, src: torch.Tensor, dst: torch.Tensor, total: int) -> None:
        """Move ``total`` bytes from byte buffer ``src`` through pinned memory into ``dst`` (the
        same length; the same buffer for an in-place round trip), going round it again while
        bytes remain, all ordered on the current stream. The copies are issued a ring's worth at
        a time, D2H then H2D, so the host switches streams once per ring, not once per chunk."""
        pieces = chunk_plan(total, src.numel(), self.chunk_bytes, self.min_pieces)
        if not pieces:
            return
        current = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing and self.last_stream is not None and self.last_stream != current:
            current.wait_event(self.done)  # the previous collective's stream still owns the ring
        self._pad(total, pieces[-1][1])  # before the copies, so the last H2D does not hide under it
        for start in range(0, len(pieces), RING_SLOTS):
            ring = pieces[start : start + RING_SLOTS]
            for j, (offset, size) in enumerate(ring):
                if start:
                    current.wait_event(self.drained[j])  # the slot's previous chunk has gone back
                self.slots[j][:size].copy_(src[offset : offset + size], non_blocking=True)
                self.staged[j].record(current)
            with torch.cuda.stream(self.side):
                for j, (offset, size) in enumerate(ring):
                    self.side.wait_event(self.staged[j])
                    dst[offset : offset + size].copy_(self.slots[j][:size], non_blocking=True)
                    self.drained[j].record(self.side)
        current.wait_event(self.drained[(len(pieces) - 1) % RING_SLOTS])
        if not capturing:
            self.done.record(current)
            self.last_stream = current


class HostLink:
    """A world of one that moves the bytes of a world of ``world_size`` over a host-staged link
    (see the module docstring). ``bandwidth_gbps``: GB/s per direction; None is as fast as the
    copy engines go (CUDA) or ``DEFAULT_CPU_GBPS`` (CPU). ``device``: the device whose tensors it
    moves (None: the first tensor's). ``chunk_bytes``: the largest copy (a tuning knob; the pinned
    ring holds ``RING_SLOTS`` of them). ``bytes_moved`` counts every byte sent so far."""

    sizes_on_device = False  # its copies are sized when issued (or captured): no moved_rows
    transfers_in_trace = True  # its copies are memcpy activities, which a profiler records

    def __init__(
        self,
        world_size: int,
        bandwidth_gbps: float | None = None,
        *,
        device: torch.device | str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if bandwidth_gbps is not None:
            if isinstance(bandwidth_gbps, bool) or not isinstance(bandwidth_gbps, (int, float)):
                raise TypeError(f"bandwidth_gbps must be a number or None, got {type(bandwidth_gbps).__name__}")
            if not (math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):
                raise ValueError(f"bandwidth_gbps must be a positive number of GB/s, got {bandwidth_gbps!r}")
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < CHUNK_ALIGN:
            raise ValueError(f"chunk_bytes must be an int >= {CHUNK_ALIGN}, got {chunk_bytes!r}")
        self.world_size = world_size
        self.bandwidth_gbps = None if bandwidth_gbps is None else float(bandwidth_gbps)
        self.chunk_bytes = chunk_bytes
        self.device = None if device is None else torch.device(device)
        if self.device is not None and self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"HostLink runs on cpu or cuda, got device {device!r}")
        self.bytes_moved = 0
        self._free_at = 0.0  # CPU: when the last queued transfer is done (time.monotonic())
        self._cuda: _CudaStaging | None = None

    def __repr__(self) -> str:
        return f"HostLink(world_size={self.world_size}, bandwidth_gbps={self.bandwidth_gbps})"

    def size(self) -> int:
        """The world size models shard for (``dist.get_world_size`` of this group)."""
        return self.world_size

    def rank(self) -> int:
        return 0

    def prepare(self, device: torch.device | str | None = None) -> None:
        """Allocate the pinned ring and side stream and calibrate, as the first collective would;
        call it before capturing a graph that uses a link nothing has run over yet. A no-op on CPU."""
        if device is None:
            device = self.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._bind(torch.device(device), "prepare(device)")
        if self.device.type == "cuda":
            self._staging()

    def describe(self) -> dict[str, Any]:
        """The link for reports; every figure that uses it must say it is the stand-in.
        ``bandwidth_reached_gbps`` is measured at the largest payload of ``reached_gbps_by_bytes``."""
        cpu = self.device is not None and self.device.type == "cpu"
        by_bytes: dict[int, float] | None = None
        if cpu:
            reached, copy_gbps = self.bandwidth_gbps or DEFAULT_CPU_GBPS, None
        elif self._cuda is not None:
            by_bytes, copy_gbps = self._cuda.reached_gbps, self._cuda.copy_gbps
            reached = by_bytes[CALIBRATION_BYTES[-1]]
        else:
            reached = copy_gbps = None
        return {
            "kind": "host-link stand-in",
            "world_size": self.world_size,
            "bandwidth_set_gbps": self.bandwidth_gbps,
            "bandwidth_reached_gbps": reached,
            "reached_gbps_by_bytes": by_bytes,
            "copy_engine_gbps": copy_gbps,
            "device": None if self.device is None else str(self.device),
            "method": "cpu deadline, no data moved" if cpu else "pinned host round trip on the copy engines",
        }

    # --- collectives -------------------------------------------------------------------------

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        async_op: bool = False,
        *,
        own_part_stream: torch.cuda.Stream | None = None,
        moved_rows: torch.Tensor | None = None,
    ) -> LinkWork | None:
        """output = input; moves the rows addressed to the other W - 1 ranks. A world of one
        receives what it sent, so the output splits must equal the input splits. The rows it
        addresses to itself are copied on ``own_part_stream`` (None: the current stream).
        ``moved_rows``: the rows of ``input`` to charge instead, a one-element int64 tensor on the
        link's device that the GPU may set (the rows a padded buffer really holds for other
        ranks), charged at the input's row size; only links with ``sizes_on_device`` take it."""
        op = "all_to_all_single"
        self._check_pair(op, output, input, async_op)
        if moved_rows is not None:
            self._check_moved_rows(op, moved_rows)
        if input.dim() == 0:
            raise ValueError(f"{op} needs tensors with a first dimension, got a 0-dim input")
        if output.shape != input.shape:
            raise ValueError(
                f"{op} on a HostLink (a world of one) needs output.shape == input.shape, "
                f"got {tuple(output.shape)} and {tuple(input.shape)}"
            )
        rows = input.shape[0]
        sent = self._splits(op, "input_split_sizes", input_split_sizes, rows)
        received = self._splits(op, "output_split_sizes", output_split_sizes, rows)
        if sent != received:
            raise ValueError(
                f"{op} on a HostLink returns the input as the output, so output_split_sizes must "
                f"equal input_split_sizes, got {received} and {sent}"
            )
        row_bytes = input.nbytes // rows if rows else 0
        own = sent[0] * row_bytes
        sized = None if moved_rows is None else (moved_rows, row_bytes)
        return self._exchange(op, output, input, own, async_op, own_part_stream, sized)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, async_op: bool = False) -> LinkWork | None:
        """The tensor unchanged (any reduction over one rank); moves 2(W-1)/W of it (a ring)."""
        name = "all_reduce"
        _check_tensor(name, "tensor", tensor)
        _check_async(name, async_op)
        _check_reduce_op(name, op)
        self._bind(tensor.device, f"{name}'s tensor")
        moved = 2 * (self.world_size - 1) * tensor.nbytes // self.world_size
        if self._is_cpu():
            return self._cpu_work(name, moved, async_op)
        with torch.cuda.device(self.device):
            data = _bytes(tensor)
            self._transfer(data, data, moved, torch.cuda.current_stream())
            _in_use_until_done(tensor)
        return self._cuda_work(name, moved, async_op)

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        *,
        own_part_stream: torch.cuda.Stream | None = None,
    ) -> LinkWork | None:
        """output = input (one rank's gather: equal sizes); moves (W-1)/W of the buffer, the
        rank's own 1/W copied on ``own_part_stream`` (None: the current stream)."""
        return self._one_rank_copy("all_gather_into_tensor", output, input, async_op, own_part_stream)

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
        *,
        own_part_stream: torch.cuda.Stream | None = None,
    ) -> LinkWork | None:
        """output = input (one rank's scatter: equal sizes); moves (W-1)/W of the buffer, the
        rank's own 1/W copied on ``own_part_stream`` (None: the current stream)."""
        _check_reduce_op("reduce_scatter_tensor", op)
        return self._one_rank_copy("reduce_scatter_tensor", output, input, async_op, own_part_stream)

    # --- internals ---------------------------------------------------------------------------

    def _one_rank_copy(
        self, op: str, output: torch.Tensor, input: torch.Tensor, async_op: bool, own_part_stream: Any
    ) -> LinkWork | None:
        self._check_pair(op, output, input, async_op)
        if output.numel() != input.numel():
            raise ValueError(
                f"{op} on a HostLink (a world of one) needs equal sizes, "
                f"got {output.numel()} and {input.numel()} elements"
            )
        own = input.numel() // self.world_size * input.element_size()
        return self._exchange(op, output, input, own, async_op, own_part_stream)

    def _exchange(
        self,
        op: str,
        output: torch.Tensor,
        input: torch.Tensor,
        own: int,
        async_op: bool,
        own_part_stream: Any,
        sized: tuple[torch.Tensor, int] | None = None,
    ) -> LinkWork | None:
        """output = input: ``own`` leading bytes copied on the device (on ``own_part_stream``),
        the rest over the link (where ``sized`` is given, (rows on the device, bytes a row): that
        many bytes of it)."""
        moved = input.nbytes - own
        _check_own_part_stream(op, own_part_stream, self.device)
        if self._is_cpu():
            if output.data_ptr() != input.data_ptr():
                output.copy_(input.view(output.shape))
            return self._cpu_work(op, moved if sized is None else int(sized[0]) * sized[1], async_op)
        with torch.cuda.device(self.device):
            src, dst = _bytes(input), _bytes(output)
            data_stream = own_part_stream or torch.cuda.current_stream()
            if own and output.data_ptr() != input.data_ptr():
                with torch.cuda.stream(data_stream):
                    dst[:own].copy_(src[:own])
            self._transfer(src[own:], dst[own:], moved, data_stream, sized)
            _in_use_until_done(input, output, None if sized is None else sized[0])
        return self._cuda_work(op, moved, async_op)

    def _transfer(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        moved: int,
        data_stream: torch.cuda.Stream,
        sized: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        """Move ``moved`` bytes of ``src`` into ``dst`` over the link, ordered on the current stream
        (``data_stream``: where a same-device copy may run; the staging here needs none;
        ``sized``: (rows the GPU sets, bytes a row), which only links with ``sizes_on_device``
        take)."""
        self._staging().round_trip(src, dst, moved)

    def _check_moved_rows(self, op: str, moved_rows: Any) -> None:
        if not self.sizes_on_device:
            raise ValueError(
                f"{op}: {type(self).__name__}'s transfers are sized when issued, so it cannot take moved_rows "
                "(a size set on the GPU); use a ProxyLink"
            )
        if not isinstance(moved_rows, torch.Tensor) or moved_rows.dtype != torch.int64 or moved_rows.numel() != 1:
            raise TypeError(f"{op}: moved_rows must be a one-element int64 tensor, got {moved_rows!r}")
        if moved_rows.device != self.device:
            raise ValueError(f"{op}: moved_rows is on {moved_rows.device}, the link on {self.device}")

    def _cpu_work(self, op: str, moved: int, async_op: bool) -> LinkWork | None:
        seconds = moved / ((self.bandwidth_gbps or DEFAULT_CPU_GBPS) * 1e9)
        self._free_at = max(time.monotonic(), self._free_at) + seconds
        self.bytes_moved += moved
        work = LinkWork(op, moved, seconds, self._free_at)
        if async_op:
            return work
        work.wait()
        return None

    def _cuda_work(self, op: str, moved: int, async_op: bool) -> LinkWork | None:
        self.bytes_moved += moved
        return LinkWork(op, moved, None, -math.inf) if async_op else None

    def _staging(self) -> _CudaStaging:
        if self._cuda is None:
            with torch.cuda.device(self.device):
                self._cuda = _CudaStaging(self.device, self.chunk_bytes, self.bandwidth_gbps)
        return self._cuda

    def _is_cpu(self) -> bool:
        return self.device.type == "cpu"

    def _bind(self, device: torch.device, what: str) -> None:
        """Fix the link's device at the first one seen; ValueError on any other."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.device is not None and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device is None:
            self.device = device
        elif device != self.device:
            raise ValueError(f"HostLink is on {self.device}, got {what} on {device}")

    def _check_pair(self, op: str, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> None:
        _check_tensor(op, "output", output)
        _check_tensor(op, "input", input)
        _check_async(op, async_op)
        self._bind(input.device, f"{op}'s input")
        if output.device != input.device:
            raise ValueError(f"{op}: output is on {output.device} and input on {input.device}")
        if output.dtype != input.dtype:
            raise TypeError(f"{op}: output and input dtypes differ ({output.dtype} and {input.dtype})")
        a, b = output.data_ptr(), input.data_ptr()
        same = a == b and output.nbytes == input.nbytes
        if output.nbytes and input.nbytes and not same and a < b + input.nbytes and b < a + output.nbytes:
            raise ValueError(f"{op}: output and input overlap in memory without being the same tensor")

    def _splits(self, op: str, name: str, splits: Sequence[int] | None, rows: int) -> list[int]:
        world = self.world_size
        if splits is None:
            if rows % world:
                raise ValueError(f"{op} with no {name} needs dim 0 ({rows}) divisible by the world size ({world})")
            return [rows // world] * world
        if not isinstance(splits, (list, tuple)):
            raise TypeError(f"{op}: {name} must be a list of ints or None, got {type(splits).__name__}")
        splits = list(splits)
        if len(splits) != world or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in splits):
            raise ValueError(f"{op}: {name} must hold {world} ints >= 0 (one per rank), got {splits}")
        if sum(splits) != rows:
            raise ValueError(f"{op}: {name} {splits} sums to {sum(splits)}, not dim 0 ({rows})")
        return splits


def _check_tensor(op: str, name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")


def _check_async(op: str, async_op: Any) -> None:
    if not isinstance(async_op, bool):
        raise TypeError(f"{op}: async_op must be a bool, got {type(async_op).__name__}")


def _check_reduce_op(op: str, reduce_op: Any) -> None:
    if not any(reduce_op == known for known in _ONE_RANK_OPS):
        raise ValueError(
            f"{op}: HostLink supports the reductions that are the identity over one rank "
            f"(SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR), got {reduce_op!r}"
        )


def _check_own_part_stream(op: str, stream: Any, device: torch.device) -> None:
    if stream is None:
        return
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"{op}: own_part_stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if device.type == "cuda" and stream.device != device:
        raise ValueError(f"{op}: own_part_stream is on {stream.device}, the link on {device}")


def _in_use_until_done(*tensors: torch.Tensor | None) -> None:
    """Keep the tensors' blocks from new work until the current stream's transfer is done, as a
    process group keeps a collective's tensors: a caller that drops an input (or a size the GPU
    set) right after an async collective would otherwise see its block handed to new work on the
    stream that made it while the transfer still reads it."""
    stream = torch.cuda.current_stream()
    for tensor in tensors:
        if tensor is not None and tensor.is_cuda:
            tensor.record_stream(stream)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)
