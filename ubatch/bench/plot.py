"""A timeline of one ubatched step: a PNG with a row per ubatch and stream, or a Chrome trace."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ubatch.trace import Interval

COLORS = {"compute": "#4C72B0", "comm": "#DD8452"}


def plot_timeline(intervals: Sequence[Interval], path: str, title: str) -> None:
    """Write the timeline of ``intervals`` to ``path`` (needs matplotlib: ``pip install ubatch[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'ubatch[plot]'") from exc
    rows = sorted({(i.ubatch_id, i.kind) for i in intervals})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.5))
    for y, (uid, kind) in enumerate(rows):
        spans = [(i.start_ms, i.duration_ms) for i in intervals if (i.ubatch_id, i.kind) == (uid, kind)]
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS[kind])
    ax.set_yticks(range(len(rows)), [f"ubatch {uid} {kind}" for uid, kind in rows])
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
