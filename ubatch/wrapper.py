"""UBatchWrapper: run any runnable as N overlapped ubatches, each under its own forward context."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from ubatch import islands
from ubatch.arguments import ArgumentKey, ArgumentSplitter, merge_outputs
from ubatch.context import (
    DPMetadata,
    ForwardContext,
    derive_context,
    get_forward_context,
    is_forward_context_available,
    override_forward_context,
)
from ubatch.intercept import intercepting_collectives
from ubatch.scheduler import DEFAULT_TIMEOUT_S, UBatchScheduler, check_num_ubatches
from ubatch.slicing import UBatchSlice, check_slices, even_slices, is_tensor_batched, slices_total, split_metadata
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
    if len(slices) == 1 and isinstance(value, dict):
        return [value]  # one slice covers the whole step: nothing to split
    if isinstance(value, (list, tuple)):
        if len(value) != len(slices):
            raise ValueError(f"{name} holds {len(value)} per-ubatch entries but there are {len(slices)} ubatch slices")
        return list(value)
    if isinstance(value, dict):
        return split(value, slices)
    raise TypeError(f"{name} must be a dict, a per-ubatch list of dicts, or None; got {type(value).__name__}")


def _split_metadata_dict(by_layer: dict[str, Any], slices: Sequence[UBatchSlice]) -> list[dict[str, Any]]:
    """Split each distinct metadata object once (layers usually share one), whatever its type
    (see ``ubatch.slicing.split_metadata``)."""
    split_by_id: dict[int, list[Any]] = {}
    out: list[dict[str, Any]] = [{} for _ in slices]
    for layer_name, md in by_layer.items():
        if id(md) not in split_by_id:
            split_by_id[id(md)] = split_metadata(md, slices, name=f"attn_metadata[{layer_name!r}]")
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


class UBatchWrapper(torch.nn.Module):
    """Calls the wrapped runnable once per ubatch, overlapped, and merges the outputs.

    Inside a forward context with ``ubatch_slices`` each slice runs as a ubatch on the scheduler.
    One slice runs the step unsplit as a single ubatch: its collectives still go to the comm
    stream, so work the model issues between starting one and waiting for it overlaps the
    transfer (single-batch overlap, docs/overlap-modes.md). With no forward context at all and
    ``batched`` declared, the wrapper splits the declared batch dimension itself into
    ``num_ubatches`` even parts (fewer when there are fewer rows; one row runs whole). Otherwise
    (a context without slices, or nothing declared) it calls the runnable directly. See
    docs/design.md.

    Arguments: a tensor is split when declared in ``batched`` (argument name or positional index
    -> the dim to split along) or when its leading dimension equals the slices' total (along dim
    0); it is passed whole to every ubatch only when declared in ``shared``; any other tensor is
    a ValueError. Outputs merge along the split dimension (dim 0, or the one dim all ``batched``
    declarations share).

    A module is owned as the submodule ``module``, so ``.to()``, ``.eval()``, ``parameters()``,
    hooks and the like reach it; ``state_dict()`` and ``load_state_dict()`` use the module's
    own keys (no ``module.`` prefix), so a checkpoint of the unwrapped model loads into the
    wrapper and back. Any other callable is kept as the plain attribute ``module``. Attribute
    access for names the wrapper lacks falls through to it. The scheduler's device is fixed at
    construction (``device=None``: CUDA where available): ``.to()`` moves the weights, not it.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        *,
        num_ubatches: int = 2,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        scheduler: UBatchScheduler | None = None,
        sm_partition: SMPartition | None = None,
        batched: Mapping[ArgumentKey, int] | None = None,
        shared: Collection[ArgumentKey] = (),
    ) -> None:
        super().__init__()
        if not callable(runnable):
            raise TypeError(f"UBatchWrapper needs a callable runnable, got {type(runnable).__name__}")
        num_ubatches = check_num_ubatches(num_ubatches)
        if scheduler is not None and not isinstance(scheduler, UBatchScheduler):
            raise TypeError(f"scheduler must be a UBatchScheduler, got {type(scheduler).__name__}")
        if scheduler is not None and scheduler.num_ubatches < num_ubatches:
            raise ValueError(f"the scheduler runs {scheduler.num_ubatches} ubatches but num_ubatches={num_ubatches}")
        if scheduler is not None and sm_partition is not None:
            raise ValueError("pass either a scheduler or an sm_partition (which builds the scheduler's streams)")
        self._arguments = ArgumentSplitter(runnable, batched, shared)
        self.module = runnable
        self.num_ubatches = num_ubatches
        self.sm_partition = sm_partition
        self.scheduler = scheduler or self._make_scheduler(num_ubatches, device, timeout_s, sm_partition)
        self.register_state_dict_post_hook(_drop_module_prefix)
        self.register_load_state_dict_pre_hook(_add_module_prefix)

    @staticmethod
    def _make_scheduler(
        num_ubatches: int, device: Any, timeout_s: float, sm_partition: SMPartition | None
    ) -> UBatchScheduler:
        if sm_partition is None:
            return UBatchScheduler(num_ubatches, device, timeout_s=timeout_s)
        compute_streams, comm_stream = sm_partition.make_streams(num_ubatches)
        return UBatchScheduler(
            num_ubatches,
            device,
            timeout_s=timeout_s,
            compute_streams=compute_streams,
            comm_stream=comm_stream,
            comm_group=sm_partition.comm_group,
        )

    def unwrap(self) -> Callable[..., Any]:
        return self.module

    def __getattr__(self, name: str) -> Any:
        with contextlib.suppress(AttributeError):
            return super().__getattr__(name)  # parameters, buffers, submodules (``module`` among them)
        inner = self.__dict__.get("_modules", {}).get("module", self.__dict__.get("module"))
        if inner is None:  # still in __init__, or a name nothing defines
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a wrapped model's ``generate`` (transformers') would call the model, not the
        wrapper, and run every step unsplit without a word."""
        raise RuntimeError(
            "UBatchWrapper does not ubatch generate(): it would run every step unsplit. Call the wrapper "
            "itself for each forward step (use_cache=False), or wrapper.unwrap().generate(...) to run unsplit"
        )

    def extra_repr(self) -> str:
        return f"num_ubatches={self.num_ubatches}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        slices = self._slices(args, kwargs)
        if slices is None:
            return self.module(*args, **kwargs)
        tasks = [functools.partial(self.module, *a, **k) for a, k in self._arguments.split(args, kwargs, slices)]
        with self.sm_partition.compute_context() if self.sm_partition else contextlib.nullcontext():
            with intercepting_collectives():
                outputs = islands.run_ubatches(self.scheduler.run, tasks, self._contextualize)
        return merge_outputs(outputs, [s.num_tokens for s in slices], self._arguments.merge_dim)

    def _slices(self, args: tuple, kwargs: dict) -> list[UBatchSlice] | None:
        """The ubatch slices of this call: the forward context's, or (no context, ``batched``
        declared) even parts of the declared batch dimension; None runs the call whole."""
        if is_forward_context_available():
            return self._context_slices()
        if not self._arguments.declares_batched:
            return None
        rows = self._arguments.batch_size(args, kwargs)
        if rows is None or rows < 2:
            return None
        return even_slices(rows, min(self.num_ubatches, rows))

    def _context_slices(self) -> list[UBatchSlice] | None:
        slices = get_forward_context().ubatch_slices
        if slices is None:
            return None
        check_slices(slices)
        if not slices:
            return None
        if len(slices) > self.num_ubatches:
            raise ValueError(
                f"the forward context has {len(slices)} ubatch slices but this UBatchWrapper was "
                f"built for at most num_ubatches={self.num_ubatches}"
            )
        return list(slices)

    def _contextualize(self, tasks: list[Callable[[], Any]]) -> list[Callable[[], Any]]:
        """Each task under its ubatch's context, derived from the current one (a piecewise graph
        replay calls this again, with the replayed step's metadata and slices); with no context
        (the wrapper split the batch itself) the tasks run as they are."""
        if not is_forward_context_available():
            return tasks
        children = make_ubatch_contexts(get_forward_context(), self._context_slices())
        return [functools.partial(_run_in_context, child, task) for child, task in zip(children, tasks)]


def _run_in_context(ctx: ForwardContext, task: Callable[[], Any]) -> Any:
    with override_forward_context(ctx):
        return task()


_PREFIX = "module."


def _drop_module_prefix(wrapper: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict()`` holds the wrapped module's own keys: ``<prefix>module.x`` is saved as
    ``<prefix>x`` (in order: the wrapper's keys are the last ones saved when this runs)."""
    inner = prefix + _PREFIX
    keys = [k for k in state_dict if k.startswith(inner)]
    state_dict.update({prefix + k[len(inner) :]: state_dict.pop(k) for k in keys})
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # per-module versions, keyed by module path
        relative = {path: _relative(path, inner[:-1]) for path in metadata}
        moved = {_join(prefix[:-1], rest): metadata.pop(path) for path, rest in relative.items() if rest is not None}
        metadata.update(moved)


def _add_module_prefix(
    wrapper: torch.nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    """``load_state_dict()`` takes the wrapped module's own keys: ``<prefix>x`` loads into
    ``<prefix>module.x``. (Module versions follow only when the wrapper is the root: torch
    hands a submodule's hook no view of them.)"""
    inner = prefix + _PREFIX
    keys = [k for k in state_dict if k.startswith(prefix)]
    state_dict.update({inner + k[len(prefix) :]: state_dict.pop(k) for k in keys})
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        relative = {path: _relative(path, prefix[:-1]) for path in metadata}
        for path, rest in relative.items():
            if rest is not None:
                metadata.setdefault(_join(inner[:-1], rest), metadata[path])


def _relative(path: str, base: str) -> str | None:
    """``path`` relative to the module path ``base`` ("" is the root), or None if outside it."""
    if not base:
        return path
    if path == base:
        return ""
    return path[len(base) + 1 :] if path.startswith(base + ".") else None


def _join(base: str, rest: str) -> str:
    return f"{base}.{rest}" if base and rest else base or rest
