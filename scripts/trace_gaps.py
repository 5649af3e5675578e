"""Where profiled steps sat idle, and whether the host was the reason: per Chrome trace (as
``scripts/mode_kernels.py --trace-dir`` or ``ubatch-bench --chrome-trace`` write them, gzipped or
not), each lane's span, busy time and idle time, host-bound or waiting (``ubatch.bench.gaps``).

``python scripts/trace_gaps.py TRACE [TRACE ...] [--slack-us 20]``
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from ubatch.bench.gaps import HOST_SLACK_US, step_gaps


def load_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument(
        "--slack-us", type=float, default=HOST_SLACK_US, help="launch-to-start time that still counts as host-bound"
    )
    args = p.parse_args(argv)
    print(f"{'trace':40} {'lane':8} {'span ms':>8} {'busy':>8} {'host-bound':>11} {'waiting':>8}")
    for path in args.traces:
        if not path.is_file():
            p.error(f"no such trace file: {path}")
        for lane, g in step_gaps(load_trace(path), slack_us=args.slack_us).items():
            name = path.name.removesuffix(".gz").removesuffix(".json")
            print(f"{name:40} {lane:8} {g.span_ms:8.2f} {g.busy_ms:8.2f} {g.host_bound_ms:11.2f} {g.waiting_ms:8.2f}")


if __name__ == "__main__":
    main()
