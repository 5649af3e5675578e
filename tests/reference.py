"""The no-history reference that runner and sharded-model outputs are checked against."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ubatch.attention import PagedKVCache, build_attention_metadata
from ubatch.context import set_forward_context
from ubatch.models import Decoder


def forward_sequences(model: Decoder, sequences: Sequence[Sequence[int]], *, block_size: int = 16) -> torch.Tensor:
    """Hidden states [sum(len), hidden] of whole sequences run as fresh prefills with a private
    KV cache. The layers' own cache bindings are restored afterwards."""
    lengths = [len(s) for s in sequences]
    num_blocks = [math.ceil(n / block_size) for n in lengths]
    cache = PagedKVCache(
        model.layer_names,
        num_blocks=sum(num_blocks),
        block_size=block_size,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=model.config.dtype,
        device=model.device,
    )
    width = max(num_blocks)
    table, slots, positions, first = [], [], [], 0
    for n, nb in zip(lengths, num_blocks):
        table.append(list(range(first, first + nb)) + [0] * (width - nb))
        slots += range(first * block_size, first * block_size + n)
        positions += range(n)
        first += nb
    metadata = build_attention_metadata(
        lengths,
        lengths,
        torch.tensor(table, dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int64),
        device=model.device,
    )
    input_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=model.device)
    previous = {name: layer.kv_cache for name, layer in model.attention_layers.items()}
    try:
        for name, layer in model.attention_layers.items():
            layer.kv_cache = cache[name]
        with (
            torch.inference_mode(),
            set_forward_context(
                {name: metadata for name in model.layer_names}, no_compile_layers=model.attention_layers
            ),
        ):
            return model(input_ids, torch.tensor(positions, dtype=torch.int64, device=model.device))
    finally:
        for name, layer in model.attention_layers.items():
            layer.kv_cache = previous[name]
