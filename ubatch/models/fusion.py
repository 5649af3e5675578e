"""The reference models' elementwise glue (the combine, and the norms, the rotary embedding and
the MoE dispatch plan where their Triton kernels do not take them), compiled by ``torch.compile``
into a few fused kernels on CUDA.

Why: a decode step's glue is ~85 small kernels per layer; inside a CUDA graph each costs a few
microseconds of launch gap whatever its size, and a token split launches every one of them once
per ubatch. Fused, the unsplit step gets closer to its roofline and a split costs less.

Opt-in: inside ``fused_glue()`` (the bench's ``--fuse-glue``) each function is compiled with
dynamic shapes, so every token count and ubatch size shares one compilation, made by the warm-up
run before any graph capture; elsewhere, and always on CPU (where CI has no compiler to spare),
it runs as plain torch. ``fused_glue(dynamic=False)`` (``--fuse-glue static``) compiles once per
shape instead: more compilations, but each kernel tuned for its own size, where a dynamic
compilation keeps the launch configuration it autotuned at the first size it ran.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from ubatch._triton import triton
from ubatch.teardown import import_before_init

# The first compilation imports torch._dynamo, which imports torch.distributed.nn.functional;
# imported after init_process_group, that pins the default group for the life of the process
# (ubatch.teardown). Import it now, while a process that imports the models has no group yet.
import_before_init()

F = TypeVar("F", bound=Callable[..., Any])

RECOMPILE_LIMIT = 64
"""Compilations one function may keep: one per dtype, function-mode stack (inside a ubatch or
not) and optional argument a process meets; dynamo's default of 8 is too few for a process that
builds many models (the GPU test suite), and with ``fullgraph`` running out is an error."""

_fuse: contextvars.ContextVar[str | None] = contextvars.ContextVar("ubatch_fuse_glue", default=None)


@contextlib.contextmanager
def fused_glue(enabled: bool = True, *, dynamic: bool = True) -> Iterator[None]:
    """Compile the glue on CUDA in the ``with`` body (``enabled=False``: run it as plain torch ops,
    a reference to compare against), with dynamic shapes or once per shape (``dynamic=False``).
    The setting reaches every ubatch: each runs in a copy of the caller's context."""
    token = _fuse.set(("dynamic" if dynamic else "static") if enabled else None)
    try:
        yield
    finally:
        _fuse.reset(token)


def _triton_available() -> bool:
    """Whether inductor, which compiles the glue to Triton kernels, can run here."""
    return triton is not None


def fused(fn: F) -> F:
    """``fn`` compiled (``fullgraph``; dynamic shapes or per shape, as ``fused_glue()`` asks) inside
    ``fused_glue()`` when its first argument is a CUDA tensor, else ``fn`` itself. ``fn.eager``
    is the plain function."""
    compiled: dict[str, Callable[..., Any]] = {}

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        shapes = _fuse.get()
        if not (shapes and args[0].is_cuda and _triton_available()):
            return fn(*args, **kwargs)
        if shapes not in compiled:
            compiled[shapes] = torch.compile(fn, dynamic=shapes == "dynamic", fullgraph=True)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled[shapes](*args, **kwargs)

    call.eager = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
