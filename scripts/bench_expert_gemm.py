"""How close the expert GEMMs of a decode step come to reading their weights at HBM speed:
``torch._grouped_mm``, the Triton grouped GEMM (``ubatch.models.grouped_gemm``, at its own block
pick and at each of ``--blocks``) and ``torch.bmm`` over the same experts with equal rows, for the
gate/up and the down projection, at decode-sized rows per expert.

``python scripts/bench_expert_gemm.py [--experts 1,2,8] [--hidden 4096] [--inter 14336]`` on one
GPU; prints one JSON line per (experts, projection, rows per expert, op) with the median time over
CUDA-event-timed repeats and the weight bytes per second it implies. The rows sit in a buffer with
as many padding rows again past the last group's end, as the MoE layer's sorted rows do. Fewer
experts per call is what a rank of a wide expert-parallel world, or an expert group of a pipelined
mode, runs (8 experts over 8 ranks: 1 per GEMM).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ubatch.bench.measure import event_times_ms
from ubatch.bench.options import int_list
from ubatch.models import grouped_gemm

BLOCK_CHOICES = "64x64x64w4s4,64x128x64w4s4,128x64x64w4s4,128x128x64w8s4,64x256x64w8s3,128x256x64w8s3"


def parse_blocks(text: str) -> list[tuple[int, int, int, int, int]]:
    """``MxNxKwWARPSsSTAGES``, comma-separated, as (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    blocks = []
    for item in filter(None, text.split(",")):
        sizes, rest = item.split("w")
        warps, stages = rest.split("s")
        blocks.append((*map(int, sizes.split("x")), int(warps), int(stages)))
    return blocks


def time_ms(fn) -> float:
    return statistics.median(event_times_ms(fn, repeats=50))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int_list, default=[8], help="experts per GEMM call, comma-separated")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--rows", type=int_list, default=[16, 32, 64, 128, 256])
    p.add_argument("--blocks", type=parse_blocks, default=parse_blocks(BLOCK_CHOICES), help="Triton block sizes to try")
    args = p.parse_args()
    for experts in args.experts:
        print_experts(experts, args.hidden, args.inter, args.rows, args.blocks)


def print_experts(e: int, h: int, i: int, rows_per_expert: list[int], blocks: list) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    shapes = {"gate_up": (h, 2 * i), "down": (i, h)}
    weights = {name: torch.randn(e, n, k, device=dev, dtype=dt) * 0.01 for name, (k, n) in shapes.items()}
    for rows in rows_per_expert:
        offsets = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * rows
        for name, (k, _) in shapes.items():
            w = weights[name]
            x = torch.randn(2 * e * rows, k, device=dev, dtype=dt)
            real = x[: e * rows]
            reference = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)[: e * rows]
            ops = {
                "grouped_mm": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets),
                "bmm": lambda: torch.bmm(real.view(e, rows, k), w.transpose(1, 2)),
                "triton": lambda: grouped_gemm.grouped_gemm(x, w, offsets),
            }
            for b in blocks:
                ops["triton " + "x".join(map(str, b))] = lambda b=b: grouped_gemm.grouped_gemm(x, w, offsets, b)
            gbytes = w.numel() * w.element_size() / 1e9
            for op, fn in ops.items():
                if op.startswith("triton"):
                    err = (fn()[: e * rows].float() - reference.float()).abs().max().item()
                    if err > 1e-2 * reference.float().abs().max().item():
                        raise SystemExit(f"{op} differs from torch._grouped_mm by {err} ({e} experts, {rows} rows)")
                ms = time_ms(fn)
                line = {"op": op, "proj": name, "experts": e, "rows_per_expert": rows, "ms": round(ms, 4)}
                print(json.dumps({**line, "weight_TBps": round(gbytes / ms, 3)}), flush=True)
            print(json.dumps({"picked": grouped_gemm.pick_blocks(len(x), w.shape[1], k, e), "proj": name}), flush=True)


if __name__ == "__main__":
    main()
