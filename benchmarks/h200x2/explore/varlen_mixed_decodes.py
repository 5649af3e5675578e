"""Why the mixed bench steps got slower on the varlen flash path, and whether giving the decodes
a call of their own fixes it. The bench's mixed batch (moe-bench attention: 32 query / 8 KV
heads, head dim 128, bf16, blocks of 16): a quarter of the tokens are decodes over 512 cached
tokens, placed first, the rest prompts of 512. Times one layer's attention, warm (CUDA events,
median of 20): the whole batch in one flash call, the decodes split off (what the torch backend
does now), the SDPA runs (cuDNN, plans built in the warm-up), and the parts alone.

    PYTHONPATH=. python benchmarks/h200x2/explore/varlen_mixed_decodes.py
"""

import json
import statistics

import torch

from ubatch.attention import build_attention_metadata
from ubatch.attention.backends import TorchBackend
from ubatch.attention.varlen import _attend, packed_slots, varlen_flash_attention

H, KVH, D, BLOCK = 32, 8, 128, 16
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)


def mixed_batch(tokens: int, prompt_len: int = 512, context: int = 512):
    decodes = tokens // 4
    query_lens = [1] * decodes + [prompt_len] * ((tokens - decodes) // prompt_len)
    seq_lens = [context + 1] * decodes + [prompt_len] * (len(query_lens) - decodes)
    per_req = [-(-s // BLOCK) for s in seq_lens]
    table = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32)
    perm, used = torch.randperm(sum(per_req)), 0
    for r, n in enumerate(per_req):
        table[r, :n] = perm[used : used + n]
        used += n
    md = build_attention_metadata(
        query_lens, seq_lens, table, torch.zeros(sum(query_lens), dtype=torch.int64), device=dev
    )
    cache = torch.randn(2, sum(per_req), BLOCK, KVH, D, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(sum(query_lens), H, D, device=dev, dtype=torch.bfloat16, generator=g)
    return q, cache, md, decodes


def one_call(q, cache, md):
    blocks, cum_k, max_k = packed_slots(md.block_table, md.seq_lens, md.seq_lens_cpu, BLOCK)
    return _attend(q, cache, blocks, md.query_start_loc, cum_k, md.max_query_len, max_k, md.seq_lens, True, D**-0.5)


def gather_only(q, cache, md):
    blocks, _, _ = packed_slots(md.block_table, md.seq_lens, md.seq_lens_cpu, BLOCK)
    return [cache[i].index_select(0, blocks) for i in (0, 1)]


def median_ms(fn, *args, repeats=20):
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 3)


print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}), flush=True)
sdpa = TorchBackend(builtin_flash=False)
for tokens in (1024, 4096):
    q, cache, md, decodes = mixed_batch(tokens)
    split = varlen_flash_attention(q, cache, md, D**-0.5)
    whole = one_call(q, cache, md)
    runs = sdpa.forward(q, cache, md, D**-0.5)
    row = {
        "tokens": tokens,
        "decodes": decodes,
        "max_err_split_vs_one_call": (split.float() - whole.float()).abs().max().item(),
        "max_err_split_vs_sdpa": (split.float() - runs.float()).abs().max().item(),
        "one_call_ms": median_ms(one_call, q, cache, md),
        "decodes_apart_ms": median_ms(varlen_flash_attention, q, cache, md, D**-0.5),
        "sdpa_runs_ms": median_ms(sdpa.forward, q, cache, md, D**-0.5),
        "gather_all_ms": median_ms(gather_only, q, cache, md),
    }
    n = decodes
    dec = build_attention_metadata(
        [1] * n, md.seq_lens_cpu[:n].tolist(), md.block_table[:n].cpu(), torch.zeros(n, dtype=torch.int64), device=dev
    )
    row["decodes_alone_ms"] = median_ms(varlen_flash_attention, q[:n], cache, dec, D**-0.5)
    print(json.dumps(row), flush=True)
