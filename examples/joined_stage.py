"""Run one stage of your model once over every ubatch's rows: ``ubatch.join_ubatches``.

    python examples/joined_stage.py

A split step reads every weight once per ubatch. Where one stage's weights dominate (a MoE
layer's experts), join that stage: each ubatch runs the rest of the layer on its own rows (one
ubatch's part runs while another's collective is in flight), then the last ubatch to arrive runs
the joined stage once over all their rows, and each ubatch continues with its own rows of the
result. The joined model gives the unwrapped model's output, and the joined stage runs once per
layer, not once per ubatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ubatch

HIDDEN, WIDE, LAYERS, ROWS = 32, 256, 3, 10


class Layer(nn.Module):
    """A per-token part (a norm and a small projection) and a wide part joined across ubatches."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)
        self.up = nn.Parameter(torch.randn(WIDE, HIDDEN, generator=gen) / HIDDEN**0.5)
        self.down = nn.Parameter(torch.randn(HIDDEN, WIDE, generator=gen) / WIDE**0.5)
        self.wide_calls: list[int] = []  # rows per call of the wide part

    def wide(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The wide part over every ubatch's rows at once (its weights read once), split back."""
        rows = torch.cat(parts)
        self.wide_calls.append(len(rows))
        out = F.linear(F.gelu(F.linear(rows, self.up)), self.down)
        return list(out.split([len(p) for p in parts]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(F.layer_norm(x, (HIDDEN,)), self.proj)
        return x + ubatch.join_ubatches(self, h, self.wide)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(*[Layer(gen) for _ in range(LAYERS)]).eval()
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        for n in (2, 3):
            for layer in model:
                layer.wide_calls.clear()
            wrapped = ubatch.UBatchWrapper(model, num_ubatches=n, device="cpu", batched={0: 0})  # split rows
            got = wrapped(x)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            calls = [layer.wide_calls for layer in model]
            print(f"N={n}: equals the unwrapped model: True; rows per wide call, per layer: {calls}")
            if calls != [[ROWS]] * LAYERS:
                raise SystemExit(f"the wide part ran {calls}, not once per layer over all {ROWS} rows")


if __name__ == "__main__":
    main()
