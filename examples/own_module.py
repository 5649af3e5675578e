"""Bring your own module: a tensor-parallel MLP whose all-reduce is plain ``torch.distributed``,
overlapped by ubatch with no change to the module.

    torchrun --nproc-per-node 2 examples/own_module.py     # two ranks over gloo
    python examples/own_module.py                          # one process

Each rank holds a column slice of every up-projection and the matching row slice of every
down-projection, so each layer ends in ``dist.all_reduce``. Wrapped with ``UBatchWrapper``, the
model gives the unwrapped model's output, and its layers run interleaved across ubatches
(ubatch 0 layer 0, ubatch 1 layer 0, ubatch 0 layer 1, ...): each all-reduce handed the turn to
the next ubatch while in flight.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ubatch

HIDDEN, FFN, LAYERS, ROWS = 32, 64, 3, 6


class TensorParallelMLP(nn.Module):
    """One residual MLP layer, its hidden units split across the ranks."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor, rank: int, world: int) -> None:
        super().__init__()
        cols = slice(rank * FFN // world, (rank + 1) * FFN // world)
        self.up = nn.Parameter(up[cols].clone())
        self.down = nn.Parameter(down[:, cols].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(F.gelu(F.linear(x, self.up)), self.down)
        dist.all_reduce(partial)  # the sum over the ranks' hidden units
        return x + partial


def build_model(rank: int, world: int) -> nn.Sequential:
    """The same weights on every rank (one seed), each rank keeping its shard."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        up = torch.randn(FFN, HIDDEN, generator=gen) / HIDDEN**0.5
        down = torch.randn(HIDDEN, FFN, generator=gen) / FFN**0.5
        layers.append(TensorParallelMLP(up, down, rank, world))
    return nn.Sequential(*layers)


def record_layer_order(model: nn.Sequential) -> list[tuple[int | None, int]]:
    order: list[tuple[int | None, int]] = []
    for index, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda _m, _a, index=index: order.append((ubatch.current_ubatch_id(), index)))
    return order


def init_process_group() -> None:
    """gloo under torchrun, or a group of one rank in a plain ``python`` run."""
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def main() -> None:
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(rank, world).eval()
    order = record_layer_order(model)
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        for n in (2, 3):
            wrapped = ubatch.UBatchWrapper(model, num_ubatches=n, device="cpu", batched={0: 0})  # split rows
            order.clear()
            got = wrapped(x)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            interleaved = order == [(u, layer) for layer in range(LAYERS) for u in range(n)]
            if rank == 0:
                print(f"N={n}: equals the unwrapped model: True; layer order {order}; interleaved: {interleaved}")
            if not interleaved:
                raise SystemExit(f"the ubatches ran their layers in order {order}, not interleaved")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
