"""UBatchWrapper: run any runnable as N overlapped ubatches, each under its own forward context."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ubatch import islands
from ubatch.attention import AttentionMetadata
from ubatch.context import (
    DPMetadata,
    ForwardContext,
    derive_context,
    get_forward_context,
    is_forward_context_available,
    override_forward_context,
)
from ubatch.intercept import intercepting_collectives
from ubatch.scheduler import DEFAULT_TIMEOUT_S, UbatchScheduler
from ubatch.slicing import UBatchSlice, check_slices, is_tensor_batched, slices_total, split_attn_metadata
from ubatch.sm import SMPartition


def make_ubatch_contexts(parent: ForwardContext, slices: Sequence[UBatchSlice]) -> list[ForwardContext]:
    """Each ubatch's context: the parent with only per-ubatch fields replaced.

    The one place child contexts are built (the run path and the capture path both call it), so
    ``skip_attention``, ``skip_compiled``, ``additional_kwargs`` and any field added later, in
    ForwardContext or a subclass, are inherited by every ubatch.
    """
    metadata = _per_ubatch(parent.attn_metadata, slices, "attn_metadata", _split_metadata_dict)
    slot_mappings = _per_ubatch(parent.slot_mapping, slices, "slot_mapping", _slice_tensor_dict)
    total = slices_total(slices)
    children = []
    for i, s in enumerate(slices):
        children.append(
            derive_context(
                parent,
                attn_metadata=metadata[i],
                slot_mapping=slot_mappings[i],
                ubatch_slices=None,
                ubatch_id=i,
                num_tokens=s.num_tokens,
                batch_descriptor=_child_descriptor(parent.batch_descriptor, s),
                dp_metadata=_child_dp_metadata(parent.dp_metadata, s),
                is_padding=parent.is_padding[s.token_slice]
                if is_tensor_batched(parent.is_padding, total)
                else parent.is_padding,
            )
        )
    return children


def _per_ubatch(value: Any, slices: Sequence[UBatchSlice], name: str, split: Callable[..., list[Any]]) -> list[Any]:
    if value is None:
        return [None] * len(slices)
    if isinstance(value, (list, tuple)):
        if len(value) != len(slices):
            raise ValueError(f"{name} holds {len(value)} per-ubatch entries but there are {len(slices)} ubatch slices")
        return list(value)
    if isinstance(value, dict):
        return split(value, slices)
    raise TypeError(f"{name} must be a dict, a per-ubatch list of dicts, or None; got {type(value).__name__}")


def _split_metadata_dict(by_layer: dict[str, Any], slices: Sequence[UBatchSlice]) -> list[dict[str, Any]]:
    """Split each distinct AttentionMetadata once (layers usually share one object)."""
    split_by_id: dict[int, list[AttentionMetadata]] = {}
    out: list[dict[str, Any]] = [{} for _ in slices]
    for layer_name, md in by_layer.items():
        if not isinstance(md, AttentionMetadata):
            raise TypeError(
                f"attn_metadata[{layer_name!r}] is a {type(md).__name__}; UBatchWrapper can split only "
                "AttentionMetadata (pass a per-ubatch list of dicts for other types)"
            )
        if id(md) not in split_by_id:
            split_by_id[id(md)] = split_attn_metadata(md, slices)
        for i, part in enumerate(split_by_id[id(md)]):
            out[i][layer_name] = part
    return out


def _slice_tensor_dict(by_layer: dict[str, Any], slices: Sequence[UBatchSlice]) -> list[dict[str, Any]]:
    return [{name: t[s.token_slice] for name, t in by_layer.items()} for s in slices]


def _child_descriptor(descriptor: Any, s: UBatchSlice) -> Any:
    if descriptor is None:
        return None
    num_reqs = None if descriptor.num_reqs is None else s.num_reqs
    return dataclasses.replace(descriptor, num_tokens=s.num_tokens, num_reqs=num_reqs)


def _child_dp_metadata(dp: DPMetadata | None, s: UBatchSlice) -> DPMetadata | None:
    """Every DP rank pads to the same total and splits alike, so each ubatch has the same size."""
    if dp is None:
        return None
    return DPMetadata(tuple(s.num_tokens for _ in dp.num_tokens_across_dp))


def slice_arguments(args: tuple, kwargs: dict, s: UBatchSlice, total: int) -> tuple[tuple, dict]:
    """A ubatch's arguments: tensors whose leading dimension is ``total`` are cut to the slice."""

    def cut(value: Any) -> Any:
        return value[s.token_slice] if is_tensor_batched(value, total) else value

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def merge_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate the ubatches' outputs along dim 0, through tuples, lists and dicts."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs), dim=0)
    if first is None:
        if any(o is not None for o in outputs):
            raise TypeError("ubatch outputs disagree: some returned None, others a value")
        return None
    if isinstance(first, dict):
        merged = {key: merge_outputs([o[key] for o in outputs]) for key in first}
        return type(first)(**merged) if _keyword_constructible(first) else type(first)(merged)
    if isinstance(first, (tuple, list)):
        parts = [merge_outputs(items) for items in zip(*outputs, strict=True)]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    if all(o == first for o in outputs[1:]):
        return first
    raise TypeError(f"cannot merge ubatch outputs of type {type(first).__name__}: they differ and are not tensors")


