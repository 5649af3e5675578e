"""Eager islands: the ops a piecewise CUDA graph leaves out and runs eagerly at replay.

Attention (its metadata changes every step) and collectives (they yield to other ubatches) are
islands. Outside a piecewise capture an island is a plain call. During one, the recorder in
``ubatch.cudagraph`` closes the graph segment before the island, runs it eagerly, remembers it
with its (static) arguments and opens the next segment; a ubatched schedule inside becomes one
such program per ubatch, captured on that ubatch's stream. This module sits on the bottom floor so
that attention and comm can mark their islands without importing the graph machinery.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Protocol

Tasks = list[Callable[[], Any]]


class IslandRecorder(Protocol):
    def island(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any: ...

    def ubatches(
        self, run: Callable[[Tasks], list[Any]], tasks: Tasks, contextualize: Callable[[Tasks], Tasks]
    ) -> list[Any]: ...


_recorder: contextvars.ContextVar[IslandRecorder | None] = contextvars.ContextVar(
    "ubatch_island_recorder", default=None
)


def run_island(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or handed to the active piecewise recorder."""
    recorder = _recorder.get()
    if recorder is None:
        return fn(*args)
    return recorder.island(fn, args)


def recording_active() -> bool:
    """Whether a piecewise capture is recording islands right now."""
    return _recorder.get() is not None


def run_ubatches(run: Callable[[Tasks], list[Any]], tasks: Tasks, contextualize: Callable[[Tasks], Tasks]) -> list[Any]:
    """``run(contextualize(tasks))``: a ubatched schedule, which a piecewise recorder captures as
    one program per ubatch (``contextualize`` gives callables their ubatch's forward context,
    derived from whatever context is current, at capture and again at every replay)."""
    recorder = _recorder.get()
    if recorder is None:
        return run(contextualize(tasks))
    return recorder.ubatches(run, tasks, contextualize)


@contextlib.contextmanager
def recording(recorder: IslandRecorder | None) -> Iterator[None]:
    """Route islands to ``recorder`` (None: run them plainly) for the ``with`` body."""
    token = _recorder.set(recorder)
    try:
        yield
    finally:
        _recorder.reset(token)
