"""Per-step timelines of ubatch compute and communication, and how much communication was hidden.

On CUDA the interval ends are timing events recorded on the stream that did the work, so they are
GPU timestamps; on CPU they are host clock readings. A compute interval runs from the moment a
ubatch's stream is handed the turn to the moment it yields, so host launch gaps count as compute:
the hidden fraction is an upper bound when the host, not the GPU, is the bottleneck.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Interval:
    ubatch_id: int
    kind: str  # "compute" or "comm"
    name: str
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class StepTrace:
    """Records intervals while the scheduler runs; read them with ``intervals()`` afterwards."""

    is_cuda: bool
    _raw: list[tuple[int, str, str, Any, Any]] = field(default_factory=list)

    def mark(self, stream: Any = None) -> Any:
        if not self.is_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def add(self, ubatch_id: int, kind: str, name: str, start: Any, end: Any) -> None:
        self._raw.append((ubatch_id, kind, name, start, end))

    def intervals(self) -> list[Interval]:
        """All intervals in ms from the earliest start (synchronises the device on CUDA)."""
        if not self._raw:
            return []
        ref = self._raw[0][3]
        if self.is_cuda:
            torch.cuda.synchronize()
            times = [(ref.elapsed_time(s), ref.elapsed_time(e)) for *_, s, e in self._raw]
        else:
            times = [((s - ref) * 1e3, (e - ref) * 1e3) for *_, s, e in self._raw]
        origin = min(start for start, _ in times)
        times = [(start - origin, end - origin) for start, end in times]
        return [
            Interval(uid, kind, name, start, max(start, end))
            for (uid, kind, name, _, _), (start, end) in zip(self._raw, times)
        ]


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def busy_ms(intervals: list[Interval], kind: str) -> float:
    """How long at least one interval of ``kind`` was running (overlaps counted once)."""
    return sum(end - start for start, end in _union([(i.start_ms, i.end_ms) for i in intervals if i.kind == kind]))


def hidden_comm_fraction(intervals: list[Interval]) -> float | None:
    """The share of communication time during which another ubatch was computing."""
    comm = [i for i in intervals if i.kind == "comm"]
    total = sum(i.duration_ms for i in comm)
    if total <= 0:
        return None
    hidden = 0.0
    for c in comm:
        others = _union(
            [(i.start_ms, i.end_ms) for i in intervals if i.kind == "compute" and i.ubatch_id != c.ubatch_id]
        )
        hidden += sum(max(0.0, min(c.end_ms, e) - max(c.start_ms, s)) for s, e in others)
    return hidden / total
