"""Expert parallelism written by the user with ``torch.distributed.all_to_all_single``, overlapped
by ubatch with no change to it.

    torchrun --nproc-per-node 2 examples/expert_parallel.py     # two ranks over gloo
    python examples/expert_parallel.py                          # one process

A Mixtral-style MoE: a router picks the top 2 of 4 experts for each token, each rank holds its
share of the experts, and tokens travel to their experts' ranks and back with ``all_to_all_single``
(the counts first, then the tokens and their expert ids, then the results). ``ExpertParallelExperts``
keeps transformers' ``MixtralExperts`` layout and call, so it also replaces the experts of a
transformers Mixtral. Wrapped with ``UBatchWrapper``, the model gives the unwrapped model's output,
and its layers run interleaved across ubatches: every all-to-all yielded while in flight.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ubatch

HIDDEN, FFN, EXPERTS, TOP_K, LAYERS, ROWS = 16, 32, 4, 2, 3, 8


class ExpertParallelExperts(nn.Module):
    """This rank's experts out of ``gate_up_proj`` [experts, 2 * ffn, hidden] and ``down_proj``
    [experts, hidden, ffn] (transformers' Mixtral layout); called like ``MixtralExperts``."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, rank: int, world: int) -> None:
        super().__init__()
        num_experts = gate_up_proj.shape[0]
        if num_experts % world:
            raise ValueError(f"{num_experts} experts do not split evenly over {world} ranks")
        self.per_rank = num_experts // world
        self.first = rank * self.per_rank
        self.world = world
        mine = slice(self.first, self.first + self.per_rank)
        self.gate_up_proj = nn.Parameter(gate_up_proj[mine].detach().clone())
        self.down_proj = nn.Parameter(down_proj[mine].detach().clone())

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)  # assignments grouped by expert, so by rank
        expert = expert[order]
        token = torch.arange(tokens, device=hidden_states.device).repeat_interleave(top_k)[order]

        send_counts = torch.bincount(expert // self.per_rank, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        received = hidden_states.new_empty((sum(recv), hidden_states.shape[1]))
        dist.all_to_all_single(received, hidden_states[token], recv, send)
        received_expert = expert.new_empty(sum(recv))
        dist.all_to_all_single(received_expert, expert, recv, send)

        computed = self._run_experts(received, received_expert - self.first)
        returned = hidden_states.new_empty((len(token), hidden_states.shape[1]))
        dist.all_to_all_single(returned, computed, send, recv)
        weights = top_k_weights.reshape(-1)[order, None].to(returned.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, returned * weights)

    def _run_experts(self, x: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for e in range(self.per_rank):
            rows = (local_expert == e).nonzero().squeeze(1)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[rows] = F.linear(F.silu(gate) * up, self.down_proj[e])
        return out


class MoELayer(nn.Module):
    """A residual MoE layer: a replicated top-k router in front of the experts."""

    def __init__(self, router: torch.Tensor, experts: ExpertParallelExperts) -> None:
        super().__init__()
        self.router = nn.Parameter(router.clone())
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.router), dim=-1)
        weights, index = torch.topk(probs, TOP_K, dim=-1)
        return x + self.experts(x, index, weights / weights.sum(dim=-1, keepdim=True))


def build_model(rank: int, world: int) -> nn.Sequential:
    """The same weights on every rank (one seed), each rank keeping its experts."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        router = torch.randn(EXPERTS, HIDDEN, generator=gen)
        gate_up = torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=gen) / HIDDEN**0.5
        down = torch.randn(EXPERTS, HIDDEN, FFN, generator=gen) / FFN**0.5
        layers.append(MoELayer(router, ExpertParallelExperts(gate_up, down, rank, world)))
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
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1 + rank))  # each rank its tokens
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
