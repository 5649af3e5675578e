"""Overlap modes: the ways one step can hide its communication, and how each is put in force.

A token split (N ubatches) hides one ubatch's collectives under another's compute, but every
ubatch reads every expert's weights again and launches every kernel again; where communication
is cheap that costs more than it hides. Two modes overlap without splitting the batch:

- single-batch overlap: the step runs unsplit as one ubatch, so its collectives go to the comm
  stream and the work the model issues between starting one and waiting for it (the shared
  experts under the MoE dispatch) runs during the transfer;
- expert pipelining: the dispatch -> expert GEMMs -> combine chain runs per group of local
  experts (``MoEFFN.expert_chunks``), so group g's GEMMs run while group g+1's rows are in
  flight, and each expert's weights are still read once.

A split can also keep the weights read once: with joined experts (``join``) each ubatch runs its
own attention and dispatch, so one ubatch's attention hides another's transfer, but the expert
GEMMs run once over every ubatch's rows (``MoEFFN.join_ubatches``), and so do the shared experts
where they have no collective of their own.

Chunked all-reduce (``allreduceK``), for tensor parallelism: each row-parallel projection (the
attention's output projection, the MLP's down projection) runs in K chunks of rows, and each
chunk's all-reduce is in flight while the next chunk's GEMM runs (``ubatch.models.layers.row_parallel``).

Token chunks (``tokensK``): the same chain per chunk of the rows a rank sends each destination,
in token order (``MoEFFN.token_chunks``), every chunk's dispatch started first, so chunk c's GEMMs
run while chunk c + 1's rows are in flight and chunk c - 1's come back. Under a capacity the
chunks cut the unsplit step's blocks, so they send its padding, no more. Each chunk reads the
expert weights again: it pays where the GEMMs are compute-bound (prefill), and works with one
expert per rank, where expert groups cannot (the two do not combine).

Own rows first (``local``): the rows a rank routes to its own experts need no transfer, so their
GEMMs run from the send buffer while the dispatch is in flight, the other ranks' rows after it
lands (``MoEFFN.local_first``; half the rows with two ranks). It splits each expert GEMM in two,
so the weights are read twice: it pays where the GEMMs are compute-bound (prefill).

Modes combine: ``OverlapMode(num_ubatches=2, expert_chunks=2, join_experts=True)`` splits the
tokens, joins their expert stages and pipelines it over two expert groups. Any mode that runs as
ubatches may also partition the SMs: ``comm_sms=K`` (``@greenK`` in its name) gives the comm
stream a green context of K SMs and the ubatches the rest (``ubatch.sm``). See
docs/overlap-modes.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ubatch.scheduler import MAX_UBATCHES

MAX_EXPERT_CHUNKS = 8
MAX_TOKEN_CHUNKS = 8
MAX_ALL_REDUCE_CHUNKS = 8


@dataclass(frozen=True)
class OverlapMode:
    """One way to run a step: ``num_ubatches`` token slices, ``expert_chunks`` expert groups,
    ``token_chunks`` chunks of each slice's tokens through the experts, whether the slices'
    expert stages are joined (``join_experts``), whether the rows a rank routes to its own
    experts run before the dispatch lands (``local_first``), the chunks of
    each tensor-parallel all-reduce (``all_reduce_chunks``), whether an unsplit step still runs
    as a ubatch (``single_batch``; implied by the others), and the comm stream's green SM
    partition (``comm_sms``; None: no partition)."""

    num_ubatches: int = 1
    expert_chunks: int = 1
    join_experts: bool = False
    single_batch: bool = False
    comm_sms: int | None = None
    local_first: bool = False
    all_reduce_chunks: int = 1
    token_chunks: int = 1

    def __post_init__(self) -> None:
        for name, value, top in (
            ("num_ubatches", self.num_ubatches, MAX_UBATCHES),
            ("expert_chunks", self.expert_chunks, MAX_EXPERT_CHUNKS),
            ("all_reduce_chunks", self.all_reduce_chunks, MAX_ALL_REDUCE_CHUNKS),
            ("token_chunks", self.token_chunks, MAX_TOKEN_CHUNKS),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value > top:
                raise ValueError(f"{name} must be an int in 1..{top}, got {value!r}")
        if self.join_experts and self.num_ubatches < 2:
            raise ValueError(f"join_experts joins the expert stages of a split, got num_ubatches={self.num_ubatches}")
        if self.join_experts and self.token_chunks > 1:
            raise ValueError(
                f"join_experts runs one expert stage over whole ubatches, not token_chunks={self.token_chunks}"
            )
        if self.expert_chunks > 1 and self.token_chunks > 1:
            raise ValueError(
                f"expert groups and token chunks both cut the expert stage; choose one, got "
                f"expert_chunks={self.expert_chunks}, token_chunks={self.token_chunks}"
            )
        if self.num_ubatches > 1 or self._chunked or self.local_first:
            object.__setattr__(self, "single_batch", True)
        if self.comm_sms is not None:
            if isinstance(self.comm_sms, bool) or not isinstance(self.comm_sms, int) or self.comm_sms < 1:
                raise ValueError(f"comm_sms must be an int >= 1 or None, got {self.comm_sms!r}")
            if not self.single_batch:
                raise ValueError(
                    f"an SM partition (comm_sms={self.comm_sms}) needs a mode that runs as ubatches; "
                    f"the unsplit step has no comm stream (use overlap@green{self.comm_sms})"
                )

    @property
    def _chunked(self) -> bool:
        return self.expert_chunks > 1 or self.token_chunks > 1 or self.all_reduce_chunks > 1

    @property
    def name(self) -> str:
        partition = "" if self.comm_sms is None else f"@green{self.comm_sms}"
        if self.num_ubatches == 1 and not self._chunked and not self.local_first:
            return ("overlap" if self.single_batch else "unsplit") + partition
        parts = [f"split{self.num_ubatches}"] if self.num_ubatches > 1 else []
        parts += ["join"] if self.join_experts else []
        parts += [f"pipeline{self.expert_chunks}"] if self.expert_chunks > 1 else []
        parts += [f"tokens{self.token_chunks}"] if self.token_chunks > 1 else []
        parts += ["local"] if self.local_first else []
        parts += [f"allreduce{self.all_reduce_chunks}"] if self.all_reduce_chunks > 1 else []
        return "+".join(parts) + partition

    @property
    def runs_as_ubatches(self) -> bool:
        """Whether the step goes through a UBatchWrapper (with ``num_ubatches`` slices)."""
        return self.single_batch

    @classmethod
    def parse(cls, text: str) -> OverlapMode:
        """``unsplit``, ``overlap``, ``splitN``, ``pipelineK``, ``splitN+pipelineK``, or a split
        with ``+join`` (``splitN+join``, ``splitN+join+pipelineK``); ``tokensK`` (token chunks)
        alone or after a split, or before ``+local``; ``local`` (own rows first) and
        ``allreduceK`` (chunked tensor-parallel all-reduces) alone or as ``+local`` /
        ``+allreduceK`` after a split or a pipeline; any but ``unsplit`` may end in ``@greenK``, a
        green SM partition with K SMs for communication."""
        values: dict[str, Any] = {}
        text, at, partition = text.partition("@")
        if at:
            digits = partition.removeprefix("green")
            if partition == digits or not digits.isdigit():
                raise ValueError(
                    f"unknown SM partition {partition!r} in overlap mode {text + at + partition!r}: expected greenK"
                )
            values["comm_sms"] = int(digits)
        if text in ("unsplit", "overlap"):
            return cls(single_batch=text == "overlap", **values)
        fields = {
            "split": "num_ubatches",
            "pipeline": "expert_chunks",
            "tokens": "token_chunks",
            "allreduce": "all_reduce_chunks",
        }
        for part in text.split("+"):
            prefix = part.rstrip("0123456789")
            digits = part[len(prefix) :]
            flag = {"join": "join_experts", "local": "local_first"}.get(part)
            if flag is not None and flag not in values:
                values[flag] = True
                continue
            if prefix not in fields or not digits or fields[prefix] in values:
                raise ValueError(
                    f"unknown overlap mode {text!r}: expected unsplit, overlap, splitN, pipelineK, "
                    f"splitN+pipelineK, splitN+join or splitN+join+pipelineK, optionally +tokensK, +local, "
                    f"+allreduceK and @greenK"
                )
            values[fields[prefix]] = int(digits)
        return cls(**values)


def parse_modes(text: str) -> list[OverlapMode]:
    """A comma-separated list of ``OverlapMode.parse`` names, unsplit first and no repeats."""
    modes = [OverlapMode.parse(part) for part in text.split(",") if part]
    if not modes:
        raise ValueError(f"expected comma-separated overlap modes, got {text!r}")
    unique = list(dict.fromkeys([OverlapMode(), *modes]))
    return unique


def moe_layers(model: Any) -> Iterator[Any]:
    """The model's MoE layers (none for a dense model)."""
    yield from getattr(model, "moe_layers", {}).values()


