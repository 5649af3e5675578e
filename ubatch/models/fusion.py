"""The reference models' elementwise glue (norms, rotary, the MoE dispatch plan and combine),
compiled by ``torch.compile`` into a few fused kernels on CUDA.

Why: a decode step's glue is ~85 small kernels per layer; inside a CUDA graph each costs a few
microseconds of launch gap whatever its size, and a token split launches every one of them once
per ubatch. Fused, the unsplit step gets closer to its roofline and a split costs less. Each
function is compiled once with dynamic shapes (every token count and ubatch size shares one
compilation, made by the warm-up run before any graph capture), and runs as plain torch on CPU,
where CI has no compiler to spare, and wherever ``eager_glue()`` is in force.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_fuse: contextvars.ContextVar[bool] = contextvars.ContextVar("ubatch_fuse_glue", default=True)


@contextlib.contextmanager
def eager_glue() -> Iterator[None]:
    """Run the glue as plain torch ops in the ``with`` body (a reference to compare against)."""
    token = _fuse.set(False)
    try:
        yield
    finally:
        _fuse.reset(token)


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused(fn: F) -> F:
    """``fn`` compiled (``fullgraph``, dynamic shapes) when its first argument is a CUDA tensor,
    else ``fn`` itself. ``fn.eager`` is the plain function."""
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        if not (_fuse.get() and args[0].is_cuda and _triton_available()):
            return fn(*args)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True, fullgraph=True))
        return compiled[0](*args)

    call.eager = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
