"""The Attention layer and how it finds its per-step state in the forward context."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ubatch.attention.backends import BACKEND_NAMES, AttentionBackend, get_backend, preferred_block_size
from ubatch.attention.kv_cache import write_kv
from ubatch.attention.metadata import AttentionMetadata
from ubatch.context import get_forward_context
from ubatch.islands import run_island


def _lookup(per_layer: Any, layer_name: str, field: str, *, required: bool) -> Any:
    """This layer's entry of a per-layer dict field of the context (None when absent)."""
    if per_layer is None:
        return None
    if isinstance(per_layer, list):
        raise RuntimeError(
            f"forward context {field} is a per-ubatch list at attention layer {layer_name!r}: "
            f"per-ubatch metadata lists must be resolved by UBatchWrapper, which gives each "
            f"ubatch a context holding its own dict"
        )
    if not isinstance(per_layer, Mapping):
        raise TypeError(
            f"forward context {field} must be a dict keyed by layer name, a per-ubatch list of "
            f"them, or None; got {type(per_layer).__name__}"
        )
    if required and layer_name not in per_layer:
        raise RuntimeError(
            f"forward context {field} has no entry for attention layer {layer_name!r}; it has: {sorted(per_layer)}"
        )
    return per_layer.get(layer_name)


def get_attention_context(
    layer_name: str,
) -> tuple[AttentionMetadata | None, Attention, torch.Tensor | None, torch.Tensor | None]:
    """``(metadata, layer, kv_cache, slot_mapping)`` of ``layer_name`` in the current step.

    With ``skip_attention`` the metadata comes back as None, which sends the layer down its
    profiling path (no kernel, no KV write), while ``ctx.attn_metadata`` itself is left as is
    for model-specific ops that read it. ``slot_mapping`` falls back to the metadata's own.
    """
    ctx = get_forward_context()
    try:
        layer = ctx.no_compile_layers[layer_name]
    except KeyError:
        raise RuntimeError(
            f"attention layer {layer_name!r} is not in the forward context's no_compile_layers "
            f"(known: {sorted(ctx.no_compile_layers)}); pass the model's layer registry as "
            f"set_forward_context(..., no_compile_layers=registry)"
        ) from None
    metadata = _lookup(ctx.attn_metadata, layer_name, "attn_metadata", required=True)
    slot_mapping = _lookup(ctx.slot_mapping, layer_name, "slot_mapping", required=False)
    if slot_mapping is None and metadata is not None:
        slot_mapping = metadata.slot_mapping
    if ctx.skip_attention:
        metadata = None
    return metadata, layer, layer.kv_cache, slot_mapping


class Attention(nn.Module):
    """Paged-KV attention over a flattened variable-length batch.

    The layer registers itself under ``layer_name`` in ``registry`` (the model's dict that
    runners pass as ``no_compile_layers``) and reads everything per-step from the forward
    context, so a model calls it as plain ``attn(q, k, v)``. The runner binds ``kv_cache``.
    ``backend`` is a name (see ``get_backend``), None for automatic, or a backend object.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int | None = None,
        *,
        layer_name: str,
        scale: float | None = None,
        backend: str | AttentionBackend | None = None,
        registry: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or head_dim < 1 or num_kv_heads < 1:
            raise ValueError(
                f"attention layer {layer_name!r}: num_heads={num_heads}, head_dim={head_dim} "
                f"and num_kv_heads={num_kv_heads} must all be >= 1"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"attention layer {layer_name!r}: num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}"
            )
        if isinstance(backend, str) and backend not in BACKEND_NAMES:
            raise ValueError(f"unknown attention backend {backend!r}; valid: {list(BACKEND_NAMES)}")
        if registry is not None and layer_name in registry:
            raise ValueError(f"duplicate attention layer name {layer_name!r} in the registry")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.layer_name = layer_name
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.kv_cache: torch.Tensor | None = None
        self._backend_choice = backend
        self._backends: dict[torch.device, AttentionBackend] = {}
        if registry is not None:
            registry[layer_name] = self

    def extra_repr(self) -> str:
        return (
            f"layer_name={self.layer_name!r}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        )

    def _backend(self, device: torch.device) -> AttentionBackend:
        if not isinstance(self._backend_choice, (str, type(None))):
            return self._backend_choice
        if device not in self._backends:
            self._backends[device] = get_backend(self._backend_choice, device)
        return self._backends[device]

    def preferred_block_size(self, device: torch.device | str, dtype: torch.dtype) -> int:
        """The KV page size this layer's backend on ``device`` reads fastest (``preferred_block_size``)."""
        return preferred_block_size(self._backend(torch.device(device)), self.head_dim, dtype)

    def _check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        want = {
            "q": self.num_heads * self.head_dim,
            "k": self.num_kv_heads * self.head_dim,
            "v": self.num_kv_heads * self.head_dim,
        }
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 2 or t.shape[1] != want[name] or t.shape[0] != q.shape[0]:
                raise ValueError(
                    f"attention layer {self.layer_name!r}: {name} must be "
                    f"[{q.shape[0]}, {want[name]}], got {tuple(t.shape)}"
                )
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(
                    f"attention layer {self.layer_name!r}: {name} is {t.dtype} on {t.device}, "
                    f"q is {q.dtype} on {q.device}"
                )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [T, H*D]``, ``k``/``v`` ``[T, KVH*D]`` -> ``[T, H*D]``; padding rows are zero.

        An eager island: a piecewise CUDA graph replays around it and runs it with the step's
        real metadata.
        """
        self._check_inputs(q, k, v)
        return run_island(self._attend, q, k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        metadata, _, kv_cache, slot_mapping = get_attention_context(self.layer_name)
        num_tokens = q.shape[0]
        out = q.new_zeros(num_tokens, self.num_heads, self.head_dim)
        if metadata is None:  # profiling / dummy run, or skip_attention
            return out.flatten(1)
        num_actual = metadata.num_actual_tokens
        if kv_cache is None:
            raise RuntimeError(
                f"attention layer {self.layer_name!r} has no KV cache bound; the runner must set "
                f"layer.kv_cache before running it with attention metadata"
            )
        if kv_cache.dim() != 5 or tuple(kv_cache.shape[3:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"attention layer {self.layer_name!r}: kv_cache must be [2, num_blocks, "
                f"block_size, {self.num_kv_heads}, {self.head_dim}], got {tuple(kv_cache.shape)}"
            )
        if kv_cache.dtype != q.dtype or kv_cache.device != q.device:
            raise TypeError(
                f"attention layer {self.layer_name!r}: kv_cache is {kv_cache.dtype} on "
                f"{kv_cache.device}, q is {q.dtype} on {q.device}"
            )
        if not num_actual <= slot_mapping.shape[0] <= num_tokens:
            raise ValueError(
                f"attention layer {self.layer_name!r}: slot_mapping has {slot_mapping.shape[0]} "
                f"entries; need between num_actual_tokens={num_actual} and the {num_tokens} "
                f"input rows"
            )
        write_kv(
            kv_cache,
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            slot_mapping,
        )
        if num_actual > 0:
            qh = q.view(num_tokens, self.num_heads, self.head_dim)
            out[:num_actual] = self._backend(q.device).forward(qh, kv_cache, metadata, self.scale)
        return out.flatten(1)
