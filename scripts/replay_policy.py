"""How the current split policy does on saved ``ubatch-bench --policy auto`` runs.

``python scripts/replay_policy.py [report.json ...] [--min-gain 1.05]`` (default: every eager
``--policy auto`` report under ``benchmarks/``) recalibrates from each report's calibration,
decides every sweep point again and prints the pick beside the best measured count, as the
ratio of their measured times. Exits 1 when a pick falls below ``--floor`` (0.97, the policy's
target: never worse than 0.97x of the best measured choice) of the best.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ubatch.bench.replay import replay


def auto_reports(root: Path) -> list[Path]:
    """Reports under ``root`` that hold an eager calibration."""
    found = []
    for path in sorted(root.rglob("*.json")):
        report = json.loads(path.read_text())
        if isinstance(report, dict) and "costs" in (report.get("auto") or {}):
            found.append(path)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="*", type=Path)
    parser.add_argument("--min-gain", type=float, default=1.05)
    parser.add_argument("--floor", type=float, default=0.97)
    args = parser.parse_args()
    repo = Path(__file__).resolve().parent.parent
    paths = args.reports or auto_reports(repo / "benchmarks")
    worst = 1.0
    print(f"{'tokens':>6} {'pick':>4} {'best':>4} {'vs best':>8}  report")
    for path in paths:
        shown = path.resolve().relative_to(repo) if path.resolve().is_relative_to(repo) else path
        for point in replay(json.loads(path.read_text()), min_gain=args.min_gain):
            worst = min(worst, point.vs_best)
            print(f"{point.tokens:6d} {point.choice:4d} {point.best:4d} {point.vs_best:8.3f}  {shown}")
    print(f"worst: {worst:.3f} of the best over {len(paths)} reports")
    return 0 if worst >= args.floor else 1


if __name__ == "__main__":
    sys.exit(main())
