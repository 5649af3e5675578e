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

Modes combine: ``OverlapMode(num_ubatches=2, expert_chunks=2)`` splits the tokens and pipelines
each ubatch's experts. See docs/overlap-modes.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

MAX_EXPERT_CHUNKS = 8


@dataclass(frozen=True)
class OverlapMode:
    """One way to run a step: ``num_ubatches`` token slices, ``expert_chunks`` expert groups,
    and whether an unsplit step still runs as a ubatch (``single_batch``; implied by the others)."""

    num_ubatches: int = 1
    expert_chunks: int = 1
    single_batch: bool = False

    def __post_init__(self) -> None:
        for name, value, top in (
            ("num_ubatches", self.num_ubatches, None),
            ("expert_chunks", self.expert_chunks, MAX_EXPERT_CHUNKS),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (top and value > top):
                raise ValueError(f"{name} must be an int in 1..{top or 'any'}, got {value!r}")
        if self.num_ubatches > 1 or self.expert_chunks > 1:
            object.__setattr__(self, "single_batch", True)

    @property
    def name(self) -> str:
        if self.num_ubatches == 1 and self.expert_chunks == 1:
            return "overlap" if self.single_batch else "unsplit"
        parts = [f"split{self.num_ubatches}"] if self.num_ubatches > 1 else []
        parts += [f"pipeline{self.expert_chunks}"] if self.expert_chunks > 1 else []
        return "+".join(parts)

    @property
    def runs_as_ubatches(self) -> bool:
        """Whether the step goes through a UBatchWrapper (with ``num_ubatches`` slices)."""
        return self.single_batch

    @classmethod
    def parse(cls, text: str) -> OverlapMode:
        """``unsplit``, ``overlap``, ``splitN``, ``pipelineK`` or ``splitN+pipelineK``."""
        if text in ("unsplit", "overlap"):
            return cls(single_batch=text == "overlap")
        fields = {"split": "num_ubatches", "pipeline": "expert_chunks"}
        values: dict[str, int] = {}
        for part in text.split("+"):
            prefix = part.rstrip("0123456789")
            digits = part[len(prefix) :]
            if prefix not in fields or not digits or fields[prefix] in values:
                raise ValueError(
                    f"unknown overlap mode {text!r}: expected unsplit, overlap, splitN, pipelineK or splitN+pipelineK"
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


def apply_expert_chunks(model: Any, chunks: int) -> None:
    """Pipeline every MoE layer of ``model`` over ``chunks`` expert groups (1: not at all)."""
    layers = list(moe_layers(model))
    if chunks > 1 and not layers:
        raise ValueError(f"expert_chunks={chunks} needs a MoE model; this one has no MoE layers")
    for layer in layers:
        layer.expert_chunks = chunks


def supported(model: Any, modes: Iterable[OverlapMode]) -> list[OverlapMode]:
    """The modes this model can run: expert chunks must divide every MoE layer's local experts."""
    layers = list(moe_layers(model))
    return [
        m
        for m in modes
        if m.expert_chunks == 1 or (layers and all(layer.num_local_experts % m.expert_chunks == 0 for layer in layers))
    ]
