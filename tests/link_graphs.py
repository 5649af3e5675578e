"""What every link stand-in must do on a GPU: a CUDA graph that captured its all-to-all and
all-reduce, replayed on fresh inputs, leaves the values a world of one would."""

from __future__ import annotations

import torch


def replay_captured_collectives(link, static_in: torch.Tensor, replays: int = 3) -> None:
    """Capture an all-to-all of ``static_in`` and an all-reduce of its result, then replay the
    graph ``replays`` times on new random inputs, checking both outputs each time."""
    static_out = torch.zeros_like(static_in)
    reduced = torch.zeros_like(static_in)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        link.all_to_all_single(static_out, static_in)
        reduced.copy_(static_out)
        link.all_reduce(reduced)
    for _ in range(replays):
        static_in.copy_(torch.randn_like(static_in))
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, static_in)
        assert torch.equal(reduced, static_in)
