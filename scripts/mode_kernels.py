"""What an overlap mode adds to a step's kernels: one CUDA-graph replay per mode, profiled, and
per kernel family the count and GPU time against the unsplit step, largest change first.
With ``--link``, the summary also says how long the transfers ran and how much of that no
compute kernel hid (``exposed_comm_ms``).

``python scripts/mode_kernels.py --preset moe-bench --tokens 256 --modes overlap,split2+join``
(one GPU, no communication unless ``--link``, over which a MoE preset's experts and a dense one's
heads are parallel; ``--workload prefill`` profiles prompts replayed
from PIECEWISE graphs instead). The summary line per mode gives the replay's span,
the compute kernels' total, and the idle time between them (the per-kernel gaps that every extra
kernel costs inside a graph), and that idle time split into what the host left (the next kernel
started just as its launch returned) and what waited on a dependency (``ubatch.bench.gaps``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile
from collections import defaultdict

import torch

from ubatch.attention.backends import get_backend
from ubatch.bench.capacity import set_measured_capacity
from ubatch.bench.gaps import step_gaps
from ubatch.bench.graphs import PREFILL_GRAPHS, graph_mode_for
from ubatch.bench.kernels import Kernel, kernel_family, profile_kernels
from ubatch.bench.modes import GraphedMode, mode_partition
from ubatch.bench.options import MeasuredCapacityArg, capacity_factor_arg, int_list
from ubatch.bench.outputs import check_outputs
from ubatch.bench.workload import Step, make_step
from ubatch.link import parse_link
from ubatch.models import ModelConfig, build_model
from ubatch.models.fusion import fused_glue
from ubatch.overlap import OverlapMode, parse_modes
from ubatch.sm import SMPartition
from ubatch.trace import Interval, busy_ms


def summary(kernels: list[Kernel]) -> dict[str, float]:
    """The replay's span; its compute kernels' count, summed time and the idle time between them;
    the communication's busy time, and how much of it ran while no compute kernel did."""
    compute = [k for k in kernels if not k.is_comm]
    span = max(k.end_us for k in kernels) - min(k.start_us for k in kernels)
    intervals = [
        Interval(0, "comm" if k.is_comm else "compute", k.name, k.start_us / 1e3, k.end_us / 1e3) for k in kernels
    ]
    busy = busy_ms(intervals, "compute")
    either = busy_ms([Interval(0, "any", "k", i.start_ms, i.end_ms) for i in intervals], "any")
    return {
        "kernels": len(compute),
        "span_ms": round(span / 1e3, 3),
        "compute_sum_ms": round(sum(k.end_us - k.start_us for k in compute) / 1e3, 3),
        "compute_idle_ms": round(span / 1e3 - busy, 3),
        "comm_ms": round(busy_ms(intervals, "comm"), 3),
        "exposed_comm_ms": round(either - busy, 3),
    }


