"""Rows per expert as a skewed router deals them, and how full a grouped GEMM's row tiles run over
them: each expert's last tile of rows is part empty, which weighs more the fewer rows each expert
has (a split's ubatch), so the expert-GEMM benches and probes draw their rows here."""

from __future__ import annotations

import math

import torch


def expert_counts(experts: int, rows_per_expert: int, skew: float, generator: torch.Generator) -> list[int]:
    """Rows per expert summing to ``experts * rows_per_expert``: equal where ``skew`` is 0, else a
    multinomial draw over experts with log-normal weights of sigma ``skew``."""
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    total = experts * rows_per_expert
    if skew == 0 or total == 0:
        return [rows_per_expert] * experts
    weights = torch.exp(skew * torch.randn(experts, generator=generator, dtype=torch.float64))
    picks = torch.multinomial(weights, total, replacement=True, generator=generator)
    return torch.bincount(picks, minlength=experts).tolist()


def tile_fill(counts: list[int], tile: int) -> float:
    """Rows computed with every expert's rows rounded up to whole tiles, over the real rows."""
    real = sum(counts)
    return sum(math.ceil(n / tile) * tile for n in counts) / real if real else 1.0


def spread_fields(counts: list[int], rows_per_expert: int, tiles: tuple[int, ...] = (64, 128)) -> dict[str, float]:
    """A report row's view of ``counts``: its ``fullest`` expert's rows over the mean, and
    ``tile_fill_T`` for each row tile T (``tile_fill``)."""
    fields = {"fullest": round(max(counts) / rows_per_expert, 3)}
    return fields | {f"tile_fill_{t}": round(tile_fill(counts, t), 4) for t in tiles}
