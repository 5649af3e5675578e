"""Synthetic steps for a reference model: requests with a cached context and new tokens.

Benchmarks and equality tests need a batch in any shape (prefill, decode, mixed, chunked
continuation) without driving a runner through many steps. The cached context holds random K/V:
any content works, since ubatched and unsplit runs read the same cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.attention import AttentionMetadata, PagedKVCache, build_attention_metadata
from ubatch.slicing import UBatchSlice, split_batch


@dataclass
class Step:
    """One step's device inputs and metadata; ``num_tokens`` includes padding at the end."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: dict[str, AttentionMetadata]
    query_lens: list[int]
    num_tokens: int

    def slices(self, num_ubatches: int, **kwargs: Any) -> list[UBatchSlice]:
        return split_batch(self.query_lens, num_ubatches, self.num_tokens, **kwargs)


def make_step(
    model: Any,
    query_lens: Sequence[int],
    context_lens: Sequence[int] | None = None,
    *,
    block_size: int | None = None,
    num_tokens_padded: int | None = None,
    seed: int = 0,
    cache: PagedKVCache | None = None,
) -> tuple[Step, PagedKVCache]:
    """A step whose request r has ``context_lens[r]`` cached tokens and ``query_lens[r]`` new ones.

    Without ``cache``, allocates a fresh KV cache filled with random values drawn on the model's
    device (a host fill of a long-context decode cache takes minutes) and binds it to the model's
    attention layers; with one (already bound, e.g. under captured graphs), lays the step's blocks
    out in it from block 0. ``block_size``: tokens per KV page; None takes ``cache``'s, or else the
    one the model's attention backend reads fastest (``PagedKVCache.preferred_block_size``).
    """
    context_lens = [0] * len(query_lens) if context_lens is None else list(context_lens)
    if len(context_lens) != len(query_lens):
        raise ValueError(f"{len(query_lens)} query lengths but {len(context_lens)} context lengths")
    device, cfg = model.device, model.config
    if block_size is None:
        block_size = cache.block_size if cache is not None else PagedKVCache.preferred_block_size(model)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    if cache is None:
        cache = PagedKVCache.for_model(
            model, num_blocks=sum(blocks), block_size=block_size, device=device, dtype=cfg.dtype
        )
        fill = torch.Generator(device).manual_seed(seed)
        for name in model.layer_names:
            cache[name].normal_(generator=fill)
        for name, layer in model.attention_layers.items():
            layer.kv_cache = cache[name]
    elif cache.block_size != block_size or cache.num_blocks < sum(blocks):
        raise ValueError(
            f"the cache holds {cache.num_blocks} blocks of {cache.block_size}; this step needs "
            f"{sum(blocks)} of {block_size}"
        )
    table, slots, positions, first = [], [], [], 0
    for c, s, nb in zip(context_lens, seq_lens, blocks):
        table.append(list(range(first, first + nb)) + [0] * (max(blocks) - nb))
        slots += [(first + p // block_size) * block_size + p % block_size for p in range(c, s)]
        positions += range(c, s)
        first += nb
    num_real = len(slots)
    total = num_real if num_tokens_padded is None else num_tokens_padded
    pad = total - num_real
    if pad < 0:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} is less than the {num_real} tokens")
    metadata = build_attention_metadata(
        list(query_lens),
        seq_lens,
        torch.tensor(table, dtype=torch.int32),
        torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        device=device,
    )
    input_ids = torch.randint(0, cfg.vocab_size, (total,), generator=gen)
    step = Step(
        input_ids=input_ids.to(device),
        positions=torch.tensor(positions + [0] * pad, dtype=torch.int64, device=device),
        attn_metadata={name: metadata for name in model.layer_names},
        query_lens=list(query_lens),
        num_tokens=total,
    )
    return step, cache
