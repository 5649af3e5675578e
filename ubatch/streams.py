"""The side streams ubatch runs on: one per (device, role), made once and kept, never aliased.

``torch.cuda.Stream()`` hands out a pool of 32 streams per device in turn, so the 33rd stream a
process asks for is the first one again. Work meant to overlap (one ubatch's compute, the comm
stream, the link stand-in's copies) then runs on one stream and serializes, with nothing to say
so: measured on an H200, the tenth mode of a benchmark sweep over the link stand-in took 49 ms
where the same mode alone took 35. So every stream ubatch makes comes from ``named_stream``,
which keeps one stream per role and checks that no two roles share one.

Streams a caller passes in (``UBatchScheduler(compute_streams=...)``) and green-context streams
(``ubatch.sm``, made by the driver outside the pool) are the caller's and the partition's.
Code outside ubatch that makes more than 32 streams on the device can still be handed one of
these; that is the pool's nature and beyond this module's reach.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

POOL_SIZE = 32  # torch's streams per device and priority (c10::cuda kStreamsPerPool)

_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_lock = threading.Lock()


def named_stream(device: Any, role: str) -> torch.cuda.Stream:
    """The stream of ``role`` (e.g. ``"comm"``, ``"ubatch1"``) on CUDA ``device``, the same one
    at every call, distinct from every other role's stream on that device."""
    index = _device_index(device)
    with _lock:
        stream = _streams.get((index, role))
        if stream is None:
            taken = {s.cuda_stream for (i, _), s in _streams.items() if i == index}
            stream = _fresh_stream(index, taken)
            _streams[index, role] = stream
        return stream


def ubatch_streams(device: Any, num_ubatches: int) -> tuple[list[torch.cuda.Stream], torch.cuda.Stream]:
    """One compute stream per ubatch and the comm stream, shared by every scheduler on ``device``
    (steps run one at a time, so schedulers never need theirs at once)."""
    return [named_stream(device, f"ubatch{i}") for i in range(num_ubatches)], named_stream(device, "comm")


def beside_stream(stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """A second stream for work that may run beside ``stream``'s, on the same SMs: on a
    green-context stream one on its context (``ubatch.sm``), else a named stream of its own; the
    same one at every call."""
    owner = getattr(stream, "_ubatch_green_owner", None)
    if owner is not None:
        return owner.beside(stream)
    return named_stream(stream.device, f"beside:{stream.cuda_stream}")


def _fresh_stream(index: int, taken: set[int]) -> torch.cuda.Stream:
    with torch.cuda.device(index):
        for _ in range(POOL_SIZE + 1):
            stream = torch.cuda.Stream()
            if stream.cuda_stream not in taken:
                return stream
    raise RuntimeError(
        f"torch's pool of {POOL_SIZE} CUDA streams on device {index} holds no stream that ubatch's "
        f"{len(taken)} roles do not already use"
    )


def _device_index(device: Any) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"named streams are CUDA streams, got device {device}")
    return torch.cuda.current_device() if device.index is None else device.index
