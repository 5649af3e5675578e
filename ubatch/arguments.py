"""Which arguments of a wrapped call each ubatch gets, and how the ubatches' outputs merge back.

A tensor argument is split when it is declared batched (along its declared dimension) or when
its leading dimension equals the slices' total (along dim 0); it is passed whole to every ubatch
only when declared shared. Any other tensor is an error: passing a batch-sized tensor whole to
every ubatch, then concatenating the outputs, gives wrong shapes with no error. Outputs merge
along the split dimension, and whatever cannot be merged is named in the error.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from ubatch.slicing import UBatchSlice

ArgumentKey = str | int  # a parameter's name, or a positional argument's index

_SHARED = "shared"


def _check_key(key: object, what: str) -> None:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"{what} keys must be argument names (str) or positional indices (int), got {key!r}")
    if isinstance(key, int) and key < 0:
        raise ValueError(f"{what} names positional argument {key}: indices start at 0")


@dataclasses.dataclass(frozen=True)
class _Parameters:
    positional: list[str]  # names of the parameters that can be passed by position, in order
    names: set[str]  # every named parameter
    var_args: bool
    var_kwargs: bool


def _parameters(runnable: Callable[..., Any]) -> _Parameters | None:
    """What the runnable's signature says (a module's: its ``forward``'s); None if unreadable."""
    target = runnable.forward if isinstance(runnable, torch.nn.Module) else runnable
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    return _Parameters(
        positional=[p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)],
        names={p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)},
        var_args=any(p.kind == p.VAR_POSITIONAL for p in params),
        var_kwargs=any(p.kind == p.VAR_KEYWORD for p in params),
    )


