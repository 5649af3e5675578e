"""ModelRunner: requests -> flattened batches, paged KV blocks, attention metadata, greedy steps.

A step is schedule -> build inputs -> execute -> sample -> update, each its own method. With
``cudagraph_capture_sizes`` (after ``capture_graphs()``) a step replays a captured graph where one
fits (FULL for decode steps, unsplit or ubatched; PIECEWISE for the rest); otherwise the eager
model call sits behind ``execute_model`` alone.

Scheduling: decodes first (arrival order), then prefill chunks in arrival order under the token
budget; a prompt longer than the remaining budget is split across steps (chunked-prefill
continuation). KV memory: a prefill that finds no free block waits (and so does every later
prefill: first come, first served); a running request that needs a block when none is free
preempts the most recently arrived request holding blocks, possibly itself, by recompute: its
blocks are freed and its prompt plus the tokens generated so far are prefilled again later.
When nothing at all could be scheduled, the most recently arrived block holder is preempted the
same way, so the earliest request always makes progress.

Speculative decoding (``draft_model`` and ``num_speculative_tokens`` k): each decoding request
is scheduled with room for k more tokens, a ``DraftModel`` proposes them, and the target
verifies all k + 1 positions in the one step (prefill chunks may share it); greedy acceptance
keeps the output exactly the target's own greedy decoding. Near its ``max_new_tokens`` (or
the step's token budget) a request drafts fewer. Ubatched verification splits on request
boundaries, so every request's k + 1 tokens stay in one ubatch.

Data parallelism (``dp_group``): every rank has its own runner and schedules its own requests;
every step every rank, idle ones too, agrees with the others through
``coordinate_batch_across_dp`` on whether to split into ubatches, the graph mode (the lowest any
rank can replay) and how many tokens each rank runs (the largest graph size proposed), then pads
its batch to that count (padding tokens: slot -1, position 0). A rank with no work
runs a step of padding only, so the expert-parallel all-to-alls (and every other collective in
the model) stay matched across ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ubatch.attention import BlockPool, PagedKVCache, build_attention_metadata
from ubatch.context import CUDAGraphMode, set_forward_context
from ubatch.cudagraph import BatchExecutionDescriptor, sizes_with_multiples
from ubatch.dp import DPBatchDecision, coordinate_batch_across_dp, dp_cpu_group, local_batch_decision
from ubatch.graphed import GraphedModel
from ubatch.models import Decoder, ModelConfig
from ubatch.policy import SplitPolicy
from ubatch.scheduler import DEFAULT_TIMEOUT_S
from ubatch.slicing import UBatchSlice, split_batch
from ubatch.spec import DraftModel, DraftRequest, SpecStats, accept_greedy
from ubatch.wrapper import UBatchWrapper

logger = logging.getLogger(__name__)


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
        return self.token_ids[self.num_prompt_tokens:]

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
        return self.request.token_ids[self.start:self.start + self.num_tokens] + list(self.draft_token_ids)


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
    proposed and accepted draft tokens."""

    new_tokens: dict[int, int] = field(default_factory=dict)
    finished: dict[int, list[int]] = field(default_factory=dict)
    num_tokens_across_dp: list[int] = field(default_factory=list)
    new_token_ids: dict[int, list[int]] = field(default_factory=dict)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class ModelRunner:
    """Serves greedy generation for one model on one rank with a paged KV cache.

    ``num_ubatches`` >= 2 runs the model through a ``UBatchWrapper`` on steps where every DP rank
    can split (1: never split). ``split_policy`` (e.g. a calibrated ``ubatch.policy.SplitPolicy``)
    then decides per step, from this rank's token count, whether it wants to: small steps, where
    a split costs more than it hides, run whole. Its pick counts only as split or not, since
    every DP rank must run the same ``num_ubatches``. ``dp_group`` makes this runner one data-parallel rank of that
    group (see the module docstring); ``timeout_s`` bounds the per-step vote and every wait
    inside a ubatch, so a peer that fails or hangs surfaces as an error, not a hang.
    ``draft_model`` with ``num_speculative_tokens`` turns on speculative decoding (with graphs
    the drafter captures its own; with ``dp_group`` it must run locally); ``spec_stats`` counts
    proposed and accepted drafts.
    """

    def __init__(
        self,
        model: Decoder,
        config: ModelConfig,
        *,
        device: torch.device | str,
        num_kv_blocks: int,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        num_ubatches: int = 1,
        dp_group: Any = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cudagraph_capture_sizes: Sequence[int] | None = None,
        max_model_len: int | None = None,
        draft_model: Decoder | None = None,
        num_speculative_tokens: int | None = None,
        split_policy: SplitPolicy | None = None,
    ) -> None:
        for name, value in (("num_kv_blocks", num_kv_blocks), ("block_size", block_size),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_num_seqs", max_num_seqs), ("num_ubatches", num_ubatches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if split_policy is not None and not callable(getattr(split_policy, "decide", None)):
            raise TypeError(f"split_policy must have a decide(num_tokens) method, got {split_policy!r}")
        if split_policy is not None and num_ubatches < 2:
            raise ValueError(f"split_policy needs num_ubatches >= 2, got {num_ubatches}")
        self.model = model
        self.config = config
        self.device = _resolved(torch.device(device))
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.kv_cache = PagedKVCache(model.layer_names, num_blocks=num_kv_blocks, block_size=block_size,
                                     num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                                     dtype=config.dtype, device=self.device)
        self.block_pool = BlockPool(num_kv_blocks)
        self._active: list[Request] = []
        self._next_id = 0
        self.num_ubatches = num_ubatches
        self.split_policy = split_policy
        self.runnable = (UBatchWrapper(model, num_ubatches=num_ubatches, device=self.device, timeout_s=timeout_s)
                         if num_ubatches > 1 else model)
        self._init_dp(dp_group, timeout_s)
        self.bind_kv_cache()
        self.max_model_len = max_model_len or num_kv_blocks * block_size
        self.drafter = self._make_drafter(draft_model, num_speculative_tokens, cudagraph_capture_sizes)
        self.num_speculative_tokens = num_speculative_tokens or 0
        self.spec_stats = SpecStats()
        self.graphs = self._make_graphs(cudagraph_capture_sizes)

    def _make_drafter(self, draft_model: Decoder | None, k: int | None,
                      capture_sizes: Sequence[int] | None) -> DraftModel | None:
        """The drafter, after checking it can serve this runner's target; it captures graphs
        of its own at the target's sizes."""
        if draft_model is None and k is None:
            return None
        if draft_model is None or k is None:
            raise ValueError(
                f"speculative decoding needs both draft_model and num_speculative_tokens, got "
                f"draft_model={'None' if draft_model is None else type(draft_model).__name__}, "
                f"num_speculative_tokens={k!r}"
            )
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if draft_model.config.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"the draft model's vocab_size={draft_model.config.vocab_size} differs from the "
                f"target's vocab_size={self.config.vocab_size}: they must share a vocabulary"
            )
        if draft_model.device != self.device:
            raise ValueError(f"the draft model is on {draft_model.device}, the runner on {self.device}")
        if self._dp_group is not None and not _is_local(draft_model):
            raise ValueError(
                "with dp_group the draft model must run locally on each rank (no tp_group or "
                "ep_group): ranks draft different numbers of steps, so its collectives would not match"
            )
        return DraftModel(draft_model, num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
                          capture_sizes=capture_sizes if capture_sizes and self.device.type == "cuda" else None,
                          max_blocks_per_req=self._max_blocks_per_req, catch_up_width=k + 1)

    @property
    def _max_blocks_per_req(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    def _make_graphs(self, capture_sizes: Sequence[int] | None) -> GraphedModel | None:
        """FULL graphs for decode steps (unsplit and ubatched), PIECEWISE for the rest; captured
        by ``capture_graphs()``. With speculation a decode step verifies k + 1 tokens per
        request: FULL graphs are keyed on that spec length, at sizes rounded up to multiples of it."""
        if not capture_sizes:
            return None
        if self.device.type != "cuda":
            raise ValueError(f"cudagraph_capture_sizes needs a CUDA device, got {self.device}")
        per_request = 1 + self.num_speculative_tokens
        return GraphedModel(self.model, capture_sizes=sizes_with_multiples(capture_sizes, [per_request]), max_blocks_per_req=self._max_blocks_per_req,
                            ubatch_counts=sorted({1, self.num_ubatches}), uniform_token_count=per_request)

    def capture_graphs(self) -> None:
        """Capture every graph (on every DP rank, which captures the same collectives)."""
        if self.graphs is None:
            raise ValueError("this runner has no cudagraph_capture_sizes")
        self.graphs.capture()
        if self.drafter is not None:
            self.drafter.capture_graphs()

    def warmup(self, num_requests: int = 8, max_new_tokens: int = 4, *, seed: int = 0) -> None:
        """Serve throwaway requests before real traffic: prompts from one token up to a full
        batch, outputs of different lengths, so steps mix prefills, continuations and decodes.
        Whatever the attention path builds on first use is then ready: flash-attn 4 compiles
        each kernel variant it meets (2-4 s apiece on an H200), cuDNN builds a plan per shape.
        Captured graphs are warmed by ``capture_graphs``. In data parallelism call it on every
        rank. The runner is left idle, every KV block free and ``spec_stats`` zeroed."""
        for name, value in (("num_requests", num_requests), ("max_new_tokens", max_new_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        longest = min(self.max_num_batched_tokens, self.max_model_len - max_new_tokens,
                      self.num_kv_blocks * self.block_size - max_new_tokens)
        if longest < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt "
                             f"(max_model_len={self.max_model_len})")
        g = torch.Generator().manual_seed(seed)
        prompt_lens = [max(1, longest * (i + 1) // num_requests) for i in range(num_requests)]
        prompts = [torch.randint(0, self.config.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
        self.generate(prompts, [1 + i % max_new_tokens for i in range(num_requests)])
        self.spec_stats = SpecStats()

    def close(self) -> None:
        """Free the captured graphs, the target's and the drafter's; later steps run eagerly.
        Call it on every rank before ``destroy_process_group``: NCCL's teardown hangs while a
        graph holding one of its collectives is alive."""
        if self.graphs is not None:
            self.graphs.release()
        if self.drafter is not None:
            self.drafter.release_graphs()

    def _init_dp(self, dp_group: Any, timeout_s: float) -> None:
        """The DP rank, size and vote group; expert parallelism needs equal token counts."""
        ep_world = max((layer.ep_world for layer in getattr(self.model, "moe_layers", {}).values()), default=1)
        if dp_group is not None and not dist.is_initialized():
            raise ValueError("dp_group was given but torch.distributed is not initialized")
        if dp_group is None and ep_world > 1:
            raise ValueError(
                f"the model is expert-parallel over {ep_world} ranks: pass dp_group so that every "
                f"rank runs every step with the same token count"
            )
        if dp_group is not None:
            _check_dp_covers_ep(dp_group, getattr(self.model, "moe_layers", {}).values())
        self._dp_group = None if dp_group is None else dp_cpu_group(dp_group, timeout_s=timeout_s)
        self.dp_rank = 0 if dp_group is None else dist.get_rank(dp_group)
        self.dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        self._pad_to_max = ep_world > 1
        self._num_steps = 0

    def bind_kv_cache(self) -> None:
        """Point every attention layer at this runner's cache tensor for it."""
        for name, layer in self.model.attention_layers.items():
            layer.kv_cache = self.kv_cache[name]

    # ----- requests -------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: Sequence[int], max_new_tokens: int) -> int:
        """Queue a request and return its id; ValueError (and nothing queued) on bad input."""
        prompt = self._validate(prompt_token_ids, max_new_tokens)
        request = Request(self._next_id, prompt, len(prompt), max_new_tokens)
        self._next_id += 1
        self._active.append(request)
        return request.request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self._active)

    def _validate(self, prompt_token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt_token_ids is empty: a request needs at least one prompt token")
        vocab = self.config.vocab_size
        for i, token in enumerate(prompt):
            if not 0 <= token < vocab:
                raise ValueError(f"prompt token {token} at index {i} is out of range [0, {vocab})")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if self.graphs is not None and len(prompt) + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"request too long for max_model_len={self.max_model_len}: prompt of {len(prompt)} tokens + "
                f"max_new_tokens={max_new_tokens}"
            )
        blocks = math.ceil((len(prompt) + max_new_tokens) / self.block_size)
        if blocks > self.num_kv_blocks:
            raise ValueError(
                f"request too long for the KV cache: prompt of {len(prompt)} tokens + max_new_tokens="
                f"{max_new_tokens} needs {blocks} blocks of {self.block_size}, the cache has "
                f"{self.num_kv_blocks}"
            )
        return prompt

    # ----- one step -------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Run one scheduled batch; returns the sampled tokens and the finished requests.

        In data parallelism call it on every rank every step, idle or not: a rank with nothing
        scheduled runs padding so the model's collectives stay matched.
        """
        self._num_steps += 1
        try:
            with torch.inference_mode():
                return self._step()
        except RuntimeError as exc:
            if self._dp_group is not None:
                exc.add_note(
                    f"on data-parallel rank {self.dp_rank} of {self.dp_size}, step {self._num_steps}: "
                    f"if a collective failed, a peer rank may have failed, exited or hung (see its log)"
                )
            raise

    def _step(self) -> StepOutput:
        chunks = self.propose_drafts(self.schedule())
        query_lens = [c.query_len for c in chunks]
        graph = self._propose_graph(query_lens)
        decision = self.decide(sum(query_lens), num_tokens_padded=graph.num_tokens if graph else None,
                               cudagraph_mode=graph.cg_mode if graph else CUDAGraphMode.NONE)
        across = decision.num_tokens_across_dp
        if not any(across):
            return StepOutput(num_tokens_across_dp=across)
        num_tokens = across[self.dp_rank]
        batch = self.build_inputs(chunks, num_tokens_padded=num_tokens)
        num_ubatches = self.num_ubatches if decision.should_ubatch else 1
        graph = self.graphs.plan(sum(query_lens), len(query_lens), _uniform(query_lens), num_ubatches=num_ubatches,
                                 num_tokens_padded=num_tokens, max_mode=decision.cudagraph_mode) if graph else None
        if graph is not None:
            hidden = self.graphs.replay(graph, batch.input_ids, batch.positions,
                                        batch.attn_metadata[self.model.layer_names[0]])
        else:
            slices = self._split(chunks, num_ubatches, num_tokens) if num_ubatches > 1 else None
            hidden = self.execute_model(batch.input_ids, batch.positions, batch.attn_metadata,
                                        slot_mapping=batch.slot_mapping, num_tokens=num_tokens,
                                        num_tokens_across_dp=across if self._dp_group is not None else None,
                                        ubatch_slices=slices)
        tokens = self.sample(hidden, batch.logits_indices)
        self.check_overflow()
        out = self.update(chunks, tokens)
        out.num_tokens_across_dp = across
        return out

    def _split(self, chunks: list[Chunk], num_ubatches: int, num_tokens: int) -> list[UBatchSlice]:
        """Token-balanced ubatches; request-aligned when the step verifies drafts (and has a
        request per ubatch), so each request's k + 1 tokens stay together."""
        query_lens = [c.query_len for c in chunks]
        aligned = any(c.draft_token_ids for c in chunks) and len(chunks) >= num_ubatches
        return split_batch(query_lens, num_ubatches, num_tokens, align_to_requests=aligned)

    def propose_drafts(self, chunks: list[Chunk], *, skip_attention: bool = False) -> list[Chunk]:
        """The chunks with the drafter's proposals filled in where the scheduler made room
        (``skip_attention`` goes down to every drafter forward)."""
        wanted = [c for c in chunks if c.num_drafts]
        if not wanted:
            return chunks
        proposals = self.drafter.propose([
            DraftRequest(c.request.request_id, c.request.token_ids, c.request.blocks, c.num_drafts)
            for c in wanted
        ], skip_attention=skip_attention)
        by_request = {c.request.request_id: tuple(d) for c, d in zip(wanted, proposals)}
        return [dataclasses.replace(c, draft_token_ids=by_request[c.request.request_id]) if c.num_drafts else c
                for c in chunks]

    def _propose_graph(self, query_lens: list[int]) -> BatchExecutionDescriptor | None:
        """The graph this rank would replay for its batch alone (its size and mode go to the vote)."""
        if self.graphs is None or not query_lens:
            return None
        return self.graphs.plan(sum(query_lens), len(query_lens), _uniform(query_lens))

    def decide(self, num_tokens: int, num_tokens_padded: int | None = None,
               cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE) -> DPBatchDecision:
        """This step's ubatch decision, graph mode and per-rank token counts: voted across the DP
        group, or local without one. Expert-parallel ranks always run the maximum count."""
        policy = self.split_policy
        wants_ubatch = self.num_ubatches > 1 and (policy is None or policy.decide(num_tokens) > 1)
        padded = num_tokens if num_tokens_padded is None else num_tokens_padded
        if self._dp_group is None:
            return local_batch_decision(num_tokens, padded, wants_ubatch=wants_ubatch,
                                        cudagraph_mode=cudagraph_mode, num_ubatches=self.num_ubatches)
        decision = coordinate_batch_across_dp(num_tokens, padded, wants_ubatch=wants_ubatch,
                                              cudagraph_mode=cudagraph_mode,
                                              num_ubatches=self.num_ubatches, group=self._dp_group)
        if self._pad_to_max:
            most = max(decision.num_tokens_across_dp)
            decision = dataclasses.replace(decision, num_tokens_across_dp=[most] * self.dp_size)
        return decision

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int]) -> list[list[int]]:
        """Greedy-generate for every prompt on an idle runner; outputs in prompt order.

        In data parallelism call it on every rank with that rank's own prompts (possibly none):
        it steps until no rank has work left.
        """
        if self._active:
            raise ValueError(
                f"generate() needs an idle runner, but {len(self._active)} requests are in flight; "
                f"drive them with step()"
            )
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(limits)} entries for {len(prompts)} prompts")
        for prompt, limit in zip(prompts, limits):
            self._validate(prompt, limit)
        ids = [self.add_request(prompt, limit) for prompt, limit in zip(prompts, limits)]
        finished: dict[int, list[int]] = {}
        while True:
            out = self.step()
            finished.update(out.finished)
            if not any(out.num_tokens_across_dp):
                return [finished[i] for i in ids]

    # ----- schedule -------------------------------------------------------------------------

    def schedule(self) -> list[Chunk]:
        """This step's chunks: decodes, then prefill chunks; preempts until something fits."""
        while self._active:
            chunks = self._try_schedule()
            if chunks:
                return chunks
            victim = self._latest_block_holder(protected=set())
            if victim is None:
                raise RuntimeError(
                    f"no request can be scheduled although no request holds KV blocks "
                    f"({self.block_pool.num_free} of {self.num_kv_blocks} free)"
                )
            self._preempt(victim)
        return []

    def _try_schedule(self) -> list[Chunk]:
        budget, seats = self.max_num_batched_tokens, self.max_num_seqs
        chunks: list[Chunk] = []
        scheduled: set[int] = set()
        for request in [r for r in self._active if r.is_decoding]:
            if not budget or not seats:
                break
            # An earlier decode may have preempted this request; then it prefills again.
            num_drafts = self._num_drafts(request, budget)
            if not request.is_decoding or not self._make_room_for_decode(request, scheduled, 1 + num_drafts):
                continue
            chunks.append(self._take(request, 1, num_drafts))
            scheduled.add(request.request_id)
            budget, seats = budget - 1 - num_drafts, seats - 1
        for request in self._active:
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

    def _make_room_for_decode(self, request: Request, protected: set[int], num_new: int) -> bool:
        """Preempt later requests until ``request`` can grow by ``num_new`` tokens; False if it
        was itself preempted (or nothing could be)."""
        while self._blocks_short(request, num_new) > self.block_pool.num_free:
            victim = self._latest_block_holder(protected)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _latest_block_holder(self, protected: set[int]) -> Request | None:
        for request in reversed(self._active):
            if request.blocks and request.request_id not in protected:
                return request
        return None

    def _preempt(self, request: Request) -> None:
        logger.info("KV cache full: preempting request %d (%d tokens) for recompute",
                    request.request_id, request.num_tokens)
        self._release(request)
        request.num_computed = 0

    def _release(self, request: Request) -> None:
        """Free a request's blocks, in both caches (the drafter's state in them goes too)."""
        self.block_pool.free(request.blocks)
        request.blocks = []
        if self.drafter is not None:
            self.drafter.forget(request.request_id)

    # ----- inputs, model call, sampling -----------------------------------------------------

    def build_inputs(self, chunks: list[Chunk], num_tokens_padded: int | None = None) -> BatchInputs:
        """Flattened token ids / positions, block table, slot mapping and attention metadata,
        padded at the end to ``num_tokens_padded`` (padding: token 0, position 0, slot -1; no
        chunks at all makes a step of padding only)."""
        bs = self.block_size
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
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=self.device)
        metadata = build_attention_metadata(
            [c.query_len for c in chunks],
            [c.start + c.query_len for c in chunks],
            torch.tensor(table, dtype=torch.int32).view(len(chunks), width),
            slot_mapping,
            device=self.device,
        )
        names = self.model.layer_names
        return BatchInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            attn_metadata={name: metadata for name in names},
            slot_mapping={name: metadata.slot_mapping for name in names},
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            num_tokens=len(input_ids),
        )

    def execute_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: dict[str, Any],
        *,
        slot_mapping: dict[str, torch.Tensor] | None = None,
        num_tokens: int | None = None,
        num_tokens_across_dp: list[int] | None = None,
        ubatch_slices: list[UBatchSlice] | None = None,
    ) -> torch.Tensor:
        """The model call under its forward context; the one place to wrap or replace it.

        With ``ubatch_slices`` the runnable (a UBatchWrapper) runs one ubatch per slice."""
        with set_forward_context(
            attn_metadata,
            slot_mapping=slot_mapping,
            num_tokens=input_ids.shape[0] if num_tokens is None else num_tokens,
            num_tokens_across_dp=num_tokens_across_dp,
            ubatch_slices=ubatch_slices,
            no_compile_layers=self.model.attention_layers,
        ):
            return self.runnable(input_ids, positions)

    def sample(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> list[int]:
        """Greedy tokens for the rows at ``logits_indices`` (one host sync)."""
        if logits_indices.numel() == 0:
            return []
        return self.model.compute_logits(hidden[logits_indices]).argmax(dim=-1).tolist()

    def check_overflow(self) -> None:
        """RuntimeError naming every MoE layer that dropped assignments this step (counters
        are reset first, so the runner stays usable)."""
        counters = self.model.overflow_counters()
        if not counters:
            return
        counts = torch.stack(list(counters.values())).tolist()
        for counter in counters.values():
            counter.zero_()
        overflowed = [f"{name}: {count}" for name, count in zip(counters, counts) if count]
        if overflowed:
            raise RuntimeError(
                f"MoE capacity overflow (capacity_factor={self.config.capacity_factor}): dropped "
                f"(token, expert) assignments per layer: {', '.join(overflowed)}; raise "
                f"capacity_factor or set it to None"
            )

    # ----- update ---------------------------------------------------------------------------

    def update(self, chunks: list[Chunk], tokens: list[int]) -> StepOutput:
        """Advance computed counts, append sampled (and accepted draft) tokens, release finished
        requests. Rejected drafts are rolled back by not counting them as computed."""
        out = StepOutput()
        sampled = iter(tokens)
        for chunk in chunks:
            request = chunk.request
            reaches_end = chunk.reaches_end
            request.num_computed = chunk.start + chunk.num_tokens
            if reaches_end:
                self._append(request, chunk.draft_token_ids,
                             [next(sampled) for _ in range(1 + len(chunk.draft_token_ids))], out)
            if request.is_finished:
                self._release(request)
                self._active.remove(request)
                out.finished[request.request_id] = request.output
        return out

    def _append(self, request: Request, drafts: tuple[int, ...], target_tokens: list[int], out: StepOutput) -> None:
        """Greedy acceptance: the accepted drafts are now computed, in both caches."""
        new = accept_greedy(drafts, target_tokens)
        request.token_ids += new
        request.num_computed += len(new) - 1
        out.new_tokens[request.request_id] = new[-1]
        out.new_token_ids[request.request_id] = new
        if drafts:
            self.drafter.rollback(request.request_id, request.num_computed)
            self.spec_stats.record(len(drafts), len(new) - 1)
            out.num_draft_tokens += len(drafts)
            out.num_accepted_tokens += len(new) - 1


def forward_sequences(model: Decoder, sequences: Sequence[Sequence[int]], *, block_size: int = 16) -> torch.Tensor:
    """Hidden states [sum(len), hidden] of whole sequences run as fresh prefills with a private
    KV cache: the no-history reference that runner and sharded-model outputs are checked
    against. The layers' own cache bindings are restored afterwards."""
    lengths = [len(s) for s in sequences]
    num_blocks = [math.ceil(n / block_size) for n in lengths]
    cache = PagedKVCache(model.layer_names, num_blocks=sum(num_blocks), block_size=block_size,
                         num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                         dtype=model.config.dtype, device=model.device)
    width = max(num_blocks)
    table, slots, positions, first = [], [], [], 0
    for n, nb in zip(lengths, num_blocks):
        table.append(list(range(first, first + nb)) + [0] * (width - nb))
        slots += range(first * block_size, first * block_size + n)
        positions += range(n)
        first += nb
    metadata = build_attention_metadata(lengths, lengths, torch.tensor(table, dtype=torch.int32),
                                        torch.tensor(slots, dtype=torch.int64), device=model.device)
    input_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=model.device)
    previous = {name: layer.kv_cache for name, layer in model.attention_layers.items()}
    try:
        for name, layer in model.attention_layers.items():
            layer.kv_cache = cache[name]
        with torch.inference_mode(), set_forward_context(
            {name: metadata for name in model.layer_names}, no_compile_layers=model.attention_layers
        ):
            return model(input_ids, torch.tensor(positions, dtype=torch.int64, device=model.device))
    finally:
        for name, layer in model.attention_layers.items():
            layer.kv_cache = previous[name]