def _keyword_constructible(value: dict) -> bool:
    """Dataclass-like dicts (e.g. transformers' ModelOutput) are rebuilt from keywords."""
    return dataclasses.is_dataclass(value)


class UBatchWrapper:
    """Calls ``runnable`` once per ubatch slice of the current forward context, overlapped.

    Inside a forward context with two or more ``ubatch_slices`` each slice runs as a ubatch on the
    scheduler; otherwise the runnable is called directly. See DESIGN.md's contract.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        *,
        num_ubatches: int = 2,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        scheduler: UbatchScheduler | None = None,
        sm_partition: SMPartition | None = None,
    ) -> None:
        if not callable(runnable):
            raise TypeError(f"UBatchWrapper needs a callable runnable, got {type(runnable).__name__}")
        if not isinstance(num_ubatches, int) or num_ubatches < 2:
            raise ValueError(f"num_ubatches must be an int >= 2, got {num_ubatches!r}")
        if scheduler is not None and scheduler.num_ubatches < num_ubatches:
            raise ValueError(
                f"the scheduler runs {scheduler.num_ubatches} ubatches but num_ubatches={num_ubatches}"
            )
        if scheduler is not None and sm_partition is not None:
            raise ValueError("pass either a scheduler or an sm_partition (which builds the scheduler's streams)")
        self._runnable = runnable
        self.num_ubatches = num_ubatches
        self.sm_partition = sm_partition
        self.scheduler = scheduler or self._make_scheduler(num_ubatches, device, timeout_s, sm_partition)

    @staticmethod
    def _make_scheduler(num_ubatches: int, device: Any, timeout_s: float,
                        sm_partition: SMPartition | None) -> UbatchScheduler:
        if sm_partition is None:
            return UbatchScheduler(num_ubatches, device, timeout_s=timeout_s)
        compute_streams, comm_stream = sm_partition.make_streams(num_ubatches)
        return UbatchScheduler(num_ubatches, device, timeout_s=timeout_s, compute_streams=compute_streams,
                               comm_stream=comm_stream, comm_group=sm_partition.comm_group)

    def unwrap(self) -> Callable[..., Any]:
        return self._runnable

    def __getattr__(self, name: str) -> Any:
        if name == "_runnable":
            raise AttributeError(name)
        return getattr(self._runnable, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        slices = self._slices()
        if slices is None:
            return self._runnable(*args, **kwargs)
        total = slices_total(slices)
        tasks = []
        for s in slices:
            ub_args, ub_kwargs = slice_arguments(args, kwargs, s, total)
            tasks.append(functools.partial(self._runnable, *ub_args, **ub_kwargs))
        with self.sm_partition.compute_context() if self.sm_partition else contextlib.nullcontext():
            with intercepting_collectives():
                outputs = islands.run_ubatches(self.scheduler.run, tasks, self._contextualize)
        return merge_outputs(outputs)

    def _slices(self) -> list[UBatchSlice] | None:
        if not is_forward_context_available():
            return None
        slices = get_forward_context().ubatch_slices
        if slices is None or len(slices) < 2:
            return None
        if len(slices) > self.num_ubatches:
            raise ValueError(
                f"the forward context has {len(slices)} ubatch slices but this UBatchWrapper was "
                f"built for at most num_ubatches={self.num_ubatches}"
            )
        check_slices(slices)
        return list(slices)

    def _contextualize(self, tasks: list[Callable[[], Any]]) -> list[Callable[[], Any]]:
        """Each task under its ubatch's context, derived from the current one (a piecewise graph
        replay calls this again, with the replayed step's metadata and slices)."""
        children = make_ubatch_contexts(get_forward_context(), self._slices())
        return [functools.partial(_run_in_context, child, task) for child, task in zip(children, tasks)]


def _run_in_context(ctx: ForwardContext, task: Callable[[], Any]) -> Any:
    with override_forward_context(ctx):
        return task()