def apply_mode(model: Any, mode: OverlapMode) -> None:
    """Set every MoE layer of ``model`` to ``mode``'s expert groups, token chunks, joining and own
    rows first,
    and every tensor-parallel projection to its all-reduce chunks (the unsplit mode resets them);
    the token split itself is the forward context's ``ubatch_slices``."""
    layers = list(moe_layers(model))
    if _needs_moe(mode) and not layers:
        raise ValueError(f"mode {mode.name} needs a MoE model; this one has no MoE layers")
    projections = list(tensor_parallel_projections(model))
    if mode.all_reduce_chunks > 1 and not projections:
        raise ValueError(f"mode {mode.name} needs a tensor-parallel model; this one has no tp_group")
    for layer in layers:
        _set(layer, "expert_chunks", mode.expert_chunks)
        _set(layer, "token_chunks", mode.token_chunks)
        _set(layer, "join_ubatches", mode.join_experts)
        _set(layer, "local_first", mode.local_first)
    for module in projections:
        _set(module, "all_reduce_chunks", mode.all_reduce_chunks)


def _needs_moe(mode: OverlapMode) -> bool:
    return mode.expert_chunks > 1 or mode.token_chunks > 1 or mode.join_experts or mode.local_first


def _set(module: Any, name: str, value: Any) -> None:
    """``module.name = value`` where it differs: ``nn.Module.__setattr__`` is slow, and a runner
    under a mode policy puts a mode in force every step."""
    if getattr(module, name) != value:
        setattr(module, name, value)


def tensor_parallel_projections(model: Any) -> Iterator[Any]:
    """The model's modules whose row-parallel projection ends in an all-reduce over a
    tensor-parallel group (none without one; the reference models list them as
    ``row_parallel_layers``)."""
    yield from getattr(model, "row_parallel_layers", ())


def supported(model: Any, modes: Iterable[OverlapMode]) -> list[OverlapMode]:
    """The modes this model can run: joined experts, token chunks and own rows first need MoE layers, expert
    chunks must divide every MoE layer's local experts, and chunked all-reduces need a
    tensor-parallel model."""
    layers = list(moe_layers(model))
    tensor_parallel = next(tensor_parallel_projections(model), None) is not None
    return [
        m
        for m in modes
        if (layers or not _needs_moe(m))
        and all(layer.num_local_experts % m.expert_chunks == 0 for layer in layers)
        and (tensor_parallel or m.all_reduce_chunks == 1)
    ]
