"""The router's top-k: ``ubatch.models.router``'s batch-invariant Triton kernels against torch's
float32 GEMM, top-k and softmax (what the MoE layer ran before), at a split's row counts.

What it answers: what the invariant router costs per layer against cuBLAS (which picks its kernel
by row count), and whether its cost splits with the rows (the split's router tax). For each
(rows, experts) it prints one JSON line with both ops' median device times and whether the
kernels' rows at a quarter of the batch equal the same rows' in the whole batch bit for bit
(``invariant``) and the cuBLAS path's (``torch_invariant``; false where its kernel changed).

    python scripts/bench_router.py --rows 256,1024,4096 --experts 8,64    # one GPU, a few seconds
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from ubatch.bench.measure import event_times_ms
from ubatch.models.router import route_top_k


def torch_route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits, ids = torch.topk(F.linear(x.float(), router), top_k, dim=-1)
    return logits.softmax(dim=-1), ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="256,1024,4096", help="tokens per call, comma-separated")
    p.add_argument("--experts", default="8,64", help="router widths, comma-separated")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=8, help="picks per token (at most the experts)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA GPU")
    generator = torch.Generator().manual_seed(0)
    for experts in (int(e) for e in args.experts.split(",")):
        router = (torch.randn(experts, args.hidden, generator=generator) / args.hidden**0.5).cuda()
        top_k = min(args.top_k, experts)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.hidden, generator=generator).to("cuda", torch.bfloat16)
            row = {"rows": rows, "experts": experts, "hidden": args.hidden, "top_k": top_k}
            quarter = slice(rows // 4, rows // 2)
            for name, op in (("kernels", route_top_k), ("torch", torch_route)):
                row[f"{name}_ms"] = round(statistics.median(event_times_ms(lambda op=op: op(x, router, top_k))), 4)
                whole, part = op(x, router, top_k), op(x[quarter], router, top_k)
                same = torch.equal(whole[1][quarter], part[1]) and torch.equal(whole[0][quarter], part[0])
                row["invariant" if name == "kernels" else "torch_invariant"] = same
            kernels, reference = route_top_k(x, router, top_k), torch_route(x, router, top_k)
            row["ids_differ_from_torch"] = int((kernels[1] != reference[1]).any(dim=-1).sum())
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
