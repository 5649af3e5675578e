"""Paged KV cache tensors, the sync-free KV write, and the block allocator."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ubatch._triton import tl, triton, triton_available

_MAX_BLOCK = 1024  # row elements per program: 8 bf16 (16 bytes) per thread with 4 warps
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KERNEL_SLOT_DTYPES = (torch.int32, torch.int64)


class PagedKVCache:
    """One cache tensor per attention layer, shaped ``[2, num_blocks, block_size, num_kv_heads,
    head_dim]`` (index 0 = K, 1 = V): the paged layout flash-attn reads directly."""

    @classmethod
    def for_model(
        cls,
        model: Any,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> PagedKVCache:
        """A cache for every attention layer of ``model`` (its layer names, KV heads and head
        size; its dtype and device unless given)."""
        return cls(
            model.layer_names,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.config.dtype if dtype is None else dtype,
            device=model.device if device is None else device,
        )

    @staticmethod
    def preferred_block_size(model: Any) -> int:
        """The page size ``model``'s attention layers read fastest on its device and dtype (the
        largest any layer asks for), for callers free to size the cache."""
        layers = model.attention_layers.values()
        if not layers:
            raise ValueError(f"{type(model).__name__} has no attention layers to size a KV cache for")
        return max(layer.preferred_block_size(model.device, model.config.dtype) for layer in layers)

    def __init__(
        self,
        layer_names: Sequence[str],
        *,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if len(set(layer_names)) != len(layer_names):
            raise ValueError(f"layer_names has duplicates: {list(layer_names)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self._tensors = {name: torch.zeros(shape, dtype=dtype, device=device) for name in layer_names}

    def __getitem__(self, layer_name: str) -> torch.Tensor:
        try:
            return self._tensors[layer_name]
        except KeyError:
            raise KeyError(f"no KV cache for layer {layer_name!r}; layers: {sorted(self._tensors)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[T]``, skipping
    rows whose slot is negative (padding), without a host sync so it can be graph-captured.

    On CUDA with Triton, one kernel writes K and V (a launch-bound decode step pays one launch,
    not a dozen) and skips padding rows and slots past the cache. Elsewhere, or for a layout the
    kernel does not take (a non-contiguous cache, k/v rows not dense), the eager fallback
    ``_write_kv_eager`` runs: one index_copy_ per K and V, padding redirected to duplicate a real
    row (see its docstring). Rows of ``k``/``v`` past ``slot_mapping``'s length are ignored.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(kv_cache.shape)}"
        )
    row_shape = tuple(kv_cache.shape[3:])
    num_rows = slot_mapping.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.shape[1:] != row_shape or t.shape[0] < num_rows:
            raise ValueError(
                f"{name} must be [>= {num_rows}, {row_shape[0]}, {row_shape[1]}] to match the "
                f"cache and slot_mapping, got shape {tuple(t.shape)}"
            )
        if t.dtype != kv_cache.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from the KV cache's {kv_cache.dtype}")
    if num_rows == 0:
        return
    if triton_available(kv_cache.device) and _kernel_takes(kv_cache, k, v, slot_mapping):
        _write_kv_triton(kv_cache, k, v, slot_mapping)
    else:
        _write_kv_eager(kv_cache, k, v, slot_mapping)


def _kernel_takes(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Whether the kernel handles these (validated, non-empty) inputs: it addresses the cache as
    flat ``[2, num_slots, heads * dim]`` and each k/v row as ``heads * dim`` dense elements at
    ``row * stride(0)``, so a fused-qkv slice qualifies but a head-strided view does not."""
    return (
        kv_cache.is_contiguous()
        and kv_cache.dtype in _KERNEL_DTYPES
        and slot_mapping.dim() == 1
        and slot_mapping.dtype in _KERNEL_SLOT_DTYPES
        and all(t.device == kv_cache.device for t in (k, v, slot_mapping))
        and k[0].is_contiguous()
        and v[0].is_contiguous()
    )


def _write_kv_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """One launch: a program per (row, block of the row's ``heads * dim`` elements)."""
    num_rows = slot_mapping.shape[0]
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    row_elems = kv_cache.shape[3] * kv_cache.shape[4]
    block = min(_MAX_BLOCK, triton.next_power_of_2(row_elems))
    grid = (num_rows, triton.cdiv(row_elems, block))
    _write_kv_kernel[grid](
        kv_cache[0],
        kv_cache[1],
        k,
        v,
        slot_mapping,
        num_slots,
        row_elems,
        k.stride(0),
        v.stride(0),
        slot_mapping.stride(0),
        BLOCK=block,
        num_warps=4,
    )


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_cache_ptr,
        v_cache_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,
        num_slots,
        row_elems,
        stride_k,
        stride_v,
        stride_slot,
        BLOCK: tl.constexpr,
    ):
        """Copies one block of row ``program_id(0)``'s K and V to its slot. The slot check is part
        of the mask, so a padding row (slot < 0) or a slot past the cache reads and writes nothing;
        the slot is int64 so ``slot * row_elems`` cannot overflow on a large cache."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        slot = tl.load(slot_ptr + row * stride_slot).to(tl.int64)
        slots = cols * 0 + slot  # a vector mask: Triton's interpreter (3.9) takes no scalar in one
        mask = (cols < row_elems) & (slots >= 0) & (slots < num_slots)
        dst = slot * row_elems + cols
        k = tl.load(k_ptr + row * stride_k + cols, mask=mask)
        v = tl.load(v_ptr + row * stride_v + cols, mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def _write_kv_eager(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``write_kv`` in plain torch ops, for any device and layout (inputs already validated, at
    least one row); a slot past the cache is an indexing error here.

    A fixed-shape write cannot drop rows, so padding rows are redirected to duplicate the first
    real row (same slot, same K/V bytes): duplicated index_copy_ targets then all carry identical
    data and the result is deterministic. With no real row at all, padding rows rewrite slot 0
    with its own current contents. No scratch slot is needed, so the cache layout stays the
    plain paged one and any tensor of that shape works.
    """
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    row_shape = tuple(kv_cache.shape[3:])
    num_rows = slot_mapping.shape[0]
    k_flat = kv_cache[0].view(num_slots, *row_shape)
    v_flat = kv_cache[1].view(num_slots, *row_shape)
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    first = torch.argmax(valid.to(torch.int8)).view(1)  # first real row (0 when none)
    any_valid = valid.any().view(1)
    target = torch.where(any_valid, slots.index_select(0, first), torch.zeros_like(first))
    safe_slots = torch.where(valid, slots, target)
    mask = valid.view(-1, 1, 1)
    for flat, new in ((k_flat, k[:num_rows]), (v_flat, v[:num_rows])):
        filler = torch.where(any_valid.view(1, 1, 1), new.index_select(0, first), flat.index_select(0, target))
        flat.index_copy_(0, safe_slots, torch.where(mask, new, filler))


class BlockPool:
    """Free list of KV block ids for one runner: ids come out ascending at first, then the most
    recently freed first (a plain stack; O(1) per block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # stack: pop() yields the lowest id
        self._free_set = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise RuntimeError(
                f"KV cache exhausted: asked for {n} blocks but only {len(self._free)} of {self.num_blocks} are free"
            )
        blocks = [self._free.pop() for _ in range(n)]
        self._free_set.difference_update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        blocks = [int(b) for b in blocks]
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} is out of range [0, {self.num_blocks})")
            if b in self._free_set:
                raise ValueError(f"block id {b} is already free (double free)")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks to free contain duplicates: {blocks}")
        self._free.extend(reversed(sorted(blocks)))
        self._free_set.update(blocks)
