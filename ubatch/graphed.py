"""A model behind a CudaGraphManager: FULL graphs for uniform batches (unsplit or ubatched),
PIECEWISE for the rest, eager when nothing fits. The runner, the graph benchmark and the GPU
tests use it; the model is called as ``model(input_ids, positions)`` on a flattened batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ubatch.attention import AttentionMetadata, build_attention_metadata
from ubatch.context import CUDAGraphMode, set_forward_context
from ubatch.cudagraph import BatchExecutionDescriptor, CudaGraphManager, dispatch, make_descriptors
from ubatch.slicing import split_batch
from ubatch.static_batch import StaticUniformBatch
from ubatch.wrapper import UBatchWrapper


class GraphedModel:
    """Runs ``model(input_ids, positions)`` steps through captured graphs where one fits."""

    def __init__(
        self,
        model: Any,
        *,
        capture_sizes: Sequence[int],
        max_blocks_per_req: int,
        ubatch_counts: Sequence[int] = (1,),
        uniform_token_count: int | Sequence[int] = 1,
        modes: Sequence[CUDAGraphMode] = (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE),
        use_breakable_cg: bool = False,
        graph_backend: Any = None,
        sm_partition: Any = None,
        single_batch_overlap: bool = False,
    ) -> None:
        self.model = model
        self.single_batch_overlap = single_batch_overlap
        self.max_blocks_per_req = max_blocks_per_req
        self.manager = CudaGraphManager(device=model.device, use_breakable_cg=use_breakable_cg, backend=graph_backend)
        self.descriptors = make_descriptors(
            capture_sizes, modes=modes, uniform_token_count=uniform_token_count, ubatch_counts=ubatch_counts
        )
        self.wrappers = {
            n: UBatchWrapper(model, num_ubatches=n, device=model.device, sm_partition=sm_partition)
            for n in ubatch_counts
            if n > 1 or single_batch_overlap
        }
        self.static: dict[BatchExecutionDescriptor, Any] = {}

    def _runnable(self, num_ubatches: int) -> Any:
        return self.wrappers.get(num_ubatches, self.model)

    def _slices(self, query_lens: Sequence[int], num_ubatches: int, num_tokens: int | None = None) -> Any:
        """The step's ubatch slices: None runs it plainly; one slice runs it unsplit as a single
        ubatch, its collectives on the comm stream (single-batch overlap)."""
        if num_ubatches == 1 and not self.single_batch_overlap:
            return None
        return split_batch(query_lens, num_ubatches, num_tokens)

    def _create_forward_fn(self, desc: BatchExecutionDescriptor):
        model = self.model
        if desc.cg_mode == CUDAGraphMode.FULL:
            static = StaticUniformBatch(
                desc, layer_names=model.layer_names, max_blocks_per_req=self.max_blocks_per_req, device=model.device
            )
            self.static[desc] = static
            metadata, kwargs = static.attn_metadata(), static.forward_context_kwargs()
            if desc.num_ubatches == 1 and self.single_batch_overlap:
                kwargs["ubatch_slices"] = self._slices([desc.uniform_token_count] * desc.num_reqs, 1)
        else:
            static = _StaticTokens(desc.num_tokens, model.device)
            self.static[desc] = static
            metadata, kwargs = self._dummy_metadata(desc.num_tokens), {"num_tokens": desc.num_tokens}
            kwargs["ubatch_slices"] = self._slices([desc.num_tokens], desc.num_ubatches)
        runnable = self._runnable(desc.num_ubatches)

        skip_attention = self.manager.skip_attention_for(desc)

        def forward_fn(mode: CUDAGraphMode) -> torch.Tensor:
            with set_forward_context(
                metadata,
                no_compile_layers=model.attention_layers,
                cudagraph_runtime_mode=mode,
                skip_attention=skip_attention,
                **kwargs,
            ):
                return runnable(static.input_ids, static.positions)

        return forward_fn

    def _dummy_metadata(self, num_tokens: int) -> dict[str, AttentionMetadata]:
        """One request of ``num_tokens`` that writes no KV: what a breakable capture attends
        over (a default PIECEWISE capture skips attention and never reads it)."""
        device = self.model.device
        md = build_attention_metadata(
            [num_tokens],
            [num_tokens],
            torch.zeros(1, self.max_blocks_per_req, dtype=torch.int32, device=device),
            torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            device=device,
        )
        return {name: md for name in self.model.layer_names}

    def capture(self) -> None:
        for wrapper in self.wrappers.values():
            wrapper.scheduler.prepare()
        with torch.inference_mode():
            self.manager.capture(self._create_forward_fn, self.descriptors)

    def release(self) -> None:
        """Free the graphs and their static buffers (see ``CudaGraphManager.release``)."""
        self.manager.release()
        self.static.clear()

    def plan(
        self,
        num_tokens: int,
        num_reqs: int,
        uniform_token_count: int | None,
        *,
        num_ubatches: int = 1,
        num_tokens_padded: int | None = None,
        max_mode: CUDAGraphMode = CUDAGraphMode.FULL,
    ) -> BatchExecutionDescriptor | None:
        """The graph a batch would replay: the smallest fitting descriptor, or one of exactly
        ``num_tokens_padded`` tokens when given (data-parallel ranks must all run one size), of a
        mode no higher than ``max_mode``; None means eager."""
        if not self.manager.enabled:
            return None
        fits = [
            d
            for d in self.manager.graphs
            if d.cg_mode <= max_mode
            and (num_tokens_padded is None or d.num_tokens == num_tokens_padded)
            and (d.num_ubatches - 1) * d.num_tokens // d.num_ubatches < num_tokens
        ]  # no all-padding ubatch
        target = num_tokens if num_tokens_padded is None else num_tokens_padded
        return dispatch(
            fits, target, num_reqs=num_reqs, uniform_token_count=uniform_token_count, num_ubatches=num_ubatches
        )

    def replay(
        self,
        desc: BatchExecutionDescriptor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Replay ``desc`` on this batch: hidden states ``[desc.num_tokens, H]`` (rows past the
        batch's tokens are padding)."""
        static = self.static[desc]
        static.fill(input_ids, positions, metadata)
        if desc.cg_mode == CUDAGraphMode.FULL:
            return self.manager.replay(desc)
        slices = self._slices(metadata.query_lens(), desc.num_ubatches, desc.num_tokens)
        with set_forward_context(
            {n: metadata for n in self.model.layer_names},
            no_compile_layers=self.model.attention_layers,
            ubatch_slices=slices,
            cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
            num_tokens=desc.num_tokens,
        ):
            return self.manager.replay(desc)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, *, num_ubatches: int = 1
    ) -> torch.Tensor:
        """The step's hidden states ``[num_actual_tokens, H]``, replayed where a graph fits."""
        desc = self.plan(
            metadata.num_actual_tokens, metadata.num_reqs, uniform_token_count(metadata), num_ubatches=num_ubatches
        )
        with torch.inference_mode():
            if desc is None:
                return self.eager(input_ids, positions, metadata, num_ubatches=num_ubatches)
            return self.replay(desc, input_ids, positions, metadata)[: metadata.num_actual_tokens]

    def eager(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, *, num_ubatches: int = 1
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        slices = self._slices(metadata.query_lens(), num_ubatches)
        with (
            torch.inference_mode(),
            set_forward_context(
                {n: metadata for n in self.model.layer_names},
                no_compile_layers=self.model.attention_layers,
                ubatch_slices=slices,
                num_tokens=num_tokens,
            ),
        ):
            return self._runnable(num_ubatches)(input_ids[:num_tokens], positions[:num_tokens])


class _StaticTokens:
    """Input buffers of a PIECEWISE graph (its metadata stays eager: islands read the real one)."""

    def __init__(self, num_tokens: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        n = metadata.num_actual_tokens
        self.input_ids[:n].copy_(input_ids[:n])
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(positions[:n])
        self.positions[n:].zero_()


def uniform_token_count(metadata: AttentionMetadata) -> int | None:
    """Tokens per request when every request has the same query length, else None."""
    if metadata.max_query_len * metadata.num_reqs == metadata.num_actual_tokens:
        return metadata.max_query_len
    return None
