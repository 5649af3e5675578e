"""Per-step attention metadata for a flattened variable-length batch, and its split into ubatches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.uploads import host_and_device, upload


@dataclass
class AttentionMetadata:
    """Flattened variable-length batch: requests laid end to end along the token dimension.

    A query token at index ``j`` of request ``r`` (query length ``q``, context length ``s``)
    sits at position ``s - q + j``; with ``causal`` it attends keys ``0 .. s - q + j`` of that
    request. One shape covers prefill (``q == s``), chunked-prefill continuation (``q < s``),
    decode (``q == 1``) and uniform multi-token verification. The ``*_cpu`` copies let host
    code (splitting, the torch backend) read lengths without a device sync.
    """

    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device
    seq_lens: torch.Tensor  # int32 [num_reqs], device; context length incl. this step
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], device; padded with valid ids (0)
    slot_mapping: torch.Tensor  # int64 [num_tokens], device; -1 = padding (no KV write)
    query_start_loc_cpu: torch.Tensor  # int32 CPU copy of query_start_loc
    seq_lens_cpu: torch.Tensor  # int32 CPU copy of seq_lens
    causal: bool = True

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_start_loc_cpu[-1])

    def query_lens(self) -> list[int]:
        """Each request's query length, from the CPU copy (no device sync)."""
        return torch.diff(self.query_start_loc_cpu).tolist()

    def split(self, slices: Sequence[Any]) -> list[AttentionMetadata]:
        """One metadata per ubatch slice (the protocol ``UBatchWrapper`` splits metadata by);
        see ``split_attn_metadata``."""
        return split_attn_metadata(self, slices)


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    device: torch.device | str | None = None,
    causal: bool = True,
) -> AttentionMetadata:
    """Build metadata from per-request lengths; tensors land on ``device`` (default: the
    block table's)."""
    query_lens = [int(n) for n in query_lens]
    seq_lens = [int(n) for n in seq_lens]
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"query_lens has {len(query_lens)} requests but seq_lens has {len(seq_lens)}")
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        if q < 0 or s < q:
            raise ValueError(f"request {r}: need 0 <= query_len <= seq_len, got query_len={q}, seq_len={s}")
    if block_table.dim() != 2 or block_table.shape[0] != len(seq_lens):
        raise ValueError(
            f"block_table must be [num_reqs={len(seq_lens)}, max_blocks], got shape {tuple(block_table.shape)}"
        )
    if block_table.device.type == "cpu" and block_table.numel() and int(block_table.min()) < 0:
        raise ValueError(
            f"block_table holds negative block id {int(block_table.min())}: pad rows with a valid "
            f"id such as 0 (backends gather whole rows; keys past seq_len are masked, not skipped)"
        )
    num_tokens = sum(query_lens)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping must be 1-D with at least {num_tokens} entries (the query tokens), "
            f"got shape {tuple(slot_mapping.shape)}"
        )
    device = torch.device(device) if device is not None else block_table.device
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    # uploaded without a stream sync, so that each ubatch's metadata, built at every split step,
    # does not hold the host until the GPU has drained the previous step (run 20's traces)
    query_start_loc_cpu, query_start_loc = host_and_device(starts, torch.int32, device)
    seq_lens_cpu, seq_lens_device = host_and_device(seq_lens, torch.int32, device)
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_device,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_table=upload(block_table, torch.int32, device),
        slot_mapping=upload(slot_mapping, torch.int64, device),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=seq_lens_cpu,
        causal=causal,
    )


def split_attn_metadata(metadata: AttentionMetadata, slices: Sequence[Any]) -> list[AttentionMetadata]:
    """One AttentionMetadata per slice (``ubatch.UBatchSlice``: a ``request_slice`` and a
    ``token_slice`` of this batch).

    A request cut by a split point keeps, in the earlier slice, a context that ends with that
    slice's last token; its later part sees the whole context, the earlier part's KV included.
    """
    query_start = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    device = metadata.query_start_loc.device
    out = []
    for i, s in enumerate(slices):
        if s.request_slice.stop > metadata.num_reqs:
            raise ValueError(
                f"ubatch slice {i} has request_slice={s.request_slice}, beyond the metadata's "
                f"{metadata.num_reqs} requests"
            )
        t0, t1 = s.token_slice.start, s.token_slice.stop
        query_lens, ctx_lens = [], []
        for r in range(s.request_slice.start, s.request_slice.stop):
            q0, q1 = max(query_start[r], t0), min(query_start[r + 1], t1)
            query_lens.append(q1 - q0)
            ctx_lens.append(seq_lens[r] - (query_start[r + 1] - q1))
        out.append(
            build_attention_metadata(
                query_lens,
                ctx_lens,
                metadata.block_table[s.request_slice],
                metadata.slot_mapping[t0:t1],
                device=device,
                causal=metadata.causal,
            )
        )
    return out