def gap_fields(trace_path: str) -> dict[str, float]:
    """The compute and communication lanes' idle time of a profiled replay's Chrome trace, split
    into host-bound and waiting (``ubatch.bench.gaps``)."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        lanes = step_gaps(json.load(f))
    return {
        f"{lane}_{kind}_ms": round(getattr(lanes[lane], f"{kind}_ms"), 3)
        for lane in ("compute", "comm")
        for kind in ("host_bound", "waiting")
    }


def families(kernels: list[Kernel]) -> dict[str, tuple[int, float]]:
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        entry = totals[kernel_family(k.name)]
        entry[0] += 1
        entry[1] += (k.end_us - k.start_us) / 1e3
    return {name: (int(n), ms) for name, (n, ms) in totals.items()}


def step_at(model: object, tokens: int, args: argparse.Namespace) -> Step:
    """The ``tokens``-token step of ``--workload``: decode requests of one token, or prompts."""
    if args.workload == "decode":
        return make_step(model, [1] * tokens, [args.context_len] * tokens)[0]
    if tokens % args.prompt_len:
        raise SystemExit(f"prefill tokens ({tokens}) must be a multiple of --prompt-len ({args.prompt_len})")
    return make_step(model, [args.prompt_len] * (tokens // args.prompt_len))[0]


def print_modes(model: object, tokens: int, args: argparse.Namespace, device: torch.device) -> None:
    """One line per mode of the ``tokens``-token step, then the unsplit step's costliest kernel
    families and each other mode's largest changes against them."""
    step = step_at(model, tokens, args)
    graph_mode = graph_mode_for(args.workload, args.prefill_graphs)
    base: dict[str, tuple[int, float]] = {}
    partitions: dict[int, SMPartition] = {}
    for mode in args.modes:
        partition = mode_partition(mode, None, device, partitions)
        with tempfile.TemporaryDirectory() as scratch:
            trace = os.path.join(args.trace_dir or scratch, f"{mode.name}_{tokens}.json")
            with fused_glue(args.fuse_glue is not None, dynamic=args.fuse_glue != "static"):
                with GraphedMode(model, step, mode, graph_mode, partition) as replay:
                    kernels = profile_kernels(replay, device, chrome_trace=trace)
            gaps = gap_fields(trace)
        print(json.dumps({"tokens": tokens, "mode": mode.name, **summary(kernels), **gaps}), flush=True)
        totals = families(kernels)
        if mode == OverlapMode():
            base = totals
            for fam, (count, ms) in sorted(totals.items(), key=lambda item: -item[1][1])[: args.top]:
                print(f"  {fam:60s} {count:5d}   {ms:7.3f} ms")
            continue

        def change(fam: str) -> float:
            return abs(totals.get(fam, (0, 0.0))[1] - base.get(fam, (0, 0.0))[1])

        changed = sorted(set(base) | set(totals), key=change, reverse=True)
        for fam in changed[: args.top]:
            (c1, t1), (cn, tn) = base.get(fam, (0, 0.0)), totals.get(fam, (0, 0.0))
            print(f"  {fam:60s} {c1:5d} -> {cn:5d}   {t1:7.3f} -> {tn:7.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="moe-bench")
    p.add_argument(
        "--tokens",
        type=int_list,
        default=[256],
        help="tokens per step, comma-separated, profiled in this order in one process (as ubatch-bench captures them)",
    )
    p.add_argument(
        "--workload",
        choices=["decode", "prefill"],
        default="decode",
        help="decode requests of one token (FULL graphs), or prompts of --prompt-len (PIECEWISE graphs)",
    )
    p.add_argument(
        "--prefill-graphs", choices=PREFILL_GRAPHS, default="piecewise", help="prefill's graphs, as ubatch-bench's"
    )
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--context-len", type=int, default=512, help="cached tokens per decode request")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--capacity-factor",
        type=capacity_factor_arg,
        default=2.0,
        help="a factor, or measured[:MARGIN] from the modes' own routing (as ubatch-bench's)",
    )
    p.add_argument("--modes", type=parse_modes, default=parse_modes("overlap,pipeline2,split2,split2+join"))
    p.add_argument(
        "--attention", choices=["auto", "torch", "flash", "triton"], default="auto", help="as ubatch-bench's"
    )
    p.add_argument("--link", type=parse_link, help="the link stand-in, host[:GBps][:wW] or proxy:GBps[:wW]")
    p.add_argument("--top", type=int, default=10)
    p.add_argument(
        "--fuse-glue",
        nargs="?",
        const="dynamic",
        choices=["dynamic", "static"],
        help="compile the models' glue (ubatch.models.fusion); static: once per shape",
    )
    p.add_argument("--trace-dir", help="write each mode's profiled replay here as a Chrome trace (MODE_TOKENS.json)")
    args = p.parse_args()
    check_outputs(p, folders={"--trace-dir": args.trace_dir})
    device = torch.device("cuda")
    measured = isinstance(args.capacity_factor, MeasuredCapacityArg)
    factor = None if measured else args.capacity_factor
    config = ModelConfig.preset(args.preset, num_layers=args.layers, capacity_factor=factor)
    link = args.link
    if link is not None:
        link.prepare(device)
    model = build_model(
        config,
        device=device,
        ep_group=link if config.kind == "moe" else None,
        tp_group=link if config.kind == "dense" else None,
        attn_backend=get_backend(None if args.attention == "auto" else args.attention, device),
    )
    if measured:
        if config.kind != "moe":
            raise SystemExit(f"--capacity-factor {args.capacity_factor} needs a MoE preset, got {args.preset}")
        factors = set_measured_capacity(
            model, args, lambda tokens: step_at(model, tokens, args), args.capacity_factor.margin
        )
        print(json.dumps({"capacity": factors}), flush=True)
    for tokens in args.tokens:
        print_modes(model, tokens, args, device)


if __name__ == "__main__":
    main()
