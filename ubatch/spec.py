"""Speculative decoding: a draft model that proposes tokens, and greedy acceptance.

The drafter is a small decoder of the target's family (same vocabulary) with its own paged KV
cache. Its cache is indexed by the target's block ids (same block count and size), so a request's
block table addresses both caches and the drafter needs no allocator of its own. Rolling back a
rejected token, in either cache, is only a matter of not counting it as computed: the slot of a
position is fixed by the block table, so the next step that runs that position overwrites the
stale KV before any attention reads it (keys past a request's context length are never read).

With ``capture_sizes`` the drafter has a graph manager of its own (a ``GraphedModel`` over the
draft model, captured with the draft cache bound): draft steps, one token per request, replay
FULL graphs; catch-up forwards replay FULL graphs of k + 1 tokens per request where the runner
made them uniform (see ``DraftModel``), PIECEWISE ones otherwise. Its PIECEWISE warm-up and
capture skip attention, keyed on the descriptor like the target's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.attention import PagedKVCache, build_attention_metadata
from ubatch.context import set_forward_context
from ubatch.cudagraph import sizes_with_multiples
from ubatch.graphed import GraphedModel, uniform_token_count
from ubatch.models import Decoder
from ubatch.uploads import upload


@dataclass(frozen=True)
class DraftRequest:
    """One request to draft for: its tokens so far (the last one not yet in the target's KV),
    its block ids (room for at least ``len(token_ids) + num_drafts - 1`` tokens) and how many
    tokens to propose."""

    request_id: int
    token_ids: Sequence[int]
    blocks: Sequence[int]
    num_drafts: int


@dataclass
class SpecStats:
    """Running totals of proposed and accepted draft tokens."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (0.0 before anything was proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted


def accept_greedy(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> list[int]:
    """The tokens greedy verification appends: the longest prefix of drafts that equal the
    target's argmax at the same position, then the target's token at the first mismatch (or its
    bonus token after all k drafts). ``target_token_ids`` holds k + 1 argmaxes."""
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(
            f"need one more target token than drafts, got {len(target_token_ids)} target tokens "
            f"for {len(draft_token_ids)} drafts"
        )
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == target_token_ids[accepted]:
        accepted += 1
    return list(target_token_ids[: accepted + 1])


class DraftModel:
    """Proposes tokens with ``model`` autoregressively, keeping its own KV cache.

    ``num_computed(request_id)`` tokens of a request have draft KV. ``propose`` first catches a
    request up (its prompt after a prefill, or the accepted tokens after a verification) in one
    forward that also yields the first draft, then runs one forward per further draft.

    With ``catch_up_width`` w (k + 1 for k drafts per step) a catch-up of at most w tokens per
    request starts earlier, so that every request feeds exactly its last w tokens: recomputing
    KV the drafter already holds (same tokens, same slots) makes the batch uniform, so it takes
    one attention run, and with graphs it replays a FULL graph captured for w tokens per request
    instead of a PIECEWISE one with eager attention.
    ``rollback`` after verification keeps only KV of tokens the target accepted; ``forget``
    drops a finished or preempted request. The model may be the target itself: the drafter binds
    its cache to the layers only around its own forwards.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        num_kv_blocks: int,
        block_size: int,
        capture_sizes: Sequence[int] | None = None,
        max_blocks_per_req: int | None = None,
        catch_up_width: int | None = None,
        graph_backend: Any = None,
    ) -> None:
        if catch_up_width is not None and (
            isinstance(catch_up_width, bool) or not isinstance(catch_up_width, int) or catch_up_width < 2
        ):
            raise ValueError(f"catch_up_width must be an integer >= 2 (k + 1), got {catch_up_width!r}")
        self.model = model
        self.block_size = block_size
        self.catch_up_width = catch_up_width
        self.kv_cache = PagedKVCache.for_model(model, num_blocks=num_kv_blocks, block_size=block_size)
        self._computed: dict[int, int] = {}
        self.graphs: GraphedModel | None = None
        if capture_sizes:
            if max_blocks_per_req is None:
                raise ValueError("a drafter with capture_sizes needs max_blocks_per_req")
            widths = (1,) if catch_up_width is None else (1, catch_up_width)
            self.graphs = GraphedModel(
                model,
                capture_sizes=sizes_with_multiples(capture_sizes, widths),
                max_blocks_per_req=max_blocks_per_req,
                uniform_token_count=widths,
                graph_backend=graph_backend,
            )

    def capture_graphs(self) -> None:
        """Capture the drafter's graphs (into its own pool), with its cache bound."""
        if self.graphs is None:
            raise ValueError("this drafter has no capture_sizes")
        with self._bound_cache():
            self.graphs.capture()

    def release_graphs(self) -> None:
        """Free the drafter's graphs (see ``CudaGraphManager.release``)."""
        if self.graphs is not None:
            self.graphs.release()

    def num_computed(self, request_id: int) -> int:
        return self._computed.get(request_id, 0)

    def rollback(self, request_id: int, num_valid: int) -> None:
        """Keep draft KV only for the first ``num_valid`` tokens (those the target accepted)."""
        self._computed[request_id] = min(self.num_computed(request_id), num_valid)

    def forget(self, request_id: int) -> None:
        """Drop a request's draft state (its blocks are gone or will be reused)."""
        self._computed.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest], *, skip_attention: bool = False) -> list[list[int]]:
        """``num_drafts`` greedy tokens per request; ``skip_attention`` reaches every forward's
        context (a graph manager sets it for piecewise warm-up and capture).

        Each draft step feeds the previous step's argmax to the next on the device, so the host
        waits for the GPU once per proposal, not once per draft step."""
        if not requests:
            return []
        rows = list(range(len(requests)))
        last = self.prepare(requests, skip_attention=skip_attention)
        produced = [(rows, last)]
        for step in range(1, max(r.num_drafts for r in requests)):
            live = [i for i in rows if requests[i].num_drafts > step]
            if len(live) < len(rows):  # requests that drafted enough drop out (live is a subset of rows)
                position = {r: p for p, r in enumerate(rows)}
                last = last[upload([position[i] for i in live], torch.int64, last.device)]
            rows = live
            last = self.draft_step([requests[i] for i in rows], last, step, skip_attention=skip_attention)
            produced.append((rows, last))
        values = iter(torch.cat([tokens for _, tokens in produced]).tolist())
        drafts: list[list[int]] = [[] for _ in requests]
        for step_rows, _ in produced:
            for i in step_rows:
                drafts[i].append(next(values))
        for request in requests:
            self._computed[request.request_id] = len(request.token_ids) + request.num_drafts - 1
        return drafts

    def prepare(self, requests: Sequence[DraftRequest], *, skip_attention: bool = False) -> torch.Tensor:
        """Catch every request up to its last token; its first draft, one per request, on the device."""
        for r in requests:
            if r.num_drafts < 1:
                raise ValueError(f"request {r.request_id}: num_drafts must be >= 1, got {r.num_drafts}")
        starts = [min(self.num_computed(r.request_id), len(r.token_ids) - 1) for r in requests]
        w = self.catch_up_width
        if w is not None and all(
            w <= len(r.token_ids) and len(r.token_ids) - start <= w for r, start in zip(requests, starts)
        ):
            starts = [len(r.token_ids) - w for r in requests]
        token_ids = [t for r, start in zip(requests, starts) for t in r.token_ids[start:]]
        ids = upload(token_ids, torch.int64, self.model.device)
        chunks = [(r, start, len(r.token_ids) - start) for r, start in zip(requests, starts)]
        return self._forward(chunks, ids, skip_attention=skip_attention)

    def draft_step(
        self, requests: Sequence[DraftRequest], last_drafts: torch.Tensor, step: int, *, skip_attention: bool = False
    ) -> torch.Tensor:
        """The next draft of each request once ``step`` drafts exist: feed the last one
        (``last_drafts``, on the device), one token each, at its position."""
        chunks = [(r, len(r.token_ids) + step - 1, 1) for r in requests]
        return self._forward(chunks, last_drafts, skip_attention=skip_attention)

    def _forward(
        self, chunks: list[tuple[DraftRequest, int, int]], input_ids: torch.Tensor, *, skip_attention: bool = False
    ) -> torch.Tensor:
        """Run ``(request, start position, number of tokens)`` chunks, whose tokens are
        ``input_ids``, as one batch; the argmax at each chunk's last token, on the device."""
        bs, device = self.block_size, self.model.device
        positions, slots, last = [], [], []
        for request, start, num_tokens in chunks:
            stop = start + num_tokens
            positions += range(start, stop)
            slots += (request.blocks[p // bs] * bs + p % bs for p in range(start, stop))
            last.append(len(positions) - 1)
        width = max(len(r.blocks) for r, _, _ in chunks)
        table = torch.tensor([list(r.blocks) + [0] * (width - len(r.blocks)) for r, _, _ in chunks], dtype=torch.int32)
        slot_mapping = upload(slots, torch.int64, device)
        metadata = build_attention_metadata(
            [n for _, _, n in chunks], [s + n for _, s, n in chunks], table, slot_mapping, device=device
        )
        pos = upload(positions, torch.int64, device)
        with torch.inference_mode(), self._bound_cache():
            hidden = self._run(input_ids, pos, metadata, skip_attention=skip_attention)
            index = upload(last, torch.int64, device)
            tokens = self.model.compute_logits(hidden[index]).argmax(dim=-1)
        self._clear_overflow()
        return tokens

    def _run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any, *, skip_attention: bool = False
    ) -> torch.Tensor:
        """The draft model's hidden states: a replayed graph where one fits, else eager. A
        forward asked to skip attention (a caller's warm-up or capture) never replays."""
        graph = None
        if self.graphs is not None and not skip_attention:
            graph = self.graphs.plan(metadata.num_actual_tokens, metadata.num_reqs, uniform_token_count(metadata))
        if graph is not None:
            return self.graphs.replay(graph, input_ids, positions, metadata)
        names = self.model.layer_names
        with set_forward_context(
            {name: metadata for name in names},
            slot_mapping={name: metadata.slot_mapping for name in names},
            no_compile_layers=self.model.attention_layers,
            skip_attention=skip_attention,
        ):
            return self.model(input_ids, positions)

    def _clear_overflow(self) -> None:
        """MoE tokens the drafter dropped only lower acceptance; clear the counts so a target
        sharing the model is not charged with them."""
        for counter in self.model.overflow_counters().values():
            counter.zero_()

    @contextmanager
    def _bound_cache(self) -> Iterator[None]:
        """Point the model's attention layers at the draft cache, restoring what was bound."""
        layers = self.model.attention_layers
        previous = {name: layer.kv_cache for name, layer in layers.items()}
        try:
            for name, layer in layers.items():
                layer.kv_cache = self.kv_cache[name]
            yield
        finally:
            for name, layer in layers.items():
                layer.kv_cache = previous[name]
