"""Where does first_use_cost's cold pass spend its time? Every SDPA call of both passes, timed
with a device sync around it, grouped by shape and mask kind; then the same pass with the SDPA
backends restricted (argv: default | no_cudnn), so the cost of cuDNN's plans shows beside it.
Run (first_use_sdpa_shapes.log) before the torch backend kept cuDNN out of eager calls: it is
the evidence for that change. cold 7.6 s with cuDNN (6.3 s of it first calls of 63 shapes),
1.4 s without; warm 0.75 s against 0.85 s.

    PYTHONPATH=. python benchmarks/h200x2/explore/first_use_sdpa_shapes.py default
"""

import collections
import contextlib
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, "scripts")
import first_use_cost  # noqa: E402

real_sdpa = F.scaled_dot_product_attention
calls = []


def timed_sdpa(q, k, v, **kw):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = real_sdpa(q, k, v, **kw)
    torch.cuda.synchronize()
    kind = "causal" if kw.get("is_causal") else "masked" if kw.get("attn_mask") is not None else "plain"
    calls.append(((tuple(q.shape), tuple(k.shape), kind), time.perf_counter() - start))
    return out


F.scaled_dot_product_attention = timed_sdpa
mode = sys.argv[1]
choice = (
    contextlib.nullcontext()
    if mode == "default"
    else sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
)
with choice:
    row = first_use_cost.main(["--sdpa", "default"])
half = len(calls) // 2
for name, part in (("cold", calls[:half]), ("warm", calls[half:])):
    by_shape = collections.defaultdict(list)
    for key, s in part:
        by_shape[key].append(s)
    kinds = collections.Counter(k[2] for k, _ in part)
    first = sum(v[0] for v in by_shape.values())
    rest = sum(sum(v[1:]) for v in by_shape.values())
    slow = sorted(((v[0], k) for k, v in by_shape.items()), reverse=True)[:5]
    print(
        json.dumps(
            {
                "mode": mode,
                "pass": name,
                "calls": len(part),
                "shapes": len(by_shape),
                "kinds": kinds,
                "first_call_s": round(first, 3),
                "later_calls_s": round(rest, 3),
                "slowest_first_calls": [(round(s * 1e3, 1), str(k)) for s, k in slow],
            }
        )
    )
