"""How fast a decode step's attention reads the paged KV cache: ubatch's Triton decode kernel
(``ubatch.attention.decode_kernel``) against flash-attn's paged forward (where installed), at
decode batch sizes, and the share of the GPU's measured copy rate each reaches.

``python scripts/bench_decode_attention.py [--requests 64,256,1024] [--context 512]
[--query-len 3]`` on one GPU (moe-bench's attention by default: 32 query heads, 8 KV heads of
128, pages of 128 tokens; ``--query-len`` k + 1 times a step verifying k drafted tokens);
prints one JSON line per (requests, kernel) with the median time over CUDA-event-timed repeats,
the K/V bytes per second it implies, and the largest difference from torch's reference on the
first request, so a fast wrong kernel cannot pass unnoticed.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from ubatch.attention.backends import load_flash_attn
from ubatch.attention.decode_kernel import decode_attention
from ubatch.attention.metadata import build_attention_metadata
from ubatch.bench.measure import event_times_ms
from ubatch.bench.roofline import device_ceilings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="64,256,1024", help="decode requests per step, comma-separated")
    p.add_argument("--context", type=int, default=512, help="cached tokens per request (its queries included)")
    p.add_argument("--query-len", type=int, default=1, help="query tokens per request, causal")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--splits", default="auto", help="the decode kernel's num_splits: auto, or comma-separated ints")
    args = p.parse_args()
    splits = [None] if args.splits == "auto" else [int(s) for s in args.splits.split(",")]
    for requests in map(int, args.requests.split(",")):
        bench(requests, args, splits)


def bench(requests: int, args: argparse.Namespace, splits: list[int | None]) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    blocks_per_req = -(-args.context // args.block_size)
    num_blocks = requests * blocks_per_req
    cache = torch.randn(2, num_blocks, args.block_size, args.kv_heads, args.head_dim, device=dev, dtype=dt)
    table = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(requests, blocks_per_req)
    seq_lens = torch.full((requests,), args.context, device=dev, dtype=torch.int32)
    u = args.query_len
    q = torch.randn(requests * u, args.heads, args.head_dim, device=dev, dtype=dt)
    scale = args.head_dim**-0.5
    kv_bytes = 2 * requests * args.context * args.kv_heads * args.head_dim * cache.element_size()
    expected = reference_first_request(q[:u], cache, table, args.context, scale)
    kernels = {
        f"triton splits={s or 'auto'}": lambda s=s: decode_attention(
            q, cache, table, seq_lens, scale, query_len=u, num_splits=s
        )
        for s in splits
    }
    flash, _ = load_flash_attn()
    if flash is not None:
        slots = torch.zeros(requests * u, dtype=torch.int64, device=dev)
        md = build_attention_metadata([u] * requests, [args.context] * requests, table, slots)
        kernels[f"flash_attn_{flash.version}"] = lambda: flash.forward(q, cache, md, scale)
    ceilings = device_ceilings(dev)
    for name, fn in kernels.items():
        error = (fn()[:u].float() - expected).abs().max().item()
        ms = statistics.median(event_times_ms(fn, repeats=50))
        tbps = kv_bytes / ms / 1e9
        row = {"requests": requests, "query_len": u, "kernel": name, "ms": round(ms, 4), "kv_TBps": round(tbps, 3)}
        row["max_error"] = error
        if ceilings is not None:
            row["of_copy_rate"] = round(tbps * 1e3 / ceilings.copy_gbps, 3)
        print(json.dumps(row), flush=True)


def reference_first_request(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, context: int, scale: float
) -> torch.Tensor:
    """Request 0's attention in float32 from its gathered keys and values, for its query tokens
    ``q`` [u, heads, head_dim], the last u of its ``context`` keys, causal."""
    k, v = (cache[i, table[0].long()].flatten(0, 1)[:context].float() for i in (0, 1))
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    u = q.shape[0]
    seen = torch.arange(context, device=q.device) <= (context - u + torch.arange(u, device=q.device))[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=seen, scale=scale)
    return out.transpose(0, 1)


if __name__ == "__main__":
    main()