class ArgumentSplitter:
    """The declarations of one wrapper: ``batched`` maps an argument (name or positional index)
    to the dimension it is split along; ``shared`` arguments are passed whole."""

    def __init__(
        self,
        runnable: Callable[..., Any],
        batched: Mapping[ArgumentKey, int] | None = None,
        shared: Collection[ArgumentKey] = (),
    ) -> None:
        batched = {} if batched is None else batched
        if not isinstance(batched, Mapping):
            raise TypeError(f"batched must map argument names or indices to a dim, got {type(batched).__name__}")
        if isinstance(shared, (str, bytes)) or not isinstance(shared, Collection):
            raise TypeError(f"shared must be a collection of argument names or indices, got {shared!r}")
        decls: dict[ArgumentKey, int | str] = {}
        for key, dim in batched.items():
            _check_key(key, "batched")
            if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
                raise TypeError(f"batched[{key!r}] must be a dimension (an int >= 0), got {dim!r}")
            if dim < 0:
                raise ValueError(f"batched[{key!r}] must be a dimension (an int >= 0), got {dim!r}")
            decls[key] = int(dim)
        for key in shared:
            _check_key(key, "shared")
            if key in decls:
                raise ValueError(f"argument {key!r} is declared both batched and shared")
            decls[key] = _SHARED
        dims = set(decls.values()) - {_SHARED}
        self.declares_batched = bool(dims)
        self.merge_dim = dims.pop() if len(dims) == 1 else 0
        self._names: list[str] = []
        self._by_position: dict[int, int | str] = {}
        self._by_name: dict[str, int | str] = {}
        self._resolve(runnable, decls)

    def _resolve(self, runnable: Callable[..., Any], decls: dict[ArgumentKey, int | str]) -> None:
        """Index the declarations by position and by name, through the runnable's signature
        (without one, names match keyword arguments and indices positional ones)."""
        params = _parameters(runnable)
        self._names = [] if params is None else params.positional
        for key, decl in decls.items():
            if isinstance(key, str):
                if params is not None and not params.var_kwargs and key not in params.names:
                    raise ValueError(
                        f"argument {key!r} is declared, but {_describe(runnable)} has no parameter "
                        f"of that name (it has {sorted(params.names)})"
                    )
                self._set(self._by_name, key, decl)
                if key in self._names:
                    self._set(self._by_position, self._names.index(key), decl)
            else:
                if params is not None and not params.var_args and key >= len(self._names):
                    raise ValueError(
                        f"positional argument {key} is declared, but {_describe(runnable)} takes "
                        f"{len(self._names)} positional arguments"
                    )
                self._set(self._by_position, key, decl)
                if key < len(self._names):
                    self._set(self._by_name, self._names[key], decl)

    @staticmethod
    def _set(table: dict, key: Any, decl: int | str) -> None:
        if table.get(key, decl) != decl:
            raise ValueError(f"argument {key!r} is declared twice, by name and by position, differently")
        table[key] = decl

    def _label(self, key: ArgumentKey) -> str:
        if isinstance(key, int):
            return f"argument {key} ({self._names[key]})" if key < len(self._names) else f"argument {key}"
        return f"argument {key!r}"

    def batch_size(self, args: tuple, kwargs: dict) -> int | None:
        """The size of the declared batch dimension in this call (None: no batched tensor given)."""
        items = [(i, a, self._by_position.get(i)) for i, a in enumerate(args)]
        items += [(k, v, self._by_name.get(k)) for k, v in kwargs.items()]
        found: tuple[str, int] | None = None
        for key, value, decl in items:
            if decl is None or decl == _SHARED or value is None:
                continue
            size = self._size_along(key, value, decl)
            if found is not None and found[1] != size:
                raise ValueError(
                    f"batched arguments disagree on the batch size: {found[0]} has {found[1]} "
                    f"rows along its batch dimension, {self._label(key)} has {size}"
                )
            found = (self._label(key), size)
        return None if found is None else found[1]

    def _size_along(self, key: ArgumentKey, value: Any, dim: int) -> int:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self._label(key)} is declared batched but is a {type(value).__name__}, not a tensor")
        if value.dim() <= dim:
            raise ValueError(
                f"{self._label(key)} is declared batched along dim {dim} but has shape {tuple(value.shape)}"
            )
        return value.shape[dim]

    def split(self, args: tuple, kwargs: dict, slices: Sequence[UBatchSlice]) -> list[tuple[tuple, dict]]:
        """Each ubatch's ``(args, kwargs)``; every argument is checked before any is cut."""
        total = slices[-1].token_slice.stop
        arg_dims = [self._split_dim(i, a, self._by_position.get(i), total) for i, a in enumerate(args)]
        kwarg_dims = {k: self._split_dim(k, v, self._by_name.get(k), total) for k, v in kwargs.items()}
        return [
            (
                tuple(_cut(a, d, s) for a, d in zip(args, arg_dims)),
                {k: _cut(v, kwarg_dims[k], s) for k, v in kwargs.items()},
            )
            for s in slices
        ]

    def _split_dim(self, key: ArgumentKey, value: Any, decl: int | str | None, total: int) -> int | None:
        """The dimension ``value`` is cut along, or None to pass it whole."""
        if decl == _SHARED or (decl is not None and value is None):
            return None
        if decl is not None:
            size = self._size_along(key, value, decl)
            if size != total:
                raise ValueError(
                    f"{self._label(key)} is declared batched along dim {decl}, where it has size "
                    f"{size}, but the ubatch slices cover {total}"
                )
            return decl
        if not isinstance(value, torch.Tensor):
            return None
        if value.dim() == 0:
            raise ValueError(
                f"{self._label(key)} is a 0-d tensor, which cannot be split into ubatches: declare it "
                f"shared to pass it whole to every ubatch"
            )
        if value.shape[0] != total:
            raise ValueError(
                f"{self._label(key)} has leading dimension {value.shape[0]}, but the ubatch slices "
                f"cover {total}: declare it shared to pass it whole to every ubatch, or batched "
                f"(with its batch dimension) to split it"
            )
        return 0


def _cut(value: Any, dim: int | None, s: UBatchSlice) -> Any:
    return value if dim is None else value.narrow(dim, s.token_slice.start, s.num_tokens)


