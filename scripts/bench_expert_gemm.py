"""How close the expert GEMMs of a decode step come to reading their weights at HBM speed:
``torch._grouped_mm`` (what ``MoEFFN`` runs) against ``torch.bmm`` over the same experts with
equal rows, for the gate/up and the down projection, at decode-sized rows per expert.

``python scripts/bench_expert_gemm.py [--experts 2,4,8] [--hidden 4096] [--inter 14336]`` on one
GPU; prints one JSON line per (experts, op, rows per expert) with the median time over
CUDA-event-timed repeats and the weight bytes per second it implies. Fewer experts per call is
what an expert group of a pipelined mode runs (4 local experts in 2 groups: 2 per GEMM).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ubatch.bench.measure import event_times_ms


def time_ms(fn) -> float:
    return statistics.median(event_times_ms(fn, repeats=50))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", default="8", help="experts per GEMM call, comma-separated")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--rows", default="16,32,64,128,256")
    args = p.parse_args()
    for experts in map(int, args.experts.split(",")):
        print_experts(experts, args.hidden, args.inter, [int(r) for r in args.rows.split(",")])


def print_experts(e: int, h: int, i: int, rows_per_expert: list[int]) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    shapes = {"gate_up": (h, 2 * i), "down": (i, h)}
    weights = {name: torch.randn(e, n, k, device=dev, dtype=dt) * 0.01 for name, (k, n) in shapes.items()}
    for rows in rows_per_expert:
        offsets = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * rows
        for name, (k, _) in shapes.items():
            w = weights[name]
            x = torch.randn(e * rows, k, device=dev, dtype=dt)
            xb = x.view(e, rows, k)
            grouped = time_ms(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets))
            batched = time_ms(lambda: torch.bmm(xb, w.transpose(1, 2)))
            gbytes = w.numel() * w.element_size() / 1e9
            for op, ms in (("grouped_mm", grouped), ("bmm", batched)):
                print(
                    json.dumps(
                        {
                            "op": op,
                            "proj": name,
                            "experts": e,
                            "rows_per_expert": rows,
                            "ms": round(ms, 4),
                            "weight_TBps": round(gbytes / ms, 3),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