def _uniform(query_lens: list[int]) -> int | None:
    """Tokens per request when every request of the step has the same count, else None."""
    return query_lens[0] if query_lens and len(set(query_lens)) == 1 else None


def _check_dp_covers_ep(dp_group: Any, moe_layers: Any) -> None:
    """Every expert-parallel peer must vote in the DP group: the vote is what pads all of them
    to one token count, and all-to-alls between ranks with different counts do not match."""
    dp_ranks = set(dist.get_process_group_ranks(dp_group))
    for layer in moe_layers:
        if layer.ep_group is None:
            continue
        outside = sorted(set(dist.get_process_group_ranks(layer.ep_group)) - dp_ranks)
        if outside:
            raise ValueError(
                f"the model's expert-parallel group includes ranks {outside} outside dp_group "
                f"(ranks {sorted(dp_ranks)}): they would not join the per-step vote, so their "
                f"all-to-alls could not be padded to match; use a dp_group that covers the EP group"
            )


def _is_local(model: Decoder) -> bool:
    """Whether ``model`` runs without collectives (no tensor- or expert-parallel group)."""
    return all(getattr(m, "tp_group", None) is None and getattr(m, "ep_group", None) is None
               for m in model.modules())


def _resolved(device: torch.device) -> torch.device:
    """``cuda`` as the device it means (``cuda:<current>``), so it compares equal to a model's."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
