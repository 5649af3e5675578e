"""How much of a step's communication time moves data, and how much waits for a peer rank.

``python scripts/comm_waits.py profile_rank0.json.gz profile_rank1.json.gz [...]`` reads the
per-rank kernel timelines of ``scripts/profile_step.py``. A collective's kernel runs on each rank
from its launch until every rank has exchanged its data: a rank that arrives first spins. Every
rank issues its collectives in the same order, so the k-th NCCL kernel of a configuration is the
same collective on every rank, and the shortest of its durations is the time all ranks spent in
it together: its *transfer* (``ubatch.bench.kernels.transfer_ms``, which ``ubatch-bench --graphs``
reports too); the rest of each rank's kernel time is *waiting*. This needs no
common clock, only that a collective ends at about the same moment on every rank, which the
printed end skew checks (ranks on one host share the profiler's clock).

Split into transfer and waiting, a split step's "communication stretch" (its NCCL busy time over
the unsplit step's) says whether collectives ran slower beside compute (transfer grows) or ranks
reached them at different times (waiting grows). Each split row also gets the best its own
kernels allow: no schedule can finish before its compute lane's busy time, nor before its
transfers, so ``bound_speedup`` = unsplit wall / max(the two) and ``efficiency_bound`` is that
bound against the unsplit step's ideal, (C + M) / max(C, M) with M its transfer time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from typing import Any

from ubatch.bench.kernels import transfer_ms
from ubatch.bench.schedule import ideal_speedup
from ubatch.trace import Interval, busy_ms

COMPUTE, COMM = 0, 1


def comm_kernels(config: dict[str, Any]) -> list[tuple[float, float]]:
    """(start, end) in us of each NCCL kernel of one configuration, in start order."""
    return sorted((r[3], r[4]) for r in config["kernels"] if r[1] == COMM)


def split_waits(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """Transfer and per-rank waiting (ms) of one configuration profiled on every rank."""
    per_rank = [comm_kernels(c) for c in configs]
    compute = [
        busy_ms(
            [Interval(0, "compute", "", r[3] / 1e3, r[4] / 1e3) for r in c["kernels"] if r[1] == COMPUTE], "compute"
        )
        for c in configs
    ]
    durations = [[end - start for start, end in kernels] for kernels in per_rank]
    transfer = transfer_ms(durations)
    result: dict[str, Any] = {
        "wall_ms": max(c["wall_ms"] for c in configs),
        "compute_busy_ms": round(max(compute), 3),
        "comm_kernels": len(durations[0]),
        "busy_ms": [round(sum(d) / 1e3, 3) for d in durations],
        "transfer_ms": round(transfer, 3),
        "waiting_ms": [round(sum(d) / 1e3 - transfer, 3) for d in durations],
    }
    if all("origin_us" in c for c in configs) and durations[0]:
        ends = [[c["origin_us"] + end for _, end in k] for c, k in zip(configs, per_rank)]
        result["end_skew_us_median"] = round(statistics.median(max(e) - min(e) for e in zip(*ends)), 1)
    return result


def waits_table(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, ubatch count): ``split_waits`` plus its stretch over the unsplit step."""
    keyed = [{(c["mode"], c["num_ubatches"]): c for c in r["configs"]} for r in reports]
    rows = []
    for mode, n in keyed[0]:
        missing = [rank for rank, k in enumerate(keyed) if (mode, n) not in k]
        if missing:
            raise ValueError(f"configuration {mode} N={n} is missing from the report of rank(s) {missing}")
        rows.append({"mode": mode, "num_ubatches": n, **split_waits([k[(mode, n)] for k in keyed])})
    unsplit = {r["mode"]: r for r in rows if r["num_ubatches"] == 1}
    for row in rows:
        base = unsplit.get(row["mode"])
        if base is None or base["transfer_ms"] <= 0 or row is base:
            continue
        row["busy_stretch"] = round(statistics.mean(row["busy_ms"]) / statistics.mean(base["busy_ms"]), 3)
        row["transfer_stretch"] = round(row["transfer_ms"] / base["transfer_ms"], 3)
        c, m = base["compute_busy_ms"], base["transfer_ms"]
        ideal = ideal_speedup(c, m)
        speedup = base["wall_ms"] / row["wall_ms"]
        bound = base["wall_ms"] / max(row["compute_busy_ms"], row["transfer_ms"])
        row.update(
            speedup=round(speedup, 3),
            ideal_speedup=round(ideal, 3),
            bound_speedup=round(bound, 3),
            efficiency=round((speedup - 1) / (ideal - 1), 3),
            efficiency_bound=round((bound - 1) / (ideal - 1), 3),
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profiles", nargs="+", help="profile{tag}_rank{r}.json.gz of every rank of one run")
    args = p.parse_args()
    if len(args.profiles) < 2:
        p.error("give the profiles of at least two ranks")
    reports = []
    for path in args.profiles:
        with gzip.open(path, "rt") as f:
            reports.append(json.load(f))
    for row in waits_table(reports):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
