"""Can torch's built-in flash kernel (torch.nn.attention.varlen.varlen_attn, or the aten op under it) replace the torch
backend's masked SDPA on CUDA? One call per mixed batch, no mask, no per-shape plan. Checks, on
an H200 in bf16 (32 query / 8 KV heads, head dim 128): the signature torch has; the error of a
mixed batch (prompts, continuations, decodes) against masked math SDPA per request, for K/V read
from the paged cache through block_table (page sizes 16 and 256) and for K/V gathered to a
padded [R * L] layout with seqused_k; first-call and warm times for a series of new shapes.

    PYTHONPATH=. python benchmarks/h200x2/explore/varlen_builtin_flash.py
"""

import inspect
import json
import time

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None
flash = torch.ops.aten._flash_attention_forward.default
print(
    json.dumps(
        {
            "torch": torch.__version__,
            "varlen_attn": varlen_attn and str(inspect.signature(varlen_attn)),
            "aten_flash": str(flash._schema),
        }
    ),
    flush=True,
)
H, KVH, D = 32, 8, 128
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)


def batch(query_lens, context_lens, block_size, num_blocks=4096):
    """q [T, H, D], a paged cache [2, blocks, block_size, KVH, D], block table, seq lens, starts."""
    seq = [c + q for q, c in zip(query_lens, context_lens)]
    per_req = [-(-s // block_size) for s in seq]
    width = max(per_req)
    perm = torch.randperm(num_blocks, device=dev, generator=g)
    table = torch.zeros(len(seq), width, dtype=torch.int32, device=dev)
    used = 0
    for r, n in enumerate(per_req):
        table[r, :n] = perm[used : used + n]
        used += n
    cache = torch.randn(2, num_blocks, block_size, KVH, D, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(sum(query_lens), H, D, device=dev, dtype=torch.bfloat16, generator=g)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    return q, cache, table, torch.tensor(seq, dtype=torch.int32, device=dev), starts


def reference(q, cache, table, seq, starts):
    out = []
    for r in range(table.shape[0]):
        s, e, n = int(starts[r]), int(starts[r + 1]), int(seq[r])
        k, v = (cache[i][table[r]].flatten(0, 1)[:n] for i in (0, 1))
        qr = q[s:e].transpose(0, 1).unsqueeze(0)
        mask = torch.arange(n, device=dev)[None] <= (torch.arange(e - s, device=dev) + n - (e - s))[:, None]
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            o = F.scaled_dot_product_attention(
                qr.float(),
                k.transpose(0, 1)[None].float(),
                v.transpose(0, 1)[None].float(),
                attn_mask=mask,
                enable_gqa=True,
            )
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def paged(q, cache, table, seq, starts):
    """The aten op (torch 2.11's varlen_attn has no seqused_k / block_table); GQA is native."""
    return flash(
        q,
        cache[0],
        cache[1],
        starts,
        None,
        int((starts[1:] - starts[:-1]).max()),
        int(seq.max()),
        0.0,
        True,
        False,
        seqused_k=seq,
        block_table=table,
    )[0]


def gathered(q, cache, table, seq, starts):
    k, v = (cache[i].index_select(0, table.flatten()).flatten(0, 1) for i in (0, 1))  # [R * L, KVH, D]
    length = table.shape[1] * cache.shape[2]
    cu_k = torch.arange(0, (table.shape[0] + 1) * length, length, dtype=torch.int32, device=dev)
    return flash(q, k, v, starts, cu_k, int((starts[1:] - starts[:-1]).max()), length, 0.0, True, False, seqused_k=seq)[
        0
    ]


def timed(fn, *args):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3


mixed = ([300, 1, 1, 1, 17, 128, 1, 1], [0, 200, 31, 500, 40, 0, 7, 90])
for name, fn in (("paged", paged), ("gathered", gathered)):
    for block_size in (16, 256):
        args = batch(*mixed, block_size=block_size, num_blocks=4096 if block_size == 16 else 256)
        try:
            out = fn(*args)
        except Exception as exc:  # noqa: BLE001 - report what the kernel refuses
            print(json.dumps({"path": name, "block_size": block_size, "error": f"{type(exc).__name__}: {exc}"[:300]}))
            continue
        err = (out.float() - reference(*args)).abs().max().item()
        firsts, warms = [], []
        for step in range(12):  # new shapes every step: decodes join, contexts grow
            shape = ([1] * (8 + 3 * step) + [64 + 5 * step], [100 + 7 * step + r for r in range(8 + 3 * step)] + [0])
            a = batch(*shape, block_size=block_size, num_blocks=4096 if block_size == 16 else 512)
            firsts.append(timed(fn, *a)[1])
            warms.append(min(timed(fn, *a)[1] for _ in range(5)))
        print(
            json.dumps(
                {
                    "path": name,
                    "block_size": block_size,
                    "max_err_vs_math": round(err, 4),
                    "first_call_ms": [round(x, 2) for x in firsts],
                    "warm_ms": [round(x, 3) for x in warms],
                }
            ),
            flush=True,
        )
