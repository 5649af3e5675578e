"""Where a profiled step's device sat idle, and whether the host was the reason.

A lane is what the step runs on one kind of engine, in time order: its compute kernels, or its
communication (the link stand-in's copies and NCCL kernels, as ``ubatch.bench.kernels`` counts
them). Between a lane's first start and its last end, every stretch where nothing of the lane
ran is an idle gap. A gap is *host-bound* when the activity that ends it started within
``HOST_SLACK_US`` of the host call that launched it returning: nothing was queued, the device
waited for the host. Otherwise it is *waiting*: the activity was queued earlier and held back by
a dependency (an event of another stream, a transfer, a kernel ahead of it on its stream).

Host calls are matched to device activities by torch.profiler's correlation ids. A CUDA graph's
kernels all carry the correlation of its launch, so only the first activity of a launch can end a
host-bound gap (a graph's later kernels were queued with it); the eager islands of a PIECEWISE
replay are launched one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ubatch.bench.kernels import is_comm_activity

HOST_SLACK_US = 20.0  # a launch that returned this shortly before its activity began left nothing queued
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy")


@dataclass(frozen=True)
class Activity:
    start_us: float
    end_us: float
    correlation: int | None = None


class LaneGaps(NamedTuple):
    """A lane's span (first start to last end), busy time and idle time split by cause, in ms:
    ``span_ms == busy_ms + host_bound_ms + waiting_ms``."""

    span_ms: float
    busy_ms: float
    host_bound_ms: float
    waiting_ms: float


def launch_returns_us(trace: dict[str, Any]) -> dict[int, float]:
    """When each host launch call (runtime or driver API) returned, by correlation id."""
    returns = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in _LAUNCH_CATEGORIES:
            correlation = e.get("args", {}).get("correlation")
            if correlation is not None:
                returns[correlation] = e["ts"] + e["dur"]
    return returns


def lane_activities(trace: dict[str, Any]) -> dict[str, list[Activity]]:
    """The trace's device activities per lane: "compute" (every kernel that is not communication)
    and "comm" (communication kernels and copies). Other copies belong to neither."""
    lanes: dict[str, list[Activity]] = {"compute": [], "comm": []}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in _DEVICE_CATEGORIES:
            continue
        comm = is_comm_activity(e["name"])
        if e["cat"] == "gpu_memcpy" and not comm:
            continue
        activity = Activity(e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("correlation"))
        lanes["comm" if comm else "compute"].append(activity)
    return lanes


def lane_gaps(
    activities: Sequence[Activity], launch_returns: dict[int, float], *, slack_us: float = HOST_SLACK_US
) -> LaneGaps:
    """One lane's busy and idle time (see the module docstring); all zero for an empty lane."""
    if not activities:
        return LaneGaps(0.0, 0.0, 0.0, 0.0)
    ordered = sorted(activities, key=lambda a: a.start_us)
    busy = host = waiting = 0.0
    busy_until = ordered[0].start_us
    seen: set[int] = set()  # correlations whose first activity has started: a graph's later kernels
    for a in ordered:
        if a.start_us > busy_until:
            first_of_launch = a.correlation is not None and a.correlation not in seen
            launched = launch_returns.get(a.correlation) if first_of_launch else None
            if launched is not None and a.start_us - launched <= slack_us:
                host += a.start_us - busy_until
            else:
                waiting += a.start_us - busy_until
        if a.correlation is not None:
            seen.add(a.correlation)
        if a.end_us > busy_until:
            busy += a.end_us - max(a.start_us, busy_until)
            busy_until = a.end_us
    span = busy_until - ordered[0].start_us
    return LaneGaps(span / 1e3, busy / 1e3, host / 1e3, waiting / 1e3)


def step_gaps(trace: dict[str, Any], *, slack_us: float = HOST_SLACK_US) -> dict[str, LaneGaps]:
    """``lane_gaps`` of each lane of one profiled step (a Chrome trace torch.profiler exported)."""
    returns = launch_returns_us(trace)
    return {lane: lane_gaps(acts, returns, slack_us=slack_us) for lane, acts in lane_activities(trace).items()}
