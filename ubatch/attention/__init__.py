"""Attention: the layer, its per-step metadata, the paged KV cache and the kernel backends.

Imports only ``ubatch.context`` from the package (the bottom floor), so every other layer of
the package may use it.
"""

from ubatch.attention.backends import (
    AttentionBackend,
    FlashAttentionBackend,
    TorchBackend,
    available_backends,
    get_backend,
    preferred_block_size,
)
from ubatch.attention.kv_cache import BlockPool, PagedKVCache, write_kv
from ubatch.attention.layer import Attention, get_attention_context
from ubatch.attention.metadata import AttentionMetadata, build_attention_metadata, split_attn_metadata

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "BlockPool",
    "FlashAttentionBackend",
    "PagedKVCache",
    "TorchBackend",
    "available_backends",
    "build_attention_metadata",
    "get_attention_context",
    "get_backend",
    "preferred_block_size",
    "split_attn_metadata",
    "write_kv",
]
