"""Per-call SDPA time (bool mask + GQA) when each call has a new key length, by backend."""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = torch.device("cuda", 0)
R, H, KVH, D = 32, 32, 8, 128
for name, backends in [
    ("default", None),
    ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
    ("math", [SDPBackend.MATH]),
    ("no-cudnn", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
]:
    for ql in (1, 3, 128):
        times = []
        for _rep in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for L in range(160, 160 + 16 * 20, 16):
                q = torch.randn(R, H, ql, D, dtype=torch.bfloat16, device=dev)
                k = torch.randn(R, KVH, L, D, dtype=torch.bfloat16, device=dev)
                v = torch.randn_like(k)
                mask = torch.ones(R, 1, ql, k.shape[2], dtype=torch.bool, device=dev)
                try:
                    if backends is None:
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                    else:
                        with sdpa_kernel(backends):
                            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                except RuntimeError as e:
                    print(name, ql, "error", str(e)[:120])
                    break
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / 20 * 1e3)
        print(f"{name:10s} q_len {ql:3d}: fresh shapes {times[0]:.3f} ms/call, repeated {times[-1]:.3f}", flush=True)
