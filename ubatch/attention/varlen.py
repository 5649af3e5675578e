"""Torch's built-in flash kernel over the batch: a call or three per layer, no mask, no cuDNN plan.

``aten::_flash_attention_forward`` takes variable-length queries (``cum_seq_q``) and, through
``seqused_k``, reads only the first ``seq_lens[i]`` keys of each request's slot, causally aligned
to the bottom right. So the torch backend gathers each request's blocks into a slot of its own,
points ``cum_seq_k`` at the slots and lets the kernel skip the tail of each request's last block.

- A uniform batch, and any batch under a graph capture, is one call that gives every slot the
  block table's width: the gather depends on shapes alone (host-side lengths would be frozen
  at their capture-time values), so a graph may capture it.
- Any other batch sizes each slot from its own length, so one long request does not make every
  other one gather its width. The layout is built on the device from host-side totals only: a
  pageable host-to-device copy would synchronize the stream in every layer.
- That layout (the calls, their block ids, offsets and lengths: ``varlen_plan``) is the same in
  every layer of a step, so it is built once per forward pass, in the first layer, and kept in
  the forward context's ``step_memo``, which goes with the context; the other layers only gather
  their own cache's K/V and call the kernel. Never memoized on the metadata: a runner may refill
  its tensors in place for the next step, and a layout kept past the step would be stale.
- Its leading and trailing runs of decodes get calls of their own. Only when every query of a
  call is a decode does the kernel fold a KV head's query heads into one tile; beside prompts,
  each decode's lone query takes a tile per head. On the bench's mixed batch (1024 decodes over
  512 cached tokens, six prompts of 512) that is 2.8 ms against 6.4 ms in one call; cuDNN's
  SDPA, warm, takes 2.1 ms, and the gather alone 1.5 ms
  (``benchmarks/h200x2/explore/varlen_mixed_decodes.*``).

On an H200 (torch 2.11, bf16) a small mixed batch takes 0.11-0.2 ms with the gather, 0.15-0.27
ms the first time a shape is met, where cuDNN's SDPA builds a plan of 34 ms to 1.1 s per new
shape (``benchmarks/h200x2/explore/varlen_builtin_flash.*``). torch 2.11's public
``varlen_attn`` has no ``seqused_k``, hence the aten op. It needs CUDA, fp16 or bf16, sm80 or
newer and a head size that is a multiple of 8 up to 256.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.attention.metadata import AttentionMetadata
from ubatch.context import get_forward_context, is_forward_context_available

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _flash_op() -> Any:
    """The aten op, or None when this torch lacks it or its ``seqused_k`` argument."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or "seqused_k" not in str(op.default._schema):
        return None
    return op.default


_FLASH_FORWARD = _flash_op()


@functools.cache
def _sm80_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def builtin_flash_supports(q: torch.Tensor) -> bool:
    """Whether ``varlen_flash_attention`` can run on queries like ``q [T, H, D]``."""
    return (
        _FLASH_FORWARD is not None
        and q.is_cuda
        and q.dtype in _FLASH_DTYPES
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and _sm80_or_newer(q.device.index)
    )


