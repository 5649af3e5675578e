"""A ubatch-bench ``--modes`` report as benchmarks/RESULTS.md shows it: the run's line, the
command, the markdown table and the mode policy's picks.

``python scripts/modes_table.py benchmarks/h200/modes_moe_prefill_link27.json``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ubatch.bench.report import format_modes_table, modes_policy_sentence  # noqa: E402


def render(report: dict) -> str:
    """The report's section body: when and where it ran, its link, the table, the picks."""
    if "auto" not in report or not report.get("results") or "mode" not in report["results"][0]:
        raise ValueError("not an overlap-modes report (ubatch-bench --modes)")
    env, setup = report["environment"], report["setup"]
    where = f"{env['time']}, one {env.get('gpu', env['device'])}, torch {env['torch']}, attention {env['attention']}"
    link = setup.get("link")
    if link:
        by_bytes = ", ".join(f"{int(b) >> 20} MiB {gbps:.1f}" for b, gbps in link["reached_gbps_by_bytes"].items())
        speed = f"set to {link['bandwidth_set_gbps']} GB/s" if link["bandwidth_set_gbps"] else "at copy-engine speed"
        where += f"; link stand-in {speed}, reached {by_bytes} GB/s"
    if setup.get("kv_block_size"):
        where += f"; KV pages of {setup['kv_block_size']} tokens"
    capacity = setup.get("capacity")
    if capacity:
        where += f"; capacity factors measured: {capacity['dispatch']} (dispatch), {capacity['expert']} (experts)"
        for groups, factors in capacity.get("chunk_dispatch", {}).items():
            where += f", {' / '.join(map(str, factors))} (dispatch chunks of {groups} expert groups)"
    picks = "\n".join(f"- {modes_policy_sentence(point)}" for point in report["auto"]["points"])
    return f"{where}\n\n{format_modes_table(report['results'], markdown=True)}\n\n{picks}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", nargs="+", help="ubatch-bench --modes --out files")
    for path in p.parse_args().report:
        try:
            report = json.loads(Path(path).read_text())
            print(f"### {path}\n\n{render(report)}\n")
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"{path}: {exc}") from exc


if __name__ == "__main__":
    main()
