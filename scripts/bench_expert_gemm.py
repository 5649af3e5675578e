"""How close the expert GEMMs of a decode step come to reading their weights at HBM speed:
``torch._grouped_mm`` (what ``MoEFFN`` runs) against ``torch.bmm`` over the same experts with
equal rows, for the gate/up and the down projection, at decode-sized rows per expert.

``python scripts/bench_expert_gemm.py [--experts 2,4,8] [--hidden 4096] [--inter 14336]`` on one
GPU; prints one JSON line per (experts, op, rows per expert) with the median time over
CUDA-event-timed repeats and the weight bytes per second it implies. Fewer experts per call is
what an expert group of a pipelined mode runs (4 local experts in 2 groups: 2 per GEMM).

``--counted`` times the down projection over a static buffer of which only the rows below the
experts' end offsets are real (what a graph-replayed step holds): the plain GEMM over the whole
buffer (``F.linear``, one expert) or ``torch._grouped_mm`` against ``counted_gemm``'s kernel in
each of its candidate block configurations, with the FLOP rate over the real rows.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from ubatch.bench.measure import event_times_ms
from ubatch.models import counted_gemm

COUNTED_CONFIGS = [  # (block M, N, K, warps, stages)
    (64, 128, 64, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (64, 64, 128, 4, 3),
]
COUNTED_SHAPES = [  # (experts, real rows per expert, buffer rows, inner, hidden)
    (1, 512, 794, 14336, 4096),  # moe-bench as one rank of eight, 256 decode tokens unsplit
    (1, 256, 397, 14336, 4096),  # one ubatch of its two-way split
    (1, 128, 199, 14336, 4096),
    (1, 1024, 1024, 14336, 4096),
    (8, 256, 3072, 2048, 4096),  # deepseek-bench as one rank of eight, 256 decode tokens
    (8, 128, 1536, 2048, 4096),
]


def time_ms(fn) -> float:
    return statistics.median(event_times_ms(fn, repeats=50))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", default="8", help="experts per GEMM call, comma-separated")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--rows", default="16,32,64,128,256")
    p.add_argument("--counted", action="store_true", help="the counted down projection against torch's")
    args = p.parse_args()
    if args.counted:
        for shape in COUNTED_SHAPES:
            print_counted(*shape)
        return
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


def print_counted(e: int, real: int, buffer: int, inner: int, hidden: int) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(buffer, inner, device=dev, dtype=dt)
    w = torch.randn(e, hidden, inner, device=dev, dtype=dt) * 0.01
    ends = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * real
    timings = {"grouped_mm": time_ms(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=ends))}
    if e == 1:
        timings["plain_over_buffer"] = time_ms(lambda: F.linear(x, w[0]))
    want = torch._grouped_mm(x, w.transpose(1, 2), offs=ends)[: e * real].float()
    for config in COUNTED_CONFIGS:
        out = counted_gemm.grouped_rows_matmul(x, w, ends, config=config)[: e * real].float()
        error = ((out - want).abs().max() / want.abs().max()).item()
        ms = time_ms(lambda: counted_gemm.grouped_rows_matmul(x, w, ends, config=config))
        timings["counted" + "x".join(map(str, config)) + f"(err {error:.0e})"] = ms
    tflop = 2 * e * real * inner * hidden / 1e12
    for op, ms in timings.items():
        print(
            json.dumps(
                {
                    "op": op,
                    "experts": e,
                    "real_rows": e * real,
                    "buffer_rows": buffer,
                    "inner": inner,
                    "ms": round(ms, 4),
                    "real_TFLOPs": round(tflop / ms * 1e3, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
