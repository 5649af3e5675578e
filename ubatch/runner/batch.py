"""Requests and the batch a step runs: a request's tokens and KV blocks, the chunks a step
schedules of them, the flattened device inputs those chunks make, and what a step returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ubatch.attention import build_attention_metadata
from ubatch.uploads import upload


@dataclass
class Request:
    """One generation request; ``token_ids`` is the prompt followed by the generated tokens, and
    the first ``num_computed`` of them have their KV in ``blocks``."""

    request_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    max_new_tokens: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_decoding(self) -> bool:
        """Prompt fully computed: the one pending token is the last generated one."""
        return self.num_computed >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.num_tokens - self.num_prompt_tokens >= self.max_new_tokens


@dataclass(frozen=True)
class Chunk:
    """``num_tokens`` tokens of ``request`` starting at position ``start``, scheduled this step,
    then (speculative decoding) the ``draft_token_ids`` proposed for them; the scheduler reserved
    KV room for ``num_drafts`` of those."""

    request: Request
    start: int
    num_tokens: int
    num_drafts: int = 0
    draft_token_ids: tuple[int, ...] = ()

    @property
    def reaches_end(self) -> bool:
        """The chunk ends at the request's last token, so the step samples a new one."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def query_len(self) -> int:
        """Tokens the chunk puts in the batch, drafts included."""
        return self.num_tokens + len(self.draft_token_ids)

    @property
    def input_ids(self) -> list[int]:
        return self.request.token_ids[self.start : self.start + self.num_tokens] + list(self.draft_token_ids)


@dataclass
class BatchInputs:
    """Device inputs of one step, the per-layer metadata dicts and where to read logits."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: dict[str, Any]
    slot_mapping: dict[str, torch.Tensor]
    logits_indices: torch.Tensor
    num_tokens: int


@dataclass
class StepOutput:
    """Tokens sampled this step (request id -> the last token; ``new_token_ids``: every token
    appended, more than one after accepted drafts), the requests that finished (request id ->
    all generated tokens), the token count every DP rank ran (padding included; all zero when
    no rank had work, which is how ``generate`` knows every rank is done) and this step's
    proposed and accepted draft tokens; ``num_ubatches``: how many ubatches the step ran in;
    ``overlap_mode``: the name of the overlap mode it ran in."""

    new_tokens: dict[int, int] = field(default_factory=dict)
    finished: dict[int, list[int]] = field(default_factory=dict)
    num_tokens_across_dp: list[int] = field(default_factory=list)
    new_token_ids: dict[int, list[int]] = field(default_factory=dict)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_ubatches: int = 1
    overlap_mode: str = "unsplit"


def build_batch_inputs(
    chunks: Sequence[Chunk],
    *,
    block_size: int,
    layer_names: Sequence[str],
    device: torch.device,
    num_tokens_padded: int | None = None,
) -> BatchInputs:
    """Flattened token ids / positions, block table, slot mapping and attention metadata,
    padded at the end to ``num_tokens_padded`` (padding: token 0, position 0, slot -1; no
    chunks at all makes a step of padding only), uploaded without a stream sync (``ubatch.uploads``),
    so a runner can build the next step while the GPU runs this one."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    width = max((len(c.request.blocks) for c in chunks), default=0)
    table = [c.request.blocks + [0] * (width - len(c.request.blocks)) for c in chunks]
    for chunk in chunks:
        request, stop = chunk.request, chunk.start + chunk.query_len
        input_ids += chunk.input_ids
        positions += range(chunk.start, stop)
        slots += (request.blocks[p // bs] * bs + p % bs for p in range(chunk.start, stop))
        if chunk.reaches_end:  # the last real token, then every draft
            logits_indices += range(len(input_ids) - 1 - len(chunk.draft_token_ids), len(input_ids))
    pad = (len(input_ids) if num_tokens_padded is None else num_tokens_padded) - len(input_ids)
    if pad < 0:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} is less than the {len(input_ids)} scheduled tokens")
    input_ids += [0] * pad
    positions += [0] * pad
    slots += [-1] * pad
    slot_mapping = upload(slots, torch.int64, device)
    metadata = build_attention_metadata(
        [c.query_len for c in chunks],
        [c.start + c.query_len for c in chunks],
        torch.tensor(table, dtype=torch.int32).view(len(chunks), width),
        slot_mapping,
        device=device,
    )
    return BatchInputs(
        input_ids=upload(input_ids, torch.int64, device),
        positions=upload(positions, torch.int64, device),
        attn_metadata={name: metadata for name in layer_names},
        slot_mapping={name: metadata.slot_mapping for name in layer_names},
        logits_indices=upload(logits_indices, torch.int64, device),
        num_tokens=len(input_ids),
    )