def varlen_flash_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """``[num_actual_tokens, H, D]``: every request's queries over its own ``seq_lens`` keys."""
    table, block_size = metadata.block_table, kv_cache.shape[2]
    num_reqs, width = table.shape
    uniform = metadata.max_query_len * num_reqs == metadata.num_actual_tokens
    if uniform or _capturing(table.device):
        slot_len = width * block_size
        cum_seq_k = torch.arange(0, (num_reqs + 1) * slot_len, slot_len, dtype=torch.int32, device=table.device)
        max_q = metadata.max_query_len if uniform else _max_query_len(metadata.query_lens())
        return _attend(
            q[: metadata.num_actual_tokens],
            kv_cache,
            table.flatten(),
            metadata.query_start_loc,
            cum_seq_k,
            max_q,
            slot_len,
            metadata.seq_lens,
            metadata.causal,
            scale,
        )
    parts = [
        _attend(
            q[p.tokens],
            kv_cache,
            p.blocks,
            p.cum_seq_q,
            p.cum_seq_k,
            p.max_q,
            p.max_k,
            p.seq_lens,
            metadata.causal,
            scale,
        )
        for p in _step_plan(metadata, block_size)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class VarlenPart:
    """One kernel call of a non-uniform batch: its query rows and the layout of its requests'
    slots, the same in every layer of a step."""

    tokens: slice  # the call's rows of q
    blocks: torch.Tensor  # the block ids to gather, each request's own blocks in order
    cum_seq_q: torch.Tensor  # int32, offsets into q[tokens]
    cum_seq_k: torch.Tensor  # int32, offsets of the slots in the gathered K/V
    max_q: int
    max_k: int
    seq_lens: torch.Tensor  # int32, keys each request reads from its slot


def varlen_plan(metadata: AttentionMetadata, block_size: int) -> tuple[VarlenPart, ...]:
    """The calls of a non-uniform batch: its leading and trailing runs of decodes apart from the
    requests between them (``decode_ends``), empty ranges left out."""
    table = metadata.block_table
    starts = metadata.query_start_loc_cpu.tolist()
    lengths = metadata.query_lens()
    parts = []
    for first, last in decode_ends(lengths):
        q_start, q_end = starts[first], starts[last]
        if q_start == q_end:
            continue
        seq_lens = metadata.seq_lens[first:last]
        blocks, cum_seq_k, max_k = packed_slots(
            table[first:last], seq_lens, metadata.seq_lens_cpu[first:last], block_size
        )
        parts.append(
            VarlenPart(
                slice(q_start, q_end),
                blocks,
                metadata.query_start_loc[first : last + 1] - q_start,
                cum_seq_k,
                _max_query_len(lengths[first:last]),
                max_k,
                seq_lens,
            )
        )
    return tuple(parts)


def _step_plan(metadata: AttentionMetadata, block_size: int) -> tuple[VarlenPart, ...]:
    """``varlen_plan``, built once per forward pass: every layer of a step (or of a ubatch) gets
    the same metadata. Memoized on the forward context, which is dropped at the end of the
    pass, never on the metadata: a runner may refill its tensors in place for the next step.
    The memo keeps the metadata alive, so its id is not reused within the pass."""
    if not is_forward_context_available():
        return varlen_plan(metadata, block_size)
    memo = get_forward_context().step_memo
    key = ("varlen_plan", id(metadata), block_size)
    if key not in memo:
        memo[key] = (metadata, varlen_plan(metadata, block_size))
    return memo[key][1]


def _max_query_len(lengths: list[int]) -> int:
    """The ``max_seqlen_q`` to pass. At 1 the kernel folds each KV head's query heads into one
    tile, assuming one query per request; a range that also holds empty requests says 2 (an
    upper bound is all the kernel needs) to stay off that path."""
    longest = max(lengths, default=0)
    return 2 if longest == 1 and min(lengths) == 0 else longest


def _attend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    blocks: torch.Tensor,
    cum_seq_q: torch.Tensor,
    cum_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    seq_lens: torch.Tensor,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    k, v = (kv_cache[i].index_select(0, blocks).flatten(0, 1) for i in (0, 1))  # [slots' tokens, KVH, D]
    return _FLASH_FORWARD(
        q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=seq_lens
    )[0]


def decode_ends(query_lens: list[int]) -> list[tuple[int, int]]:
    """``[first, last)`` request ranges, in order and none empty: the batch's leading and trailing
    runs of decodes (query length 1), each apart from the requests between them."""
    head = next((r for r, n in enumerate(query_lens) if n != 1), len(query_lens))
    tail = next((r for r in range(len(query_lens), head, -1) if query_lens[r - 1] != 1), head)
    return [(a, b) for a, b in ((0, head), (head, tail), (tail, len(query_lens))) if a < b]


def packed_slots(
    table: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the block ids to gather, each request's own blocks in order; ``cum_seq_k``, the int32 token
    offsets of the slots; the longest slot). The layout is computed on the device from
    ``seq_lens``; the host copy gives only the totals that size it."""
    width = table.shape[1]
    per_request = (seq_lens.long() + block_size - 1) // block_size
    host_blocks = (seq_lens_cpu.long() + block_size - 1) // block_size
    num_blocks = int(host_blocks.sum())
    ends = per_request.cumsum(0)
    rows = torch.repeat_interleave(per_request, output_size=num_blocks)
    columns = torch.arange(num_blocks, device=table.device) - (ends - per_request).index_select(0, rows)
    blocks = table.flatten().index_select(0, rows * width + columns)
    cum_seq_k = torch.cat((ends.new_zeros(1), ends * block_size)).to(torch.int32)
    return blocks, cum_seq_k, int(host_blocks.max()) * block_size
