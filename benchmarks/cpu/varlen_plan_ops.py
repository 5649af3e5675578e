"""Aten ops of a whole Attention layer (KV write, backend, padding) in each layer of one step, on
the torch backend's varlen path with a null kernel (CPU), and the host time of building the
varlen layout alone. Run against a checkout: ``python benchmarks/cpu/varlen_plan_ops.py REPO``
(``varlen_plan_ops.log``: the commit before the per-step layout, and after)."""

import sys
import time

root = sys.argv[1]
sys.path.insert(0, root)
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ubatch.attention import Attention, PagedKVCache, backends, build_attention_metadata, varlen
from ubatch.context import set_forward_context


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def run(query_lens, ctx_lens, num_layers=4, block_size=16, heads=8, kvh=2, d=64):
    seq = [c + n for c, n in zip(ctx_lens, query_lens)]
    nb = [-(-s // block_size) for s in seq]
    width, total = max(nb), sum(nb) + 1
    ids = (torch.randperm(total - 1) + 1).tolist()
    rows, at, slots = [], 0, []
    for r, b in enumerate(nb):
        rows.append(ids[at : at + b] + [0] * (width - b))
        at += b
        slots += [rows[r][p // block_size] * block_size + p % block_size for p in range(ctx_lens[r], seq[r])]
    md = build_attention_metadata(query_lens, seq, torch.tensor(rows, dtype=torch.int32), torch.tensor(slots))
    reg = {}
    names = [f"l{i}" for i in range(num_layers)]
    layers = [Attention(heads, d, kvh, layer_name=n, registry=reg, backend="torch") for n in names]
    cache = PagedKVCache(
        names, num_blocks=total, block_size=block_size, num_kv_heads=kvh, head_dim=d, dtype=torch.float32, device="cpu"
    )
    for name, layer in zip(names, layers):
        layer.kv_cache = cache[name]
    T = sum(query_lens)
    q, k, v = torch.randn(T, heads * d), torch.randn(T, kvh * d), torch.randn(T, kvh * d)
    counts = []
    with set_forward_context({n: md for n in names}, no_compile_layers=reg):
        for layer in layers:
            with Count() as c:
                layer(q, k, v)
            counts.append(c.n)
    return counts


def plan_host_us(query_lens, ctx_lens, block_size=16, reps=20):
    seq = [c + n for c, n in zip(ctx_lens, query_lens)]
    nb = [-(-s // block_size) for s in seq]
    width = max(nb)
    table = torch.zeros(len(seq), width, dtype=torch.int32)
    md = build_attention_metadata(query_lens, seq, table, torch.zeros(sum(query_lens), dtype=torch.int64))
    f = getattr(varlen, "varlen_plan", None)
    if f is None:
        return None
    t0 = time.perf_counter()
    for _ in range(reps):
        f(md, block_size)
    return (time.perf_counter() - t0) / reps * 1e6


with (
    mock.patch.object(varlen, "_FLASH_FORWARD", lambda q, *a, **kw: (q,)),
    mock.patch.object(backends, "builtin_flash_supports", lambda q: True),
    torch.inference_mode(),
):
    print("mixed 6 reqs:", run([1, 1, 20, 5, 1, 1], [30, 12, 0, 40, 7, 9]))
    print("uniform 64 decodes:", run([1] * 64, [33] * 64))
    big = ([1] * 512 + [512] * 6 + [1] * 512, [512] * 512 + [0] * 6 + [512] * 512)
    print("1024 dec + 6x512:", run(*big, num_layers=2, heads=1, kvh=1, d=8))
    us = plan_host_us(*big)
    print("varlen_plan alone at 1030 reqs (CPU tensors):", us and f"{us:.0f} us")
    us = plan_host_us([1, 1, 20, 5, 1, 1], [30, 12, 0, 40, 7, 9], reps=500)
    print("varlen_plan alone at 6 reqs:", us and f"{us:.1f} us")
