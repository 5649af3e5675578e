"""How much communication hides under GEMM-heavy compute, per SM-partition mode and comm_sms.

Compute is a loop of bf16 GEMMs (M x K @ K x N); communication is (a) an NCCL all-to-all,
(b) an NCCL all-reduce (both need two or more ranks) or (c) an on-device copy kernel (an
SM-driven memory-bound kernel, like NCCL's; works on one rank). For each mode (none, green,
cooperative) and comm_sms it reports compute alone (C), communication alone (M), both launched
together (T), the hidden fraction of communication (C + M - T) / min(C, M) clipped to [0, 1], the
compute slowdown (compute's span while overlapped / compute alone in mode "none", full GPU), the
communication stretch (its span while overlapped / M alone, same mode: a ubatched step's
``comm_stretch``, isolated from the model) and the speedup over running "none" serially
((C_none + M_none) / T).

    torchrun --nproc-per-node 2 scripts/bench_sm.py --out sm.json   # all three, two GPUs
    python scripts/bench_sm.py --out sm.json                        # copy only, one GPU
    python scripts/bench_sm.py --dry-run --out sm.json              # tiny, CPU: code paths only

The number of communication ops per run is calibrated once (mode "none", M ~ C) and agreed
across ranks, so every rank issues the same collectives and every mode moves the same data.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ubatch.bench.outputs import check_outputs  # noqa: E402
from ubatch.sm import SMPartition  # noqa: E402

logger = logging.getLogger("bench_sm")

COMM_KINDS = ("copy", "all_to_all", "all_reduce")  # copy first: its rows exist even if NCCL fails
MODES = ("none", "green", "cooperative")
MAX_COMM_REPS = 200


@dataclass
class Row:
    comm: str
    mode: str
    comm_sms: int | None
    effective_mode: str
    partition: str
    compute_ms: float
    comm_ms: float
    both_ms: float
    hidden: float
    slowdown: float
    comm_stretch: float
    speedup: float


@dataclass
class Sizes:
    m: int
    k: int
    n: int
    gemm_reps: int
    tokens: int
    hidden: int


def hidden_fraction(compute_ms: float, comm_ms: float, both_ms: float) -> float:
    """Share of the shorter of compute and communication that ran under the other, in [0, 1]."""
    shorter = min(compute_ms, comm_ms)
    if shorter <= 0:
        return 0.0
    return min(1.0, max(0.0, (compute_ms + comm_ms - both_ms) / shorter))


def interleave(counts: Sequence[int]) -> list[int]:
    """Job indices in launch order, spreading each job's steps evenly over the whole run."""
    slots = [((i + 0.5) / count, job) for job, count in enumerate(counts) for i in range(count)]
    return [job for _, job in sorted(slots)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON here (rank 0)")
    parser.add_argument(
        "--comm", default=None, help=f"comma list of {','.join(COMM_KINDS)} (default: all the world size allows)"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of modes")
    parser.add_argument("--comm-sms", default="8,16,32", help="comma list of comm SM budgets")
    parser.add_argument("--m", type=int, default=4096, help="GEMM rows (tokens)")
    parser.add_argument("--k", type=int, default=7168, help="GEMM K = N")
    parser.add_argument("--gemm-reps", type=int, default=8, help="GEMMs per compute run")
    parser.add_argument("--tokens", type=int, default=4096, help="rows of the communicated tensor")
    parser.add_argument("--hidden", type=int, default=7168, help="columns of the communicated tensor (bf16)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: exercise the code paths")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    args.modes = _names(args.modes, MODES, "mode")
    args.comm_sms = [int(v) for v in args.comm_sms.split(",") if v]
    if args.comm is not None:
        args.comm = _names(args.comm, COMM_KINDS, "comm kind")
    if args.dry_run:
        args.m = args.k = args.tokens = args.hidden = 64
        args.gemm_reps, args.repeats = 2, 1
    return args


def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what}(s) {unknown}; choose from {', '.join(allowed)}")
    return names


def format_table(rows: Sequence[Row]) -> str:
    """A markdown table of the rows (the CLI prints it)."""
    head = (
        "| comm | mode | comm_sms | effective | SMs compute/comm | C ms | M ms | both ms | hidden "
        "| compute slowdown | comm stretch | speedup vs serial none |"
    )
    lines = [head, "|" + " - |" * (head.count("|") - 1)]
    for r in rows:
        sms = "-" if r.comm_sms is None else str(r.comm_sms)
        lines.append(
            f"| {r.comm} | {r.mode} | {sms} | {r.effective_mode} | {r.partition} | {r.compute_ms:.2f} | "
            f"{r.comm_ms:.2f} | {r.both_ms:.2f} | {r.hidden:.0%} | {r.slowdown:.2f}x | {r.comm_stretch:.2f}x | "
            f"{r.speedup:.2f}x |"
        )
    return "\n".join(lines)


class Workload:
    """GEMM compute steps and communication steps on preallocated buffers (no allocation in runs)."""

    def __init__(self, sizes: Sizes, device: torch.device) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.device = device
        self.sizes = sizes
        self.a = torch.randn(sizes.m, sizes.k, device=device, dtype=dtype)
        self.b = torch.randn(sizes.k, sizes.n, device=device, dtype=dtype)
        self.c = torch.empty(sizes.m, sizes.n, device=device, dtype=dtype)
        self.src = torch.randn(sizes.tokens, sizes.hidden, device=device, dtype=dtype)
        self.dst = torch.empty_like(self.src)

    def compute_step(self) -> None:
        torch.mm(self.a, self.b, out=self.c)

    def comm_step(self, kind: str, group: Any) -> Callable[[], None]:
        """One communication op of ``kind`` on ``group``."""
        if kind == "copy":
            return lambda: torch.mul(self.src, 1, out=self.dst)
        if kind == "all_to_all":
            return lambda: dist.all_to_all_single(self.dst, self.src, group=group)
        return lambda: dist.all_reduce(self.dst, group=group)


@dataclass
class Job:
    stream: Any
    step: Callable[[], None]
    count: int


def run_jobs(jobs: Sequence[Job], device: torch.device) -> tuple[float, list[float]]:
    """Launch the jobs' steps interleaved, each on its stream; (total ms, each job's span ms)."""
    if device.type != "cuda":
        spans = [0.0] * len(jobs)
        begin = time.perf_counter()
        for j in interleave([job.count for job in jobs]):
            t0 = time.perf_counter()
            jobs[j].step()
            spans[j] += (time.perf_counter() - t0) * 1e3
        return (time.perf_counter() - begin) * 1e3, spans
    origin = torch.cuda.current_stream(device)
    start, end = _event(), _event()
    starts, ends = [_event() for _ in jobs], [_event() for _ in jobs]
    start.record(origin)
    for job, ev in zip(jobs, starts):
        job.stream.wait_event(start)
        ev.record(job.stream)
    for j in interleave([job.count for job in jobs]):
        with torch.cuda.stream(jobs[j].stream):
            jobs[j].step()
    for job, ev in zip(jobs, ends):
        ev.record(job.stream)
        origin.wait_event(ev)
    end.record(origin)
    end.synchronize()
    return start.elapsed_time(end), [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def measure(jobs: Sequence[Job], device: torch.device, repeats: int) -> tuple[float, list[float]]:
    """Median total and per-job spans over ``repeats`` runs, after one warm-up run.

    Ranks meet at a barrier before each run, so a collective's time is not a peer's late start.
    """
    runs = []
    for _ in range(repeats + 1):
        if dist.is_initialized():
            dist.barrier()
        runs.append(run_jobs(jobs, device))
    runs = runs[1:]
    total = statistics.median(r[0] for r in runs)
    spans = [statistics.median(r[1][j] for r in runs) for j in range(len(jobs))]
    return total, spans


def slowest_rank(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over ranks (a step is as slow as its slowest rank)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@dataclass
class Case:
    """One mode / comm_sms setting with its streams, made once and reused for every comm kind."""

    mode: str
    comm_sms: int | None
    part: SMPartition
    self_check: bool
    compute_stream: Any
    comm_stream: Any


def make_case(mode: str, comm_sms: int | None, device: torch.device) -> Case:
    part = SMPartition(mode, comm_sms, device)
    ok = part.self_check()  # before make_streams: a failed check degrades the streams to "none"
    compute, comm = part.make_streams(1)
    return Case(mode, comm_sms, part, ok, None if compute is None else compute[0], comm)


def calibrate_comm_reps(work: Workload, kind: str, case: Case, repeats: int) -> int:
    """Ops per communication run so that M ~ C with default streams; equal on every rank."""
    compute, _ = measure([Job(case.compute_stream, work.compute_step, work.sizes.gemm_reps)], work.device, repeats)
    one_op, _ = measure(
        [Job(case.comm_stream, work.comm_step(kind, case.part.comm_group(None)), 1)], work.device, repeats
    )
    reps = max(1, min(MAX_COMM_REPS, round(compute / max(one_op, 1e-6))))
    return int(slowest_rank([float(reps)], work.device)[0])


def bench_case(
    work: Workload, kind: str, case: Case, comm_reps: int, repeats: int
) -> tuple[float, float, float, float, float]:
    """(C, M, T, compute span and communication span while overlapped) in ms for one case,
    slowest rank."""
    compute = Job(case.compute_stream, work.compute_step, work.sizes.gemm_reps)
    comm = Job(case.comm_stream, work.comm_step(kind, case.part.comm_group(None)), comm_reps)
    with case.part.compute_context():
        c_ms, _ = measure([compute], work.device, repeats)
        m_ms, _ = measure([comm], work.device, repeats)
        t_ms, spans = measure([compute, comm], work.device, repeats)
    return tuple(slowest_rank([c_ms, m_ms, t_ms, *spans], work.device))


def run(
    args: argparse.Namespace, device: torch.device, world_size: int, report: Callable[[list[Row], dict[str, Any]], None]
) -> list[Row]:
    """Every comm kind x case; ``report`` gets the rows so far after each kind (a later NCCL
    failure leaves the earlier kinds' results on disk)."""
    sizes = Sizes(args.m, args.k, args.k, args.gemm_reps, args.tokens, args.hidden)
    work = Workload(sizes, device)
    kinds = args.comm or [k for k in COMM_KINDS if world_size > 1 or k == "copy"]
    if world_size < 2 and any(k != "copy" for k in kinds):
        raise SystemExit("all_to_all and all_reduce need two or more ranks (run under torchrun)")
    baseline = make_case("none", None, device)
    cases = [
        make_case(mode, sms, device) for mode in args.modes for sms in ([None] if mode == "none" else args.comm_sms)
    ]
    checks = {f"{c.mode}:{c.comm_sms}": {"passed": c.self_check, "reason": c.part.reason} for c in cases}
    rows: list[Row] = []
    reps_by_kind: dict[str, int] = {}
    for kind in kinds:
        reps_by_kind[kind] = reps = calibrate_comm_reps(work, kind, baseline, args.repeats)
        c0, m0, *_ = bench_case(work, kind, baseline, reps, args.repeats)
        for case in cases:
            c, m, t, span, comm_span = bench_case(work, kind, case, reps, args.repeats)
            split = case.part.partition_sms()
            rows.append(
                Row(
                    kind,
                    case.mode,
                    case.comm_sms,
                    case.part.effective_mode,
                    "-" if split is None else f"{split[0]}/{split[1]}",
                    c,
                    m,
                    t,
                    hidden_fraction(c, m, t),
                    span / c0 if c0 > 0 else 0.0,
                    comm_span / m if m > 0 else 0.0,
                    (c0 + m0) / t if t > 0 else 0.0,
                )
            )
        report(rows, {"comm_reps": reps_by_kind, "self_checks": checks})
    return rows


def _init_distributed(dry_run: bool) -> tuple[torch.device, int, int]:
    """(device, rank, world size); NCCL with one GPU per rank under torchrun."""
    if dry_run or not torch.cuda.is_available():
        return torch.device("cpu"), 0, 1
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl", device_id=device)
        return device, dist.get_rank(), world_size
    return device, 0, 1


def write_report(
    path: Path | None,
    args: argparse.Namespace,
    world_size: int,
    device: torch.device,
    rows: list[Row],
    extra: dict[str, Any],
) -> None:
    """The JSON result file: configuration, calibration, self-checks and rows."""
    if path is None:
        return
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.update(
        world_size=world_size,
        torch=torch.__version__,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, **extra, "rows": [asdict(r) for r in rows]}, indent=2))


def main(argv: Sequence[str] | None = None) -> list[Row]:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    device, rank, world_size = _init_distributed(args.dry_run)

    def report(rows: list[Row], extra: dict[str, Any]) -> None:
        if rank == 0:
            write_report(args.out, args, world_size, device, rows, extra)

    try:
        rows = run(args, device, world_size, report)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(format_table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
