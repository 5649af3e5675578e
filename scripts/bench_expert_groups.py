"""What running the experts in groups costs a decode step's GEMMs, and whether a second stream
wins it back: one layer's SwiGLU experts over routed rows as one ``torch._grouped_mm`` call per
projection, as k calls over E / k experts each in turn on one stream (what an expert-pipelined
mode runs without communication), and as the same k calls with every odd group on a second
stream, so one group's GEMMs can fill the SMs the other's last wave leaves idle.

Why: a grouped GEMM runs in waves of tiles over the SMs; cutting one call into k leaves k partly
filled last waves. Each variant is captured in a CUDA graph of ``--layers`` layers and timed by
replays (the setting of a FULL-graph decode step).

``python scripts/bench_expert_groups.py [--tokens 256,1024] [--groups 2,4]`` on one GPU; prints
one JSON line per (tokens, groups) with the median replay time of each variant over
``--repeats`` and their ratios to the one-call step.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from ubatch.bench.measure import event_times_ms


def routed_offsets(tokens: int, experts: int, top_k: int, generator: torch.Generator) -> list[int]:
    """Each expert's row count for ``tokens`` routed top-``top_k`` by a random router over
    random hidden states (the bench presets' routing), as end offsets."""
    hidden = 256
    router = torch.randn(hidden, experts, generator=generator)
    x = torch.randn(tokens, hidden, generator=generator)
    ids = (x @ router).topk(top_k, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=experts)
    return counts.cumsum(0).tolist()


def experts_call(rows: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)


def build(tokens: int, experts: int, groups: int, hidden: int, inter: int, layers: int, seed: int):
    """The three variants' step functions over one set of rows and weights."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    generator = torch.Generator().manual_seed(seed)
    ends = routed_offsets(tokens, experts, 2, generator)
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dt) * 0.01
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dt) * 0.01
    rows = torch.randn(ends[-1], hidden, device=dev, dtype=dt)
    size = experts // groups
    starts = [0] + ends
    parts = []
    for g in range(groups):
        first, last = starts[g * size], starts[(g + 1) * size]
        offs = torch.tensor([e - first for e in ends[g * size : (g + 1) * size]], device=dev, dtype=torch.int32)
        parts.append((rows[first:last], offs, w13[g * size : (g + 1) * size], w2[g * size : (g + 1) * size]))
    whole = torch.tensor(ends, device=dev, dtype=torch.int32)
    side = torch.cuda.Stream()

    def one_call() -> None:
        for _ in range(layers):
            experts_call(rows, whole, w13, w2)

    def in_turn() -> None:
        for _ in range(layers):
            for part in parts:
                experts_call(*part)

    def two_streams() -> None:
        main = torch.cuda.current_stream()
        for _ in range(layers):
            fork = main.record_event()
            done = []
            for g, part in enumerate(parts):
                if g % 2 == 0:
                    experts_call(*part)
                    continue
                side.wait_event(fork)
                with torch.cuda.stream(side):
                    experts_call(*part)
                    done.append(side.record_event())
            for event in done:
                main.wait_event(event)

    return {"one_call": one_call, "in_turn": in_turn, "two_streams": two_streams}, ends


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="256,1024", help="tokens routed to this rank's experts, comma-separated")
    p.add_argument("--groups", default="2,4")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for tokens in map(int, args.tokens.split(",")):
        for groups in map(int, args.groups.split(",")):
            variants, ends = build(tokens, args.experts, groups, args.hidden, args.inter, args.layers, args.seed)
            replays = {name: graphed(fn) for name, fn in variants.items()}
            times: dict[str, list[float]] = {name: [] for name in replays}
            for _ in range(3):  # rounds, each variant in turn, so drift touches all alike
                for name, replay in replays.items():
                    times[name] += event_times_ms(replay, repeats=args.repeats // 3)
            medians = {name: statistics.median(t) for name, t in times.items()}
            row = {
                "tokens": tokens,
                "groups": groups,
                "experts": args.experts,
                "rows_per_expert": [b - a for a, b in zip([0] + ends, ends)],
                "layers": args.layers,
                **{f"{name}_ms": round(ms, 3) for name, ms in medians.items()},
                **{f"{name}_min_max_ms": [round(min(t), 3), round(max(t), 3)] for name, t in times.items()},
                "in_turn_ratio": round(medians["in_turn"] / medians["one_call"], 4),
                "two_streams_ratio": round(medians["two_streams"] / medians["one_call"], 4),
                "device": torch.cuda.get_device_name(),
            }
            print(json.dumps(row), flush=True)
            del variants, replays
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
