"""Masked decode attention (1 query per request, keys masked past each request's length, 32 query
/ 8 KV heads, bf16) on an H200, warm, per path: cuDNN (torch's pick), math with enable_gqa, and
efficient attention on K/V expanded to 32 heads (it has no GQA kernel). Which path should eager
masked runs take once cuDNN's per-shape plans are ruled out?

    PYTHONPATH=. python benchmarks/h200x2/explore/sdpa_masked_decode_paths.py

Result (sdpa_masked_decode_paths.log): cuDNN 0.06-0.49 ms, math 0.20-25 ms, expanded efficient
0.08-13 ms from 8 x 272 to 1024 x 512 (requests x keys). Warm, math loses 3-51x and expanded
efficient 1.3-27x, so masked runs keep cuDNN and its plans.
"""

import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed_ms(fn, repeats=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def paths(reqs, keys, heads=32, kv_heads=8, dim=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(reqs, heads, 1, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(reqs, kv_heads, keys, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
    lens = torch.randint(1, keys + 1, (reqs,), device="cuda", generator=g)
    mask = (torch.arange(keys, device="cuda") < lens[:, None]).view(reqs, 1, 1, keys)

    def gqa(backend):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def expanded_efficient():
        group = heads // kv_heads
        ke, ve = (t.repeat_interleave(group, dim=1) for t in (k, v))
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)

    ref = gqa(SDPBackend.MATH).float()
    row = {"reqs": reqs, "keys": keys}
    for name, fn in (
        ("cudnn", lambda: gqa(SDPBackend.CUDNN_ATTENTION)),
        ("math", lambda: gqa(SDPBackend.MATH)),
        ("efficient_expanded", expanded_efficient),
    ):
        err = (fn().float() - ref).abs().max().item()
        row[name + "_ms"] = round(timed_ms(fn), 4)
        row[name + "_max_err"] = round(err, 4)
    return row


for reqs, keys in ((8, 272), (32, 288), (256, 512), (1024, 512)):
    print(json.dumps(paths(reqs, keys)), flush=True)
