"""flash-attn 4 reading the paged KV cache in place, against the torch backend's built-in varlen
flash kernel (which first gathers each request's blocks), on moe-bench attention (32 query / 8
KV heads, head dim 128, bf16). Per batch and block size: the first call (FA4 compiles its kernel
variant then), warm per-call time (CUDA events, median of 20) and the largest difference between
the two outputs. Batches: decode (1024 requests over 512 cached tokens, as the decode bench),
mixed (the mixed bench's 4096-token step: 1024 decodes, six prompts of 512) and prefill (eight
prompts of 512).

    PYTHONPATH=.:<flash-attn 4 site> python benchmarks/h200x2/explore/flash_attn4_paged.py
"""

import json
import statistics
import time

import torch

from ubatch.attention import build_attention_metadata
from ubatch.attention.backends import TorchBackend, load_flash_attn

H, KVH, D = 32, 8, 128
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
SHAPES = {
    "decode": ([1] * 1024, [513] * 1024),
    "mixed": ([1] * 1024 + [512] * 6, [513] * 1024 + [512] * 6),
    "prefill": ([512] * 8, [512] * 8),
}


def batch(query_lens, seq_lens, block):
    per_req = [-(-s // block) for s in seq_lens]
    table = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32)
    perm, used = torch.randperm(sum(per_req)), 0
    for r, n in enumerate(per_req):
        table[r, :n] = perm[used : used + n]
        used += n
    md = build_attention_metadata(
        query_lens, seq_lens, table, torch.zeros(sum(query_lens), dtype=torch.int64), device=dev
    )
    cache = torch.randn(2, sum(per_req), block, KVH, D, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(sum(query_lens), H, D, device=dev, dtype=torch.bfloat16, generator=g)
    return q, cache, md


def first_and_warm_ms(fn, repeats=20):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return out, first, statistics.median(times)


flash, failures = load_flash_attn()
print(json.dumps({"flash": None if flash is None else flash.version, "failures": failures}))
torch_backend = TorchBackend()
for block in (16, 128):
    for name, (query_lens, seq_lens) in SHAPES.items():
        q, cache, md = batch(query_lens, seq_lens, block)
        row = {"batch": name, "block_size": block, "tokens": md.num_actual_tokens}
        ref, row["torch_first_ms"], row["torch_ms"] = first_and_warm_ms(
            lambda: torch_backend.forward(q, cache, md, D**-0.5)
        )
        if flash is not None:
            out, row["fa4_first_ms"], row["fa4_ms"] = first_and_warm_ms(lambda: flash.forward(q, cache, md, D**-0.5))
            row["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
            row["torch_over_fa4"] = round(row["torch_ms"] / row["fa4_ms"], 2)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
