"""Probe: do a process's first CUDA graphs replay their kernels faster than later ones?

A mode sweep captures, times and frees one graph per mode, the unsplit baseline first. On an H200
the kernels of the first graphs replayed back to back (0.06 us apart in a profiled replay of the
unsplit 256-token decode step) and those of every mode captured later 0.4 us apart, so the sweep
gave the baseline an edge of about 0.08 ms a step. This captures graphs of 200 tiny kernels (the
launch gap is most of their time) in a given order, on the capture stream (``same``) or forked
to a side stream and joined back (``fork``, as a ubatch's compute stream is), each warmed on the
current stream or, with ``--fresh-warm-stream``, on a new one, as a ubatch's first step is, and
times every graph so far as each new one is instantiated; ``--drop`` then frees all but the first
and times it again.

Measured on an H200 (benchmarks/h200/graph_launch/): warmed on the current stream, every graph
replays at 0.92-0.95 us a kernel however many exist; warmed on new streams, the first replays at
0.95 until the second is captured, then every graph at 1.13, the first included. Plain kernels on
new streams do not switch. Hence ``ubatch.bench.modes.sweep_modes`` times the baseline again
after the other modes.
"""

from __future__ import annotations

import argparse
import gc

import torch

KERNELS = 200


def capture(kind: str, x: torch.Tensor, side: torch.cuda.Stream, fresh_warm_stream: bool) -> torch.cuda.CUDAGraph:
    """A graph of ``KERNELS`` elementwise kernels over ``x``, captured as ``kind`` says, warmed
    first on the current stream or on a new one."""

    def body() -> None:
        y = x
        for _ in range(KERNELS):
            y = y * 1.0001

    warm = torch.cuda.Stream() if fresh_warm_stream else torch.cuda.current_stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        body()  # warm outside the capture
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if kind == "same":
            body()
        else:
            capture_stream = torch.cuda.current_stream()
            side.wait_stream(capture_stream)
            with torch.cuda.stream(side):
                body()
            capture_stream.wait_stream(side)
    return graph


def us_per_kernel(graph: torch.cuda.CUDAGraph, repeats: int = 21) -> float:
    """Median replay time over ``repeats`` (after 5 warm replays), per kernel."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / KERNELS)
    return sorted(times)[repeats // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--order", default="same,same,fork", help="graphs to capture in turn: same or fork, comma-separated")
    p.add_argument("--drop", action="store_true", help="then free all but the first and time it again")
    p.add_argument("--fresh-warm-stream", action="store_true", help="warm each graph's kernels on a new stream")
    args = p.parse_args()
    kinds = args.order.split(",")
    if any(kind not in ("same", "fork") for kind in kinds):
        raise SystemExit(f"--order takes same and fork, got {args.order}")
    x = torch.randn(1024, device="cuda")
    side = torch.cuda.Stream()
    kept: list[tuple[str, torch.cuda.CUDAGraph]] = []
    for kind in kinds:
        kept.append((kind, capture(kind, x, side, args.fresh_warm_stream)))
        timed = ", ".join(f"{name} {us_per_kernel(graph):.2f}" for name, graph in kept)
        print(f"after instantiating {len(kept)} graph(s), us per kernel: {timed}", flush=True)
    if args.drop:
        del kept[1:]
        gc.collect()
        torch.cuda.synchronize()
        print(f"after freeing all but the first: {kept[0][0]} {us_per_kernel(kept[0][1]):.2f}")


if __name__ == "__main__":
    main()
