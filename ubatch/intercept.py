"""Overlap the collectives a model already issues, with no change to the model.

While ubatches run (``UBatchWrapper`` enters ``intercepting_collectives()`` around them), the
collectives a ubatch issues through ``torch.distributed`` (``all_reduce``, ``all_to_all_single``,
``all_gather_into_tensor`` / ``all_gather_single``, ``reduce_scatter_tensor`` /
``reduce_scatter_single``, sync or ``async_op=True``) and through the functional collectives
(``torch.ops._c10d_functional``, which ``torch.distributed._functional_collectives`` and so
DTensor's ``redistribute`` call) run through ``ubatch.comm``: they launch after the producing
compute, yield to the next ubatch while in flight, and the consumer waits before use.

Two entry points, each where a ubatch may yield safely (docs/collectives.md has the evidence):

- torch.distributed's collectives hand themselves to the active torch function mode (the
  ``has_torch_function`` check they carry for non-strict export), from Python, with their Python
  arguments: ``CollectiveInterceptor`` sees them however the model reached them (``from
  torch.distributed import all_reduce`` too) and knows ``async_op``.
- Functional collectives are ``torch.ops`` calls; a torch function mode would see them from inside
  pybind11, where a greenlet switch corrupts pybind11's per-thread state. So the op packets that
  funcol looks up on every call are swapped for Python stand-ins while ubatches run.

Outside a ubatch both hand the call to torch unchanged, and outside the ``with`` block neither
exists. Calls that ``ubatch.comm`` itself makes are never intercepted again.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from ubatch import comm, scheduler

Thunk = Callable[[], Any]


def _has_ranks(group: Any) -> bool:
    """Whether this rank takes part in ``group`` (a process group exists and holds this rank):
    anything else goes to torch.distributed unchanged, which raises or warns as it always does."""
    return dist.is_available() and dist.is_initialized() and dist.get_rank(group) >= 0


Handler = Callable[[dict[str, Any]], Thunk | None]


def _c10d(comm_fn: Callable[..., Any]) -> Handler:
    """A torch.distributed collective, handed to ``comm_fn`` with the same arguments (``ubatch.comm``
    takes torch.distributed's parameter names); None (leave the call alone) for any other argument."""
    accepted = set(inspect.signature(comm_fn).parameters) - {"timeout"}

    def handle(arguments: dict[str, Any]) -> Thunk | None:
        if not set(arguments) <= accepted or not _has_ranks(arguments.get("group")):
            return None
        # async_op=True gets ubatch.comm's handle: its wait() is where the ubatch yields
        return lambda: comm_fn(**arguments)

    return handle


def _group(group_name: Any) -> Any:
    """The process group a functional collective names (a name or, in some versions, the group)."""
    if isinstance(group_name, str):
        return dist.distributed_c10d._resolve_process_group(group_name)
    return group_name


def _reduce_op(name: Any) -> Any:
    op = getattr(dist.ReduceOp, name.upper(), None) if isinstance(name, str) else None
    return None if op is None or op == dist.ReduceOp.PREMUL_SUM else op


def _f_all_reduce(input: torch.Tensor, reduce_op: str, group_name: Any) -> Thunk | None:
    op, group = _reduce_op(reduce_op), _group(group_name)
    if op is None or not _has_ranks(group):
        return None

    def run() -> torch.Tensor:
        output = input.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(output, op, group)
        return output

    return run


def _f_all_reduce_(input: torch.Tensor, reduce_op: str, group_name: Any) -> Thunk | None:
    op, group = _reduce_op(reduce_op), _group(group_name)
    if op is None or not _has_ranks(group) or not input.is_contiguous():
        return None

    def run() -> torch.Tensor:
        comm.all_reduce(input, op, group)
        return input

    return run


def _f_all_gather(input: torch.Tensor, group_size: int, group_name: Any) -> Thunk | None:
    return _f_all_gather_out(input, group_size, group_name, out=None)


def _f_all_gather_out(
    input: torch.Tensor, group_size: int, group_name: Any, *, out: torch.Tensor | None
) -> Thunk | None:
    group = _group(group_name)
    if not _has_ranks(group):
        return None

    def run() -> torch.Tensor:
        output = input.new_empty((input.shape[0] * group_size, *input.shape[1:])) if out is None else out
        comm.all_gather_into_tensor(output, input.contiguous(), group)
        return output

    return run


def _f_reduce_scatter(input: torch.Tensor, reduce_op: str, group_size: int, group_name: Any) -> Thunk | None:
    op, group = _reduce_op(reduce_op), _group(group_name)
    if op is None or not _has_ranks(group) or input.shape[0] % group_size:
        return None

    def run() -> torch.Tensor:
        output = input.new_empty((input.shape[0] // group_size, *input.shape[1:]))
        comm.reduce_scatter_tensor(output, input.contiguous(), op, group)
        return output

    return run


def _f_all_to_all(
    input: torch.Tensor, output_split_sizes: Any, input_split_sizes: Any, group_name: Any
) -> Thunk | None:
    group = _group(group_name)
    if not _has_ranks(group):
        return None
    outs, ins = [int(n) for n in output_split_sizes], [int(n) for n in input_split_sizes]

    def run() -> torch.Tensor:
        output = input.new_empty((sum(outs) if outs else input.shape[0], *input.shape[1:]))
        comm.all_to_all_single(output, input.contiguous(), outs or None, ins or None, group)
        return output

    return run


def _make_c10d_handlers() -> dict[Any, tuple[inspect.Signature, Handler]]:
    """Each torch.distributed collective of this torch -> (its signature, its handler)."""
    table: dict[Any, tuple[inspect.Signature, Handler]] = {}
    c10d = getattr(dist, "distributed_c10d", None)
    for name, comm_fn in [
        ("all_reduce", comm.all_reduce),
        ("all_to_all_single", comm.all_to_all_single),
        ("all_gather_into_tensor", comm.all_gather_into_tensor),
        ("all_gather_single", comm.all_gather_into_tensor),  # torch 2.13's name; the older one calls it
        ("reduce_scatter_tensor", comm.reduce_scatter_tensor),
        ("reduce_scatter_single", comm.reduce_scatter_tensor),
    ]:
        fn = getattr(c10d, name, None)
        if fn is not None:
            table[fn] = (inspect.signature(fn), _c10d(comm_fn))
    return table


# Built once at import: a plain dict read is all the function mode does per torch call (and what
# torch.compile traces through it).
_C10D_HANDLERS = _make_c10d_handlers()


class CollectiveInterceptor(TorchFunctionMode):
    """Routes the torch.distributed collectives issued inside a ubatch through ``ubatch.comm``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        entry = _C10D_HANDLERS.get(func)
        if entry is None or scheduler.current_ubatch() is None or comm.issuing.get():
            return func(*args, **kwargs)
        signature, handle = entry
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:  # a signature this torch version changed: leave the call alone
            return func(*args, **kwargs)
        run = handle(dict(arguments))
        if run is None:
            return func(*args, **kwargs)
        # Torch took this mode off the stack while it runs; put it back, since the other ubatches
        # run (and issue collectives) while this one yields inside ``run``.
        with self:
            return run()


_FUNCTIONAL_OPS: dict[str, Callable[..., Thunk | None]] = {
    "all_reduce": _f_all_reduce,
    "all_reduce_": _f_all_reduce_,
    "all_gather_into_tensor": _f_all_gather,
    "all_gather_into_tensor_out": _f_all_gather_out,
    "reduce_scatter_tensor": _f_reduce_scatter,
    "all_to_all_single": _f_all_to_all,
}


class _FunctionalOp:
    """Stands in for one ``torch.ops._c10d_functional`` op packet while ubatches run.

    Functional collectives are caught here, at the packet that funcol (and so DTensor) looks up
    on every call, not in the mode: a ``torch.ops`` call runs the mode from inside pybind11, and
    a ubatch that yields there corrupts pybind11's per-thread call stack (the process aborts).
    """

    def __init__(self, packet: Any, make: Callable[..., Thunk | None]) -> None:
        self.packet = packet
        self._make = make
        self._signature = inspect.signature(make)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if scheduler.current_ubatch() is not None and _overlappable(args, kwargs):
            try:
                arguments = self._signature.bind(*args, **kwargs).arguments
            except TypeError:  # a schema this torch version changed: leave the call alone
                arguments = None
            run = None if arguments is None else self._make(**arguments)
            if run is not None:
                return run()
        return self.packet(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # .default, .overloads(), ...: the real packet's
        return getattr(self.packet, name)


def _overlappable(args: tuple, kwargs: dict) -> bool:
    """A functional collective has no gradient: while autograd would record one through it, torch's
    own call (which attaches a backward that raises) runs instead of a silently gradient-free one."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


class _FunctionalOpsSwap:
    """Puts the stand-ins into ``torch.ops._c10d_functional`` while any ubatched call runs (the
    namespace is shared by all threads: the first entry swaps them in, the last exit restores the
    very packets that were there; outside a ubatch a stand-in calls its packet unchanged)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth > 1 or not dist.is_available():
                return
            ops = torch.ops._c10d_functional
            for name, make in _FUNCTIONAL_OPS.items():
                if hasattr(ops, name):
                    self._originals[name] = getattr(ops, name)
                    setattr(ops, name, _FunctionalOp(self._originals[name], make))

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth:
                return
            ops = torch.ops._c10d_functional
            for name, packet in self._originals.items():
                setattr(ops, name, packet)
            self._originals.clear()


_functional_ops_swap = _FunctionalOpsSwap()


@contextlib.contextmanager
def intercepting_collectives() -> Iterator[None]:
    """Overlap the collectives issued by ubatches run inside this block (UBatchWrapper enters it)."""
    # A ubatch that yields inside an autograd Function (DTensor's redistribute is one) leaves
    # that Function's forward-AD guard to be restored out of order; put the caller's back.
    fwd_grad = torch._C._is_fwd_grad_enabled()
    try:
        with _functional_ops_swap, CollectiveInterceptor():
            yield
    finally:
        torch._C._set_fwd_grad_enabled(fwd_grad)
