"""The forward context: per-step state that model code reads without it being passed down.

It lives in a ``contextvars.ContextVar``, so every thread (and every greenlet, which runs
ubatches) sees its own value and two wrappers never see each other's state. This module is the
bottom floor of the package: it imports nothing from ``ubatch``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


class CUDAGraphMode(enum.IntEnum):
    """How a step runs: eagerly, as graph segments between attention calls, or as one graph."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclass(frozen=True)
class BatchDescriptor:
    """The shape facts of a step that select a CUDA graph.

    ``uniform`` marks a batch in which every request has the same query length (pure decode, or
    speculative verification with ``num_tokens / num_reqs`` tokens each).
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False


@dataclass(frozen=True)
class DPMetadata:
    """Token counts of the current step on every data-parallel rank (padding included)."""

    num_tokens_across_dp: tuple[int, ...]

    @property
    def max_tokens_across_dp(self) -> int:
        return max(self.num_tokens_across_dp)


@dataclass
class ForwardContext:
    """Everything a forward pass reads from its surroundings.

    ``attn_metadata`` and ``slot_mapping`` are a dict keyed by attention layer name, a list of
    such dicts (one per ubatch), or None. A ubatch's own context is derived from its parent's
    with ``dataclasses.replace``, so a field added here (or in a subclass) reaches every ubatch.
    """

    no_compile_layers: dict[str, Any] = field(default_factory=dict)
    attn_metadata: Any = None
    slot_mapping: Any = None
    batch_descriptor: BatchDescriptor | None = None
    dp_metadata: DPMetadata | None = None
    ubatch_slices: Any = None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    skip_compiled: bool = False
    skip_attention: bool = False
    is_padding: Any = None
    additional_kwargs: dict[str, Any] = field(default_factory=dict)
    num_tokens: int | None = None
    ubatch_id: int | None = None

    @property
    def step_memo(self) -> dict[Any, Any]:
        """Values derived once per forward pass and shared by its layers (such as an attention
        layout built from the step's metadata), dropped with the context: nothing derived from
        one step's tensors, which a runner may refill in place, reaches the next step.

        A cache of the fields, not a field: each context, a ubatch's derived one included
        (``dataclasses.replace`` builds a new object), starts with an empty memo of its own, and
        the memo takes no part in repr or comparison.
        """
        return self.__dict__.setdefault("_step_memo", {})


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("ubatch_forward_context", default=None)
_forced_skip_attention: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "ubatch_forced_skip_attention", default=None
)


@contextlib.contextmanager
def capture_scope(*, skip_attention: bool) -> Iterator[None]:
    """Fix ``skip_attention`` for every forward context installed in the ``with`` body.

    A CUDA-graph manager wraps a descriptor's warm-up and capture passes in this, with the value
    its target mode demands, so no code path below (a runner's dummy run, a drafter's propose
    loop, a ubatch's child context) can get it wrong by keying it on a runtime argument.
    """
    token = _forced_skip_attention.set(bool(skip_attention))
    try:
        yield
    finally:
        _forced_skip_attention.reset(token)


_static_collectives: contextvars.ContextVar[bool] = contextvars.ContextVar("ubatch_static_collectives", default=False)


@contextlib.contextmanager
def static_collectives(enabled: bool = True) -> Iterator[None]:
    """Make an eager forward in the ``with`` body issue the collectives a graph replay of it would
    (the shape-static ones, no count exchange). Why: a data-parallel rank that runs a step
    eagerly while its peers replay the step's graph must match their collectives one for one;
    ``ModelRunner`` enters this for such steps."""
    token = _static_collectives.set(bool(enabled))
    try:
        yield
    finally:
        _static_collectives.reset(token)


def in_static_collectives() -> bool:
    """Whether the forward runs under ``static_collectives()`` or a graph's warm-up or capture
    (``in_capture_scope``): code with a host-synced eager path takes its captured one."""
    return _static_collectives.get() or in_capture_scope()


def in_capture_scope() -> bool:
    """Whether a CUDA-graph manager's warm-up or capture of a descriptor is running (inside
    ``capture_scope``): code whose eager path differs from its captured one (a host sync, other
    buffer shapes) takes the captured one in both, so the warm-up prepares what the capture runs."""
    return _forced_skip_attention.get() is not None


def get_forward_context() -> ForwardContext:
    """The context of the forward pass in progress; ``RuntimeError`` outside one."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "no forward context is set: run the model inside `with set_forward_context(...)` "
            "(or `override_forward_context(ctx)`)"
        )
    return ctx


def is_forward_context_available() -> bool:
    return _current.get() is not None


@contextlib.contextmanager
def override_forward_context(ctx: ForwardContext | None) -> Iterator[ForwardContext | None]:
    """Install ``ctx`` (or None) as the current context for the ``with`` body, then restore."""
    if ctx is not None and not isinstance(ctx, ForwardContext):
        raise TypeError(f"override_forward_context expects a ForwardContext or None, got {type(ctx).__name__}")
    forced = _forced_skip_attention.get()
    if ctx is not None and forced is not None and ctx.skip_attention != forced:
        ctx = dataclasses.replace(ctx, skip_attention=forced)
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def _dp_metadata(num_tokens_across_dp: Any) -> DPMetadata | None:
    if num_tokens_across_dp is None:
        return None
    if hasattr(num_tokens_across_dp, "tolist"):
        num_tokens_across_dp = num_tokens_across_dp.tolist()
    counts = tuple(int(n) for n in num_tokens_across_dp)
    if not counts or any(n < 0 for n in counts):
        raise ValueError(f"num_tokens_across_dp must be non-empty and non-negative, got {counts}")
    return DPMetadata(counts)


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Any,
    *,
    slot_mapping: Any = None,
    num_tokens: int | None = None,
    num_tokens_across_dp: Any = None,
    batch_descriptor: BatchDescriptor | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ubatch_slices: Any = None,
    skip_compiled: bool = False,
    skip_attention: bool = False,
    is_padding: Any = None,
    additional_kwargs: dict[str, Any] | None = None,
    no_compile_layers: dict[str, Any] | None = None,
) -> Iterator[ForwardContext]:
    """Build a ForwardContext for one step and make it current for the ``with`` body."""
    ctx = ForwardContext(
        no_compile_layers=no_compile_layers if no_compile_layers is not None else {},
        attn_metadata=attn_metadata,
        slot_mapping=slot_mapping,
        batch_descriptor=batch_descriptor,
        dp_metadata=_dp_metadata(num_tokens_across_dp),
        ubatch_slices=ubatch_slices,
        cudagraph_runtime_mode=CUDAGraphMode(cudagraph_runtime_mode),
        skip_compiled=skip_compiled,
        skip_attention=skip_attention,
        is_padding=is_padding,
        additional_kwargs=dict(additional_kwargs or {}),
        num_tokens=num_tokens,
    )
    with override_forward_context(ctx) as installed:
        yield installed


def derive_context(parent: ForwardContext, **changes: Any) -> ForwardContext:
    """A child context: the parent with only ``changes`` replaced; every other field inherited."""
    return dataclasses.replace(parent, **changes)