def _describe(runnable: Callable[..., Any]) -> str:
    if isinstance(runnable, torch.nn.Module):
        return type(runnable).__name__
    return getattr(runnable, "__qualname__", type(runnable).__name__)


def merge_outputs(outputs: Sequence[Any], sizes: Sequence[int], dim: int = 0, path: str = "output") -> Any:
    """Concatenate the ubatches' outputs along ``dim`` (tensors, and tuples / lists / dicts of
    them, recursively); ubatch i's tensors must have ``sizes[i]`` rows along ``dim``. Equal
    non-tensor values pass through once; anything else is a TypeError / ValueError naming the
    output field (``path``)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return _cat(outputs, sizes, dim, path)
    if first is None:
        if any(o is not None for o in outputs):
            raise TypeError(f"cannot merge {path}: some ubatches returned None, others a value")
        return None
    if isinstance(first, dict):
        return _merge_dict(outputs, sizes, dim, path)
    if isinstance(first, (tuple, list)):
        return _merge_sequence(outputs, sizes, dim, path)
    if all(_same(o, first) for o in outputs[1:]):
        return first
    raise TypeError(
        f"cannot merge {path}: the ubatches returned {type(first).__name__} objects that differ, "
        f"and only tensors (and tuples, lists and dicts of them) can be concatenated"
    )


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an == that fails or is ambiguous means "not the same"
        return False


def _cat(outputs: Sequence[Any], sizes: Sequence[int], dim: int, path: str) -> torch.Tensor:
    for i, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"cannot merge {path}: ubatch 0 returned a tensor, ubatch {i} a {type(out).__name__}")
    first = outputs[0]
    if first.dim() == 0:
        if all(torch.equal(o, first) for o in outputs[1:]):
            return first
        raise ValueError(
            f"cannot merge {path}: each ubatch returned a different 0-d tensor (a per-ubatch "
            f"reduction, such as a loss, cannot be concatenated)"
        )
    for i, (out, size) in enumerate(zip(outputs, sizes)):
        if out.dim() <= dim or out.shape[dim] != size:
            raise ValueError(
                f"cannot merge {path}: ubatch {i} returned shape {tuple(out.shape)}, but its slice "
                f"holds {size} rows along dim {dim} (an output that is not per row, such as router "
                f"logits over flattened tokens, cannot be concatenated)"
            )
    return torch.cat(list(outputs), dim=dim)


def _merge_dict(outputs: Sequence[Any], sizes: Sequence[int], dim: int, path: str) -> Any:
    first = outputs[0]
    for i, out in enumerate(outputs):
        if not isinstance(out, dict) or list(out.keys()) != list(first.keys()):
            keys = list(out.keys()) if isinstance(out, dict) else type(out).__name__
            raise TypeError(f"cannot merge {path}: ubatch 0 returned keys {list(first.keys())}, ubatch {i} {keys}")
    as_fields = dataclasses.is_dataclass(first)  # transformers' ModelOutput: fields, rebuilt by keyword
    merged = {
        key: merge_outputs([o[key] for o in outputs], sizes, dim, f"{path}.{key}" if as_fields else f"{path}[{key!r}]")
        for key in first
    }
    return type(first)(**merged) if as_fields else type(first)(merged)


def _merge_sequence(outputs: Sequence[Any], sizes: Sequence[int], dim: int, path: str) -> Any:
    first = outputs[0]
    for i, out in enumerate(outputs):
        if type(out) is not type(first) or len(out) != len(first):
            raise TypeError(
                f"cannot merge {path}: ubatch 0 returned a {type(first).__name__} of {len(first)}, "
                f"ubatch {i} {_shape_of(out)}"
            )
    fields = getattr(first, "_fields", None)  # a namedtuple
    parts = [
        merge_outputs(items, sizes, dim, f"{path}.{fields[k]}" if fields else f"{path}[{k}]")
        for k, items in enumerate(zip(*outputs))
    ]
    return type(first)(*parts) if fields else type(first)(parts)


def _shape_of(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"
