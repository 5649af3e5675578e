"""argparse types, and the model-shape options that ``ubatch-bench`` and the scripts share."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ubatch.models.capacity import DEFAULT_MARGIN
from ubatch.scheduler import MAX_UBATCHES


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def ubatch_counts(text: str) -> list[int]:
    """An argparse type: comma-separated ubatch counts, each at most ``MAX_UBATCHES``."""
    values = int_list(text)
    if max(values) > MAX_UBATCHES:
        raise argparse.ArgumentTypeError(f"expected ubatch counts of at most MAX_UBATCHES={MAX_UBATCHES}, got {text!r}")
    return values


def bounded(cast: Callable[[str], Any], what: str, minimum: float, *, inclusive: bool) -> Callable[[str], Any]:
    """An argparse type: ``cast(text)`` when it is above ``minimum`` (or equal, if ``inclusive``),
    else an error saying ``what`` was expected."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value >= minimum if inclusive else value > minimum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = bounded(int, "a positive integer", 0, inclusive=False)
non_negative_int = bounded(int, "an integer >= 0", 0, inclusive=True)
positive_float = bounded(float, "a positive number", 0, inclusive=False)


@dataclass(frozen=True)
class MeasuredCapacityArg:
    """``--capacity-factor measured[:MARGIN]``: the factors come from the run's own routing
    (``ubatch.models.capacity.measure_capacity``) times ``margin``."""

    margin: float = DEFAULT_MARGIN

    def __str__(self) -> str:
        return f"measured:{self.margin:g}"


def capacity_factor_arg(text: str) -> float | MeasuredCapacityArg:
    """An argparse type: a positive capacity factor, or ``measured`` / ``measured:MARGIN``
    (MARGIN >= 1)."""
    if text == "measured" or text.startswith("measured:"):
        margin = text.partition(":")[2]
        if not margin:
            return MeasuredCapacityArg()
        try:
            value = float(margin)
        except ValueError:
            value = 0.0
        if not value >= 1:
            raise argparse.ArgumentTypeError(f"expected measured:MARGIN with a MARGIN >= 1, got {text!r}")
        return MeasuredCapacityArg(value)
    return positive_float(text)


def add_model_overrides(p: argparse.ArgumentParser, *, measured_capacity: bool = False) -> None:
    """The options that change a preset's shape (also used by scripts/torchrun_generate.py);
    ``measured_capacity`` also accepts ``--capacity-factor measured[:MARGIN]``."""
    p.add_argument("--layers", type=positive_int, help="override the preset's number of layers")
    p.add_argument(
        "--num-experts",
        type=positive_int,
        help="MoE: override the preset's number of experts (expert parallelism needs a multiple of the world size)",
    )
    measured = (
        "; measured[:MARGIN] (with --modes): the fullest block the router fills in a run of every mode at "
        f"every size, times MARGIN (default {DEFAULT_MARGIN:g})"
        if measured_capacity
        else ""
    )
    p.add_argument(
        "--capacity-factor",
        type=capacity_factor_arg if measured_capacity else positive_float,
        help="MoE: bound the rows each rank sends each "
        "peer to f times what a uniform router sends, at most one per token (default: one per token, "
        "nothing dropped); reports "
        f"the share of assignments dropped, unsplit and ubatched{measured}",
    )


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ModelConfig fields the options of ``add_model_overrides`` set (a measured capacity
    factor is set on the built model, after its measurement)."""
    factor = None if isinstance(args.capacity_factor, MeasuredCapacityArg) else args.capacity_factor
    given = {"num_layers": args.layers, "num_experts": args.num_experts, "capacity_factor": factor}
    return {name: value for name, value in given.items() if value is not None}
