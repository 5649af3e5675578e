"""Torch's built-in flash kernel over the whole batch: one call per layer, no mask, no plan.

``aten::_flash_attention_forward`` takes variable-length queries (``cum_seq_q``) and, through
``seqused_k``, reads only the first ``seq_lens[i]`` keys of each request's slot, causally aligned
to the bottom right. So the torch backend gathers each request's blocks into a slot of its own,
points ``cum_seq_k`` at the slots and lets the kernel skip the tail of each request's last block.
A uniform batch, and any batch under a graph capture, gives every slot the block table's width,
so the gather depends on shapes alone (host-side lengths would be frozen at their capture-time
values); any other batch sizes each slot from the host copy of its length, so one long request
does not make every other one gather its width; the slot layout is built on the device, from
host-side totals only, so the step never waits for the GPU (a pageable host-to-device copy would
synchronize the stream in every layer). On an H200 (torch 2.11, bf16, equal slots) a
mixed batch takes 0.11-0.2 ms with the gather, 0.15-0.27 ms the first time a shape is met, where
cuDNN's SDPA builds a plan of 34 ms to 1.1 s per new shape
(``benchmarks/h200x2/explore/varlen_builtin_flash.*``).

With equal slots every input is a device tensor or a shape, so a graph may capture the call.
torch 2.11's public ``varlen_attn`` has no ``seqused_k``, hence the aten op. It needs CUDA, fp16
or bf16, sm80 or newer and a head size that is a multiple of 8 up to 256.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ubatch.attention.metadata import AttentionMetadata

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _flash_op() -> Any:
    """The aten op, or None when this torch lacks it or its ``seqused_k`` argument."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or "seqused_k" not in str(op.default._schema):
        return None
    return op.default


_FLASH_FORWARD = _flash_op()


@functools.lru_cache(maxsize=None)
def _sm80_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def builtin_flash_supports(q: torch.Tensor) -> bool:
    """Whether ``varlen_flash_attention`` can run on queries like ``q [T, H, D]``."""
    return (_FLASH_FORWARD is not None and q.is_cuda and q.dtype in _FLASH_DTYPES
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and _sm80_or_newer(q.device.index))


def varlen_flash_attention(q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                           scale: float) -> torch.Tensor:
    """``[num_actual_tokens, H, D]``: every request's queries over its own ``seq_lens`` keys."""
    blocks, cum_seq_k, max_k = kv_slots(metadata, kv_cache.shape[2])
    k, v = (kv_cache[i].index_select(0, blocks).flatten(0, 1) for i in (0, 1))  # [slots' tokens, KVH, D]
    out = _FLASH_FORWARD(q[: metadata.num_actual_tokens], k, v, metadata.query_start_loc, cum_seq_k,
                         metadata.max_query_len, max_k, 0.0, metadata.causal, False, scale=scale,
                         seqused_k=metadata.seq_lens)
    return out[0]


def kv_slots(metadata: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cache block ids to gather, in slot order; ``cum_seq_k``, the int32 token offsets of the
    slots; the longest slot), on the block table's device. Equal slots of the table's width for
    a uniform batch or under a capture, each request's own blocks otherwise (see the module
    docstring)."""
    table = metadata.block_table
    num_reqs, width = table.shape
    uniform = metadata.max_query_len * num_reqs == metadata.num_actual_tokens
    if uniform or _capturing(table.device):
        slot_len = width * block_size
        cum_seq_k = torch.arange(0, (num_reqs + 1) * slot_len, slot_len, dtype=torch.int32, device=table.device)
        return table.flatten(), cum_seq_k, slot_len
    per_request = (metadata.seq_lens.long() + block_size - 1) // block_size  # on the device: no copy
    num_blocks = int(((metadata.seq_lens_cpu.long() + block_size - 1) // block_size).sum())
    ends = per_request.cumsum(0)
    rows = torch.repeat_interleave(per_request, output_size=num_blocks)
    columns = torch.arange(num_blocks, device=table.device) - (ends - per_request).index_select(0, rows)
    blocks = table.flatten().index_select(0, rows * width + columns)
    cum_seq_k = torch.cat((ends.new_zeros(1), ends * block_size)).to(torch.int32)
    return blocks, cum_seq_k, -(-metadata.max_seq_len // block_size) * block_size
