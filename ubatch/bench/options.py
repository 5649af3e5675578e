"""argparse types, and the model-shape options that ``ubatch-bench`` and the scripts share."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
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


def add_model_overrides(p: argparse.ArgumentParser) -> None:
    """The options that change a preset's shape (also used by scripts/torchrun_generate.py)."""
    p.add_argument("--layers", type=positive_int, help="override the preset's number of layers")
    p.add_argument(
        "--num-experts",
        type=positive_int,
        help="MoE: override the preset's number of experts (expert parallelism needs a multiple of the world size)",
    )
    p.add_argument(
        "--capacity-factor",
        type=positive_float,
        help="MoE: bound the rows each rank sends each "
        "peer to ceil(f * tokens * top_k / world) (default: worst case, nothing dropped); reports "
        "the share of assignments dropped, unsplit and ubatched",
    )


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ModelConfig fields the options of ``add_model_overrides`` set."""
    given = {"num_layers": args.layers, "num_experts": args.num_experts, "capacity_factor": args.capacity_factor}
    return {name: value for name, value in given.items() if value is not None}
