"""Which kernels grow when a step is split: a table from ``scripts/profile_step.py`` output.

``python scripts/profile_table.py profile_rank0.json.gz [--mode green:16] [--top 12]`` prints,
per SM partition mode, every configuration's summary and, for each ubatch count N > 1, the kernel
families (names up to their template arguments) with their count and total time unsplit and in
N ubatches, largest first.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from typing import Any

from ubatch.bench.kernels import kernel_family


def family_totals(config: dict[str, Any], names: list[str]) -> dict[str, tuple[int, float]]:
    """Kernel family -> (count, total ms) in one profiled configuration."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name_id, _, _, start, end, _ in config["kernels"]:
        entry = totals[kernel_family(names[name_id])]
        entry[0] += 1
        entry[1] += (end - start) / 1e3
    return {k: (int(n), ms) for k, (n, ms) in totals.items()}


def table(report: dict[str, Any], mode: str, top: int) -> str:
    configs = {c["num_ubatches"]: c for c in report["configs"] if c["mode"] == mode}
    if 1 not in configs:
        raise ValueError(f"no unsplit (N=1) configuration of mode {mode!r} in the report")
    names = report["kernel_names"]
    lines = []
    for _, config in sorted(configs.items()):
        summary = {k: v for k, v in config.items() if k not in ("kernels", "origin_us")}
        lines.append(json.dumps(summary))
    unsplit = family_totals(configs[1], names)
    for n in sorted(c for c in configs if c > 1):
        split = family_totals(configs[n], names)
        lines.append(f"\n{mode}: kernel families, unsplit -> N={n} (count, ms)")
        for fam in sorted(set(unsplit) | set(split), key=lambda f: -split.get(f, (0, 0.0))[1])[:top]:
            (c1, t1), (cn, tn) = unsplit.get(fam, (0, 0.0)), split.get(fam, (0, 0.0))
            lines.append(f"  {fam:60s} {c1:5d} -> {cn:5d}   {t1:8.3f} -> {tn:8.3f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", help="a profile{tag}_rank{r}.json.gz from scripts/profile_step.py")
    p.add_argument("--mode", help="the SM partition mode to show (default: every mode in the file)")
    p.add_argument("--top", type=int, default=12, help="kernel families per table")
    args = p.parse_args()
    with gzip.open(args.profile, "rt") as f:
        report = json.load(f)
    modes = [args.mode] if args.mode else list(dict.fromkeys(c["mode"] for c in report["configs"]))
    print("\n\n".join(table(report, mode, args.top) for mode in modes))


if __name__ == "__main__":
    main()
