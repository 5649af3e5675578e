"""Measure the scheduler's hand-off cost: per yield, and fixed per call (scheduler and wrapper).

Targets on a 2-core CPU machine: at most 10 us per yield and 150 us per call (what keeps the
hand-off small beside a layer's compute).
The per-yield cost is the slope of call time against yields per ubatch; the fixed cost is the
call time with no yield, minus a direct call of the same work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ubatch import set_forward_context
from ubatch.bench.outputs import check_outputs
from ubatch.scheduler import UBatchScheduler, yield_ubatch
from ubatch.slicing import split_batch
from ubatch.wrapper import UBatchWrapper

TARGET_YIELD_US = 10.0
TARGET_CALL_US = 150.0


def _median_us(fn, repeats: int) -> float:
    for _ in range(max(10, repeats // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _task(yields: int):
    def task():
        for _ in range(yields):
            yield_ubatch()

    return task


def measure(num_ubatches: int, repeats: int) -> dict:
    sched = UBatchScheduler(num_ubatches, "cpu")
    few, many = 0, 64
    t_few = _median_us(lambda: sched.run([_task(few)] * num_ubatches), repeats)
    t_many = _median_us(lambda: sched.run([_task(many)] * num_ubatches), repeats)
    per_yield = (t_many - t_few) / (many * num_ubatches)

    x = torch.randn(64, 8)
    wrapper = UBatchWrapper(lambda t: t, num_ubatches=num_ubatches, device="cpu")
    slices = split_batch([16] * 4, num_ubatches)
    direct = _median_us(lambda: x.clone(), repeats)

    def wrapped():
        with set_forward_context(None, ubatch_slices=slices):
            wrapper(x)

    t_wrapper = _median_us(wrapped, repeats)
    return {
        "num_ubatches": num_ubatches,
        "per_yield_us": round(per_yield, 2),
        "scheduler_call_us": round(t_few, 1),
        "wrapper_call_us": round(t_wrapper - direct, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    check_outputs(parser, files={"--out": args.out})
    rows = [measure(n, args.repeats) for n in (2, 3, 4)]
    print(f"{'N':>3} {'per yield (us)':>15} {'scheduler call (us)':>20} {'wrapper call (us)':>18}")
    for r in rows:
        print(f"{r['num_ubatches']:>3} {r['per_yield_us']:>15} {r['scheduler_call_us']:>20} {r['wrapper_call_us']:>18}")
    worst_yield = max(r["per_yield_us"] for r in rows)
    worst_call = max(r["wrapper_call_us"] for r in rows)
    print(
        f"targets: <= {TARGET_YIELD_US} us per yield ({'met' if worst_yield <= TARGET_YIELD_US else 'MISSED'}), "
        f"<= {TARGET_CALL_US} us per call ({'met' if worst_call <= TARGET_CALL_US else 'MISSED'})"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": rows, "torch": torch.__version__}, f, indent=2)


if __name__ == "__main__":
    main()
