"""How close the expert GEMMs come to their bound: ``torch._grouped_mm`` (what ``MoEFFN`` runs)
against ``torch.bmm`` over the same experts with equal rows, for the gate/up and the down
projection, and what uneven rows per expert cost the grouped GEMM.

``python scripts/bench_expert_gemm.py [--experts 2,4,8] [--hidden 4096] [--inter 14336]`` on one
GPU; prints one JSON line per (experts, op, rows per expert) with the median time over
CUDA-event-timed repeats, the weight bytes per second and the TFLOP/s it implies. Fewer experts
per call is what an expert group of a pipelined mode runs (4 local experts in 2 groups: 2 per GEMM).

``--skew SIGMA`` (> 0) draws each call's rows per expert from a multinomial over experts whose
weights are log-normal with that sigma (``ubatch.bench.skew``) (the same total rows as equal ones), as a skewed router
deals them, and adds each call's ``fullest`` expert (its rows over the mean) and ``tile_fill``:
the rows a GEMM computes when each expert's rows are rounded up to whole tiles of 64 and 128
rows, over the real rows. A split's ubatch has fewer rows per expert, so its part-empty last
tiles weigh more: comparing a call at 2048 and at 512 rows per expert with the same skew says how
much of a split's expert-GEMM tax they are.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ubatch.bench.measure import event_times_ms
from ubatch.bench.skew import expert_counts, spread_fields


def time_ms(fn) -> float:
    return statistics.median(event_times_ms(fn, repeats=50))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", default="8", help="experts per GEMM call, comma-separated")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--rows", default="16,32,64,128,256", help="mean rows per expert, comma-separated")
    p.add_argument("--skew", type=float, default=0.0, help="log-normal sigma of the experts' shares (0: equal)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.skew < 0:
        p.error(f"--skew must be >= 0, got {args.skew}")
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA GPU")
    generator = torch.Generator().manual_seed(args.seed)
    for experts in map(int, args.experts.split(",")):
        rows = [int(r) for r in args.rows.split(",")]
        print_experts(experts, args.hidden, args.inter, rows, args.skew, generator)


def print_experts(e: int, h: int, i: int, rows_per_expert: list[int], skew: float, generator: torch.Generator) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    shapes = {"gate_up": (h, 2 * i), "down": (i, h)}
    weights = {name: torch.randn(e, n, k, device=dev, dtype=dt) * 0.01 for name, (k, n) in shapes.items()}
    for rows in rows_per_expert:
        counts = expert_counts(e, rows, skew, generator)
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(dev, torch.int32)
        spread = spread_fields(counts, rows) if skew else {}
        for name, (k, n) in shapes.items():
            w = weights[name]
            x = torch.randn(e * rows, k, device=dev, dtype=dt)
            timed = {"grouped_mm": time_ms(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets))}
            if not skew:
                xb = x.view(e, rows, k)
                timed["bmm"] = time_ms(lambda: torch.bmm(xb, w.transpose(1, 2)))
            gbytes = w.numel() * w.element_size() / 1e9
            tflop = 2 * e * rows * k * n / 1e12
            for op, ms in timed.items():
                row = {"op": op, "proj": name, "experts": e, "rows_per_expert": rows, "skew": skew, "ms": round(ms, 4)}
                row |= {"weight_TBps": round(gbytes / ms, 3), "TFLOPs": round(tflop / (ms / 1e3), 1), **spread}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
