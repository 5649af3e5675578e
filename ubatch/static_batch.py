"""Static buffers for a FULL CUDA graph of a uniform batch, unsplit or ubatched.

A FULL graph reads its inputs and attention metadata from the addresses it was captured on, so
a step is replayed by copying its real values into those buffers. Per-ubatch metadata are views
of the whole batch's buffers (a uniform batch splits on request boundaries), so one refill
serves every ubatch. Requests the real batch lacks are padded: ``u`` tokens attending to
themselves only, written nowhere (slot -1), their outputs ignored.

Host-side fields of the metadata (the ``*_cpu`` copies, ``max_seq_len``) keep their capture-time
values: graph-safe code reads only shapes and device tensors (the torch backend's uniform path).
"""

from __future__ import annotations

from typing import Any

import torch

from ubatch.attention import AttentionMetadata, build_attention_metadata
from ubatch.cudagraph import BatchExecutionDescriptor
from ubatch.slicing import UBatchSlice, split_batch


class StaticUniformBatch:
    """Inputs and metadata of one FULL descriptor (``uniform_token_count`` set)."""

    def __init__(
        self,
        desc: BatchExecutionDescriptor,
        *,
        layer_names: list[str],
        max_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        if desc.uniform_token_count is None:
            raise ValueError(f"static buffers are for uniform batches; {desc} has no uniform_token_count")
        self.desc = desc
        self.layer_names = list(layer_names)
        u, num_reqs, num_tokens = desc.uniform_token_count, desc.num_reqs, desc.num_tokens
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.metadata = build_attention_metadata(
            [u] * num_reqs,
            [u] * num_reqs,
            torch.zeros(num_reqs, max_blocks_per_req, dtype=torch.int32, device=device),
            torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            device=device,
        )
        self.slices: list[UBatchSlice] | None = None
        self.ubatch_metadata: list[AttentionMetadata] = []
        if desc.num_ubatches > 1:
            self.slices = split_batch([u] * num_reqs, desc.num_ubatches, num_tokens, align_to_requests=True)
            self.ubatch_metadata = [self._view(s) for s in self.slices]

    def _view(self, s: UBatchSlice) -> AttentionMetadata:
        md, u = self.metadata, self.desc.uniform_token_count
        starts = torch.arange(0, s.num_reqs * u + 1, u, dtype=torch.int32)
        return AttentionMetadata(
            query_start_loc=starts.to(md.query_start_loc.device),
            seq_lens=md.seq_lens[s.request_slice],
            max_query_len=u,
            max_seq_len=md.max_seq_len,
            block_table=md.block_table[s.request_slice],
            slot_mapping=md.slot_mapping[s.token_slice],
            query_start_loc_cpu=starts,
            seq_lens_cpu=md.seq_lens_cpu[s.request_slice],
            causal=md.causal,
        )

    def attn_metadata(self) -> dict[str, AttentionMetadata] | list[dict[str, AttentionMetadata]]:
        """What the forward context holds: one dict, or (ubatched) one dict per ubatch."""
        if self.slices is None:
            return {name: self.metadata for name in self.layer_names}
        return [{name: md for name in self.layer_names} for md in self.ubatch_metadata]

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Copy a real uniform batch (at most this descriptor's requests) into the buffers."""
        u = self.desc.uniform_token_count
        num_reqs, num_tokens = metadata.num_reqs, metadata.num_actual_tokens
        if metadata.max_query_len != u or num_tokens != num_reqs * u:
            raise ValueError(
                f"batch is not uniform with {u} tokens per request (max {metadata.max_query_len}, "
                f"{num_tokens} tokens for {num_reqs} requests)"
            )
        if num_reqs > self.desc.num_reqs or metadata.block_table.shape[1] > self.metadata.block_table.shape[1]:
            raise ValueError(
                f"batch of {num_reqs} requests x {metadata.block_table.shape[1]} blocks does not fit "
                f"{self.desc.num_reqs} x {self.metadata.block_table.shape[1]}"
            )
        static = self.metadata
        self.input_ids[:num_tokens].copy_(input_ids[:num_tokens])
        self.input_ids[num_tokens:].zero_()
        self.positions[:num_tokens].copy_(positions[:num_tokens])
        self.positions[num_tokens:].zero_()
        static.seq_lens[:num_reqs].copy_(metadata.seq_lens)
        static.seq_lens[num_reqs:].fill_(u)
        static.block_table.zero_()
        static.block_table[:num_reqs, : metadata.block_table.shape[1]].copy_(metadata.block_table)
        static.slot_mapping[:num_tokens].copy_(metadata.slot_mapping[:num_tokens])
        static.slot_mapping[num_tokens:].fill_(-1)

    def forward_context_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``set_forward_context`` besides the metadata."""
        return {"ubatch_slices": self.slices, "num_tokens": self.desc.num_tokens}
