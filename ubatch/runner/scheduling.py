"""Which requests run each step, and what gives way when the KV cache is full.

Decodes go first (arrival order), then prefill chunks in arrival order under the token budget;
a prompt longer than the remaining budget is split across steps (chunked-prefill
continuation). KV memory: a prefill that finds no free block waits (and so does every later
prefill: first come, first served); a running request that needs a block when none is free
preempts the most recently arrived request holding blocks, possibly itself, by recompute: its
blocks are freed and its prompt plus the tokens generated so far are prefilled again later.
When nothing at all could be scheduled, the most recently arrived block holder is preempted the
same way, so the earliest request always makes progress.

With speculative decoding each decoding request is scheduled with KV room for up to k drafts
(fewer near its ``max_new_tokens`` or the end of the step's token budget).
"""

from __future__ import annotations

import logging
import math

from ubatch.attention import BlockPool
from ubatch.runner.batch import Chunk, Request

logger = logging.getLogger(__name__)


class RequestScheduler:
    """The requests in flight, in arrival order, and the KV blocks they hold."""

    def __init__(
        self,
        *,
        num_kv_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.block_pool = BlockPool(num_kv_blocks)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.num_speculative_tokens = num_speculative_tokens
        self.requests: list[Request] = []
        self._next_id = 0

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """ValueError when a request of this size could never fit in the cache, even alone."""
        blocks = math.ceil((num_prompt_tokens + max_new_tokens) / self.block_size)
        if blocks > self.block_pool.num_blocks:
            raise ValueError(
                f"request too long for the KV cache: prompt of {num_prompt_tokens} tokens + max_new_tokens="
                f"{max_new_tokens} needs {blocks} blocks of {self.block_size}, the cache has "
                f"{self.block_pool.num_blocks}"
            )

    def add(self, prompt: list[int], max_new_tokens: int) -> Request:
        """Queue a request (already checked) behind every other."""
        request = Request(self._next_id, prompt, len(prompt), max_new_tokens)
        self._next_id += 1
        self.requests.append(request)
        return request

    def finish(self, request: Request) -> None:
        """Free a finished request's blocks and drop it."""
        self._release(request)
        self.requests.remove(request)

    def schedule(self) -> tuple[list[Chunk], list[Request]]:
        """This step's chunks (decodes, then prefill chunks), and the requests preempted on the
        way, whose KV blocks were freed (state kept elsewhere for those blocks must go too)."""
        preempted: list[Request] = []
        while self.requests:
            chunks = self._try_schedule(preempted)
            if chunks:
                return chunks, preempted
            victim = self._latest_block_holder(protected=set())
            if victim is None:
                raise RuntimeError(
                    f"no request can be scheduled although no request holds KV blocks "
                    f"({self.block_pool.num_free} of {self.block_pool.num_blocks} free)"
                )
            self._preempt(victim, preempted)
        return [], preempted

    def _try_schedule(self, preempted: list[Request]) -> list[Chunk]:
        budget, seats = self.max_num_batched_tokens, self.max_num_seqs
        chunks: list[Chunk] = []
        scheduled: set[int] = set()
        for request in [r for r in self.requests if r.is_decoding]:
            if not budget or not seats:
                break
            # An earlier decode may have preempted this request; then it prefills again.
            num_drafts = self._num_drafts(request, budget)
            if not request.is_decoding or not self._make_room_for_decode(request, scheduled, 1 + num_drafts, preempted):
                continue
            chunks.append(self._take(request, 1, num_drafts))
            scheduled.add(request.request_id)
            budget, seats = budget - 1 - num_drafts, seats - 1
        for request in self.requests:
            if request.is_decoding or request.request_id in scheduled:
                continue
            if not budget or not seats:
                break
            room = (len(request.blocks) + self.block_pool.num_free) * self.block_size - request.num_computed
            n = min(request.num_tokens - request.num_computed, budget, room)
            if n <= 0:
                break
            chunks.append(self._take(request, n))
            budget, seats = budget - n, seats - 1
        return chunks

    def _num_drafts(self, request: Request, budget: int) -> int:
        """Drafts to verify for a decoding request: k, fewer near its token limit or the end of
        the step's budget (every accepted draft is an output token)."""
        remaining = request.max_new_tokens - (request.num_tokens - request.num_prompt_tokens)
        return max(0, min(self.num_speculative_tokens, remaining - 1, budget - 1))

    def _blocks_short(self, request: Request, num_new: int) -> int:
        return math.ceil((request.num_computed + num_new) / self.block_size) - len(request.blocks)

    def _take(self, request: Request, num_new: int, num_drafts: int = 0) -> Chunk:
        """Allocate the blocks ``num_new`` more tokens and ``num_drafts`` drafts need (they are
        known to be free)."""
        short = self._blocks_short(request, num_new + num_drafts)
        if short > 0:
            request.blocks += self.block_pool.allocate(short)
        return Chunk(request, request.num_computed, num_new, num_drafts)

    def _make_room_for_decode(
        self, request: Request, protected: set[int], num_new: int, preempted: list[Request]
    ) -> bool:
        """Preempt later requests until ``request`` can grow by ``num_new`` tokens; False if it
        was itself preempted (or nothing could be)."""
        while self._blocks_short(request, num_new) > self.block_pool.num_free:
            victim = self._latest_block_holder(protected)
            if victim is None:
                return False
            self._preempt(victim, preempted)
            if victim is request:
                return False
        return True

    def _latest_block_holder(self, protected: set[int]) -> Request | None:
        for request in reversed(self.requests):
            if request.blocks and request.request_id not in protected:
                return request
        return None

    def _preempt(self, request: Request, preempted: list[Request]) -> None:
        logger.info(
            "KV cache full: preempting request %d (%d tokens) for recompute", request.request_id, request.num_tokens
        )
        self._release(request)
        request.num_computed = 0
        preempted.append(request)

    def _release(self, request: Request) -> None:
        self.block_pool.free(request.blocks)
        request.blocks = []
