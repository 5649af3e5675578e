"""Speculative drafts (``draft_model`` and ``num_speculative_tokens`` k): each decoding request
is scheduled with room for k more tokens, a ``DraftModel`` proposes them, and the target
verifies all k + 1 positions in the one step (prefill chunks may share it); greedy acceptance
keeps the output exactly the target's own greedy decoding. Ubatched verification splits on
request boundaries, so every request's k + 1 tokens stay in one ubatch.

Here: the drafter a runner builds, its proposals filled into the scheduled chunks, and its
state dropped for a request whose KV blocks were freed."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ubatch.models import Decoder, ModelConfig
from ubatch.runner.batch import Chunk, Request
from ubatch.runner.checks import check_drafter
from ubatch.spec import DraftModel, DraftRequest


def make_drafter(
    draft_model: Decoder | None,
    k: int | None,
    *,
    config: ModelConfig,
    device: torch.device,
    dp_group: Any,
    num_kv_blocks: int,
    block_size: int,
    capture_sizes: Sequence[int] | None,
    max_blocks_per_req: int,
) -> DraftModel | None:
    """The drafter, once ``check_drafter`` accepts it; it captures graphs of its own at the
    target's sizes."""
    if not check_drafter(draft_model, k, config, device, dp_group):
        return None
    return DraftModel(
        draft_model,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        capture_sizes=capture_sizes if capture_sizes and device.type == "cuda" else None,
        max_blocks_per_req=max_blocks_per_req,
        catch_up_width=k + 1,
    )


def with_drafts(drafter: DraftModel | None, chunks: list[Chunk], *, skip_attention: bool = False) -> list[Chunk]:
    """The chunks with the drafter's proposals filled in where the scheduler made room
    (``skip_attention`` goes down to every drafter forward)."""
    wanted = [c for c in chunks if c.num_drafts]
    if not wanted:
        return chunks
    proposals = drafter.propose(
        [DraftRequest(c.request.request_id, c.request.token_ids, c.request.blocks, c.num_drafts) for c in wanted],
        skip_attention=skip_attention,
    )
    by_request = {c.request.request_id: tuple(d) for c, d in zip(wanted, proposals)}
    return [
        dataclasses.replace(c, draft_token_ids=by_request[c.request.request_id]) if c.num_drafts else c for c in chunks
    ]


def forget_drafts(drafter: DraftModel | None, request: Request) -> None:
    """The drafter's state for a request whose KV blocks were just freed goes with them."""
    if drafter is not None:
        drafter.forget(request.request_id)
