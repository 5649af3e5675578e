"""ModelRunner: greedy generation for one model on one rank, step by step.

A step is schedule (``RequestScheduler``) -> propose drafts -> agree with the other DP ranks ->
build inputs -> execute -> sample -> update, each its own method. With
``cudagraph_capture_sizes`` (after ``capture_graphs()``) a step replays a captured graph where one
fits (FULL for decode steps, unsplit or ubatched; PIECEWISE for the rest); otherwise the eager
model call sits behind ``execute_model`` alone.

Speculative decoding (``draft_model`` and ``num_speculative_tokens`` k; see ``drafting``):
the target verifies a drafter's k proposals per decoding request in the one step.

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
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ubatch.attention import PagedKVCache
from ubatch.context import CUDAGraphMode, set_forward_context, static_collectives
from ubatch.dp import DPBatchDecision, coordinate_batch_across_dp, dp_cpu_group, local_batch_decision
from ubatch.models import Decoder, ModelConfig
from ubatch.overlap import OverlapMode, apply_mode
from ubatch.policy import ModePolicy, SplitPolicy
from ubatch.runner.batch import BatchInputs, Chunk, StepOutput, build_batch_inputs
from ubatch.runner.checks import (
    check_count,
    check_dp_group,
    check_moe_overflow,
    check_options,
    check_vocab,
    checked_request,
    per_prompt_limits,
)
from ubatch.runner.drafting import forget_drafts, make_drafter, with_drafts
from ubatch.runner.graphs import make_graphs, plan_graph, propose_graph
from ubatch.runner.modes import check_same_modes_across_dp, most_tokens_across_dp, resolve_modes, serving_mode
from ubatch.runner.scheduling import RequestScheduler
from ubatch.runner.update import update_requests
from ubatch.runner.warmup import warmup_requests
from ubatch.scheduler import DEFAULT_TIMEOUT_S
from ubatch.slicing import UBatchSlice, split_batch
from ubatch.spec import SpecStats


class ModelRunner:
    """Serves greedy generation for one model on one rank with a paged KV cache.

    ``num_ubatches`` >= 2 runs the model through a ``UBatchWrapper`` on steps where every DP rank
    can split (1: never split). ``split_policy`` (e.g. a calibrated ``ubatch.policy.SplitPolicy``)
    then decides per step, from this rank's token count, whether it wants to: small steps, where
    a split costs more than it hides, run whole. Its pick counts only as split or not, since
    every DP rank must run the same ``num_ubatches``. ``dp_group`` makes this runner one data-parallel rank of that
    group (see the module docstring); ``timeout_s`` bounds the per-step vote and every wait
    inside a ubatch, so a peer that fails or hangs surfaces as an error, not a hang.
    ``max_model_len`` (default: the whole cache) bounds every request's prompt plus
    ``max_new_tokens``. ``draft_model`` with ``num_speculative_tokens`` turns on speculative
    decoding (with graphs the drafter captures its own; with ``dp_group`` it must run locally);
    ``spec_stats`` counts proposed and accepted drafts. ``overlap_mode`` (an
    ``ubatch.overlap.OverlapMode`` or its name, e.g. ``"pipeline2"``, ``"split2+join"``,
    ``"split2@green16"``) serves every step in that mode instead of a plain ``num_ubatches`` split:
    it sets the MoE layers' expert groups and joining, runs unsplit steps as one ubatch, and
    gives the comm stream its SM partition. A ``ModePolicy`` instead serves each step in the
    mode it picks for the step's token count (the largest over DP ranks), each mode with graphs
    of its own. Every DP rank must pass the same mode or policy.
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
        overlap_mode: OverlapMode | str | ModePolicy | None = None,
    ) -> None:
        for name, value in (
            ("num_kv_blocks", num_kv_blocks),
            ("block_size", block_size),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("num_ubatches", num_ubatches),
        ):
            check_count(name, value)
        if max_model_len is not None:
            check_count("max_model_len", max_model_len)
        modes, self._mode_policy = resolve_modes(overlap_mode, num_ubatches)
        check_options(split_policy, self._mode_policy, num_ubatches, timeout_s)
        check_vocab(model, config)
        self.model = model
        self.config = config
        self.device = _resolved(torch.device(device))
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.kv_cache = PagedKVCache.for_model(
            model, num_blocks=num_kv_blocks, block_size=block_size, device=self.device, dtype=config.dtype
        )
        self.split_policy = split_policy
        self._init_dp(dp_group, timeout_s)
        if dp_group is not None:
            check_same_modes_across_dp(modes, self._mode_policy, self._dp_group)  # the gloo vote group
        self._serving = {mode.name: serving_mode(model, mode, self.device, timeout_s) for mode in modes}
        self.bind_kv_cache()
        self.max_model_len = max_model_len or num_kv_blocks * block_size
        self.drafter = make_drafter(
            draft_model,
            num_speculative_tokens,
            config=config,
            device=self.device,
            dp_group=self._dp_group,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            capture_sizes=cudagraph_capture_sizes,
            max_blocks_per_req=self._max_blocks_per_req,
        )
        self.num_speculative_tokens = num_speculative_tokens or 0
        self.spec_stats = SpecStats()
        self.scheduler = RequestScheduler(
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            num_speculative_tokens=self.num_speculative_tokens,
        )
        for serving in self._serving.values():
            serving.graphs = make_graphs(
                model,
                cudagraph_capture_sizes,
                serving,
                device=self.device,
                num_speculative_tokens=self.num_speculative_tokens,
                max_blocks_per_req=self._max_blocks_per_req,
            )
        self._activate(modes[0].name)

    @property
    def block_pool(self) -> Any:
        """The KV block free list (the scheduler's)."""
        return self.scheduler.block_pool

    @property
    def _max_blocks_per_req(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    def _activate(self, name: str) -> None:
        """Serve the next step in mode ``name``: the model's MoE layers, the runnable, the graphs
        and the ubatch count are that mode's."""
        serving = self._serving[name]
        apply_mode(self.model, serving.mode)
        self.overlap_mode = serving.mode
        self.num_ubatches = serving.mode.num_ubatches
        self.runnable = serving.runnable
        self.graphs = serving.graphs
        self._single_batch = serving.single_batch

    def capture_graphs(self) -> None:
        """Capture every graph, every serving mode's with that mode in force (on every DP rank,
        which captures the same collectives)."""
        if self.graphs is None:
            raise ValueError("this runner has no cudagraph_capture_sizes")
        active = self.overlap_mode.name
        for name, serving in self._serving.items():
            self._activate(name)
            serving.graphs.capture()
        self._activate(active)
        if self.drafter is not None:
            self.drafter.capture_graphs()

    def warmup(self, num_requests: int = 8, max_new_tokens: int = 4, *, seed: int = 0) -> None:
        """Serve throwaway requests before real traffic: prompts from one token up to a full
        batch, outputs of different lengths, so steps mix prefills, continuations and decodes.
        Whatever the attention path builds on first use is then ready: flash-attn 4 compiles
        each kernel variant it meets (2-4 s apiece on an H200), cuDNN builds a plan per shape.
        Captured graphs are warmed by ``capture_graphs``. In data parallelism call it on every
        rank. The runner is left idle, every KV block free and ``spec_stats`` zeroed."""
        prompts, limits = warmup_requests(
            num_requests,
            max_new_tokens,
            seed=seed,
            vocab_size=self.config.vocab_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            kv_capacity=self.num_kv_blocks * self.block_size,
        )
        self.generate(prompts, limits)
        self.spec_stats = SpecStats()

    def close(self) -> None:
        """Free the captured graphs, the target's and the drafter's; later steps run eagerly.
        Call it on every rank before ``destroy_process_group``: NCCL's teardown hangs while a
        graph holding one of its collectives is alive."""
        for serving in self._serving.values():
            if serving.graphs is not None:
                serving.graphs.release()
        if self.drafter is not None:
            self.drafter.release_graphs()

    def _init_dp(self, dp_group: Any, timeout_s: float) -> None:
        """The DP rank, size and vote group; expert parallelism needs equal token counts."""
        ep_world = max((layer.ep_world for layer in getattr(self.model, "moe_layers", {}).values()), default=1)
        check_dp_group(dp_group, self.model, ep_world)
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
        """Queue a request and return its id; ValueError / TypeError (and nothing queued) on bad input."""
        prompt = self._validate(prompt_token_ids, max_new_tokens)
        return self.scheduler.add(prompt, max_new_tokens).request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def _validate(self, prompt_token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        return checked_request(
            prompt_token_ids,
            max_new_tokens,
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
            scheduler=self.scheduler,
        )

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
        if self._mode_policy is not None:
            self._activate(self._mode_policy.decide(most_tokens_across_dp(sum(query_lens), self._dp_group)))
        graph = propose_graph(self.graphs, query_lens)
        decision = self.decide(
            sum(query_lens),
            num_tokens_padded=graph.num_tokens if graph else None,
            cudagraph_mode=graph.cg_mode if graph else CUDAGraphMode.NONE,
        )
        across = decision.num_tokens_across_dp
        if not any(across):
            return StepOutput(num_tokens_across_dp=across, overlap_mode=self.overlap_mode.name)
        num_tokens = across[self.dp_rank]
        batch = self.build_inputs(chunks, num_tokens_padded=num_tokens)
        num_ubatches = self.num_ubatches if decision.should_ubatch else 1
        graph = (
            plan_graph(
                self.graphs,
                query_lens,
                num_ubatches=num_ubatches,
                num_tokens_padded=num_tokens,
                max_mode=decision.cudagraph_mode,
            )
            if graph
            else None
        )
        if graph is not None:
            hidden = self.graphs.replay(
                graph, batch.input_ids, batch.positions, batch.attn_metadata[self.model.layer_names[0]]
            )
        else:
            # a rank with only padding runs it plain: one ubatch or none issues the same collectives
            as_ubatches = num_ubatches > 1 or (self._single_batch and bool(chunks))
            slices = self._split(chunks, num_ubatches, num_tokens) if as_ubatches else None
            # peers may replay a graph of this step (the vote allowed one): issue what a replay would
            replaying_peers = self._dp_group is not None and decision.cudagraph_mode != CUDAGraphMode.NONE
            with static_collectives(replaying_peers):
                hidden = self.execute_model(
                    batch.input_ids,
                    batch.positions,
                    batch.attn_metadata,
                    slot_mapping=batch.slot_mapping,
                    num_tokens=num_tokens,
                    num_tokens_across_dp=across if self._dp_group is not None else None,
                    ubatch_slices=slices,
                )
        tokens = self.sample(hidden, batch.logits_indices)
        self.check_overflow()
        out = self.update(chunks, tokens)
        out.num_tokens_across_dp = across
        out.num_ubatches = num_ubatches
        out.overlap_mode = self.overlap_mode.name
        return out

    def schedule(self) -> list[Chunk]:
        """This step's chunks (see ``RequestScheduler.schedule``); the drafter forgets the
        requests preempted on the way."""
        chunks, preempted = self.scheduler.schedule()
        for request in preempted:
            forget_drafts(self.drafter, request)
        return chunks

    def _split(self, chunks: list[Chunk], num_ubatches: int, num_tokens: int) -> list[UBatchSlice]:
        """Token-balanced ubatches; request-aligned when the step verifies drafts (and has a
        request per ubatch), so each request's k + 1 tokens stay together."""
        query_lens = [c.query_len for c in chunks]
        aligned = any(c.draft_token_ids for c in chunks) and len(chunks) >= num_ubatches
        return split_batch(query_lens, num_ubatches, num_tokens, align_to_requests=aligned)

    def propose_drafts(self, chunks: list[Chunk], *, skip_attention: bool = False) -> list[Chunk]:
        """The chunks with the drafter's proposals filled in where the scheduler made room
        (``skip_attention`` goes down to every drafter forward)."""
        return with_drafts(self.drafter, chunks, skip_attention=skip_attention)

    def decide(
        self, num_tokens: int, num_tokens_padded: int | None = None, cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    ) -> DPBatchDecision:
        """This step's ubatch decision, graph mode and per-rank token counts: voted across the DP
        group, or local without one. Expert-parallel ranks always run the maximum count."""
        policy = self.split_policy
        wants_ubatch = self.num_ubatches > 1 and (policy is None or policy.decide(num_tokens) > 1)
        padded = num_tokens if num_tokens_padded is None else num_tokens_padded
        if self._dp_group is None:
            return local_batch_decision(
                num_tokens,
                padded,
                wants_ubatch=wants_ubatch,
                cudagraph_mode=cudagraph_mode,
                num_ubatches=self.num_ubatches,
            )
        decision = coordinate_batch_across_dp(
            num_tokens,
            padded,
            wants_ubatch=wants_ubatch,
            cudagraph_mode=cudagraph_mode,
            num_ubatches=self.num_ubatches,
            group=self._dp_group,
        )
        if self._pad_to_max:
            most = max(decision.num_tokens_across_dp)
            decision = dataclasses.replace(decision, num_tokens_across_dp=[most] * self.dp_size)
        return decision

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> list[list[int]]:
        """Greedy-generate for every prompt on an idle runner; outputs in prompt order.

        In data parallelism call it on every rank with that rank's own prompts (possibly none):
        it steps until no rank has work left.
        """
        if self.scheduler.requests:
            raise ValueError(
                f"generate() needs an idle runner, but {len(self.scheduler.requests)} requests are in flight; "
                f"drive them with step()"
            )
        limits = per_prompt_limits(prompts, max_new_tokens)
        for prompt, limit in zip(prompts, limits):
            self._validate(prompt, limit)
        ids = [self.add_request(prompt, limit) for prompt, limit in zip(prompts, limits)]
        finished: dict[int, list[int]] = {}
        while True:
            out = self.step()
            finished.update(out.finished)
            if not any(out.num_tokens_across_dp):
                return [finished[i] for i in ids]

    # ----- inputs, model call, sampling -----------------------------------------------------

    def build_inputs(self, chunks: list[Chunk], num_tokens_padded: int | None = None) -> BatchInputs:
        """This step's device inputs (see ``build_batch_inputs``)."""
        return build_batch_inputs(
            chunks,
            block_size=self.block_size,
            layer_names=self.model.layer_names,
            device=self.device,
            num_tokens_padded=num_tokens_padded,
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
        check_moe_overflow(self.model, self.config.capacity_factor)

    # ----- update ---------------------------------------------------------------------------

    def update(self, chunks: list[Chunk], tokens: list[int]) -> StepOutput:
        """Advance computed counts, append sampled (and accepted draft) tokens, release finished
        requests. Rejected drafts are rolled back by not counting them as computed."""
        return update_requests(
            chunks, tokens, scheduler=self.scheduler, drafter=self.drafter, spec_stats=self.spec_stats
        )


def _resolved(device: torch.device) -> torch.device:
    """``cuda`` as the device it means (``cuda:<current>``), so it compares equal to a model's."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
