"""Draw a torch.profiler trace (``ubatch-bench --graphs --chrome-trace``) as a PNG timeline: a row
per CUDA stream, compute and communication apart, to see what overlapped.

    python scripts/plot_trace.py trace.json[.gz] timeline.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import gzip
import json

from ubatch.bench.plot import plot_kernel_timeline


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("png")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        trace = json.load(f)
    plot_kernel_timeline(trace, args.png, args.title or args.trace)


if __name__ == "__main__":
    main()
