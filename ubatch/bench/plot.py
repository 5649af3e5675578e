"""A timeline of one ubatched step: a PNG with a row per ubatch and stream, or a Chrome trace."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ubatch.trace import Interval

COLORS = {"compute": "#4C72B0", "comm": "#DD8452"}


def plot_timeline(intervals: Sequence[Interval], path: str, title: str) -> None:
    """Write the timeline of ``intervals`` to ``path`` (needs matplotlib: ``pip install ubatch[plot]``)."""
    _plot_rows(intervals, path, title, label="ubatch")


def _plot_rows(intervals: Sequence[Interval], path: str, title: str, *, label: str) -> None:
    """A row per (``ubatch_id``, kind) of ``intervals``, named ``label`` (a ubatch, or a stream)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install 'ubatch[plot]'") from exc

    rows = sorted({(i.ubatch_id, i.kind) for i in intervals})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.5))
    for y, (uid, kind) in enumerate(rows):
        spans = [(i.start_ms, i.duration_ms) for i in intervals if (i.ubatch_id, i.kind) == (uid, kind)]
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS[kind])
    ax.set_yticks(range(len(rows)), [f"{label} {uid} {kind}" for uid, kind in rows])
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_kernel_timeline(trace: dict, path: str, title: str) -> None:
    """Write a torch.profiler trace's GPU activity to ``path``: a row per CUDA stream, compute
    kernels and communication (NCCL kernels, the link stand-in's host copies and pacing) apart,
    so what ran beside what shows."""
    from ubatch.bench.kernels import is_comm_activity

    events = [
        e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")
    ]
    if not events:
        raise ValueError("the trace holds no kernel or copy events")
    origin = min(e["ts"] for e in events)
    intervals = [
        Interval(
            int(e.get("args", {}).get("stream", e.get("tid", 0))),
            "comm" if is_comm_activity(e["name"]) else "compute",
            e["name"],
            (e["ts"] - origin) / 1e3,
            (e["ts"] - origin + e["dur"]) / 1e3,
        )
        for e in events
    ]
    _plot_rows(intervals, path, title, label="stream")


def write_chrome_trace(intervals: Sequence[Interval], path: str) -> None:
    """The intervals as complete events ("ph": "X", microseconds), a thread per ubatch and stream."""
    rows = sorted({(i.ubatch_id, i.kind) for i in intervals})
    tid = {row: n for n, row in enumerate(rows)}
    events = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[row], "args": {"name": f"ubatch {row[0]} {row[1]}"}}
        for row in rows
    ]
    events += [
        {
            "name": i.name,
            "cat": i.kind,
            "ph": "X",
            "pid": 0,
            "tid": tid[(i.ubatch_id, i.kind)],
            "ts": i.start_ms * 1e3,
            "dur": i.duration_ms * 1e3,
        }
        for i in intervals
    ]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
