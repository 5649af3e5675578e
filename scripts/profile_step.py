"""Where a ubatched step's GPU time goes: per-kernel timelines with their host launch times.

Run under torchrun on the GPU machine (``torchrun --nproc-per-node 2 scripts/profile_step.py``).
For each SM partition and ubatch count, one step of the EP MoE model (prefill or decode, eager or
replayed from CUDA graphs) is profiled with torch.profiler. Every kernel is kept as (name, kind,
stream, start, end, host launch time), so one can tell compute starved by the host (a kernel
launched after the previous one ended) from compute waiting on communication, see which kernels
grow when a step is split, and whether NCCL kernels slow down beside compute (``scripts/comm_waits.py``
splits their time into transfer and waiting for the peer). Writes
``profile{tag}_rank{r}.json.gz`` and prints one summary line per configuration.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from ubatch.bench.graphs import PREFILL_GRAPHS, graph_mode_for, replay_call, step_uniform_tokens
from ubatch.bench.measure import EagerRuns, drain, median_ms
from ubatch.bench.outputs import check_outputs
from ubatch.bench.workload import make_step
from ubatch.graphed import GraphedModel
from ubatch.models import ModelConfig, build_model
from ubatch.sm import SMPartition
from ubatch.teardown import import_before_init
from ubatch.trace import Interval, busy_ms

COMPUTE, COMM = 0, 1


def trace_origin(trace: dict[str, Any]) -> float:
    """The trace's first kernel or launch, in the profiler's clock (us): rows are relative to it.
    Ranks on one host share that clock, so origins line their timelines up."""
    events = trace.get("traceEvents", [])
    return min(
        (
            e["ts"]
            for e in events
            if (e.get("cat") == "kernel" and e.get("ph") == "X")
            or (e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}))
        ),
        default=0.0,
    )


def kernel_records(trace: dict[str, Any], names: dict[str, int]) -> list[list[float]]:
    """[name id, kind, stream, start_us, end_us, launch_us] per kernel, from the first launch;
    ``names`` maps kernel names to ids and grows as new names appear."""
    events = trace.get("traceEvents", [])
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    origin = trace_origin(trace)
    rows = []
    for k in kernels:
        kind = COMM if "nccl" in k["name"].lower() else COMPUTE
        launch = launches.get(k["args"].get("correlation"), k["ts"])
        name = names.setdefault(k["name"], len(names))
        rows.append(
            [name, kind, k["args"].get("stream", -1), k["ts"] - origin, k["ts"] + k["dur"] - origin, launch - origin]
        )
    return sorted(rows, key=lambda r: r[3])


def summarize(rows: list[list[float]]) -> dict[str, float]:
    """Busy time of compute and communication kernels, and why the compute lane sat idle:
    waiting for the host (the next kernel was launched after the lane went idle) or for
    something else (communication, an event)."""
    compute = [r for r in rows if r[1] == COMPUTE]
    comm = [r for r in rows if r[1] == COMM]
    host_gap = wait_gap = 0.0
    last_end = None
    for r in compute:  # compute runs in host issue order across ubatches: one lane
        if last_end is not None and r[3] > last_end:
            gap = r[3] - last_end
            host_part = min(gap, max(0.0, r[5] - last_end))
            host_gap += host_part
            wait_gap += gap - host_part
        last_end = r[4] if last_end is None else max(last_end, r[4])
    return {
        "span_ms": round((max(r[4] for r in rows) - min(r[3] for r in rows)) / 1e3, 3),
        "compute_kernels": len(compute),
        "compute_sum_ms": round(sum(r[4] - r[3] for r in compute) / 1e3, 3),
        "comm_kernels": len(comm),
        "comm_sum_ms": round(sum(r[4] - r[3] for r in comm) / 1e3, 3),
        "comm_busy_ms": round(busy_ms([Interval(0, "comm", "", r[3] / 1e3, r[4] / 1e3) for r in comm], "comm"), 3),
        "compute_idle_host_ms": round(host_gap / 1e3, 3),
        "compute_idle_waiting_ms": round(wait_gap / 1e3, 3),
    }


def profile_rows(fn: Any, device: torch.device, names: dict[str, int]) -> tuple[list[list[float]], float]:
    """The kernels of one call of ``fn``, after a discarded profiled call (profiler start-up), and
    their origin (``trace_origin``)."""
    os.environ.setdefault("TEARDOWN_CUPTI", "0")  # CUPTI re-initialised can crash graph replays
    drain(device)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
        for _ in range(2):
            fn()
            drain(device)
            prof.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return kernel_records(trace, names), trace_origin(trace)


def _step_calls(model: Any, step: Any, counts: list[int], partition: SMPartition, args: argparse.Namespace):
    """(ubatch count, call) per count: eager unsplit / ubatched runs, or graph replays."""
    if not args.graphs:
        for n in counts:
            runs = EagerRuns(model, step, max(n, 2), sm_partition=partition)
            yield n, runs.baseline if n == 1 else runs.ubatched
        return
    mode = graph_mode_for(args.workload, args.prefill_graphs)
    blocks = step.attn_metadata[model.layer_names[0]].block_table.shape[1]
    graphed = GraphedModel(
        model,
        capture_sizes=[step.num_tokens],
        max_blocks_per_req=blocks,
        ubatch_counts=sorted(set(counts) | {1}),
        uniform_token_count=step_uniform_tokens(model, step),
        modes=(mode,),
        sm_partition=partition,
    )
    graphed.capture()
    try:
        for n in counts:
            yield n, replay_call(graphed, step, n, mode)
    finally:
        graphed.release()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["prefill", "decode"], default="prefill")
    p.add_argument("--graphs", action="store_true", help="profile CUDA graph replays (FULL decode, PIECEWISE prefill)")
    p.add_argument(
        "--prefill-graphs", choices=PREFILL_GRAPHS, default="piecewise", help="prefill's graphs, as ubatch-bench's"
    )
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--num-ubatches", default="1,2,3,4")
    p.add_argument(
        "--sm-partition",
        default="none",
        help="comma-separated modes, each optionally with its comm SMs, e.g. none,green:16,cooperative:4",
    )
    p.add_argument("--layers", type=int)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tag", default="", help="added to the output file names")
    args = p.parse_args()
    check_outputs(p, folders={"--out": args.out})
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    import_before_init()  # the profiler would otherwise pin the default group past its destruction
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    config = ModelConfig.preset("moe-bench", **({"num_layers": args.layers} if args.layers else {}))
    model = build_model(config, device=device, ep_group=group)
    if args.workload == "decode":
        step, _ = make_step(model, [1] * args.tokens, [args.context_len] * args.tokens, seed=rank)
    else:
        step, _ = make_step(model, [args.prompt_len] * (args.tokens // args.prompt_len), seed=rank)
    names: dict[str, int] = {}
    report: dict[str, Any] = {
        "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "args": vars(args),
        "configs": [],
    }
    for spec in args.sm_partition.split(","):
        mode, _, sms = spec.partition(":")
        partition = SMPartition(mode, int(sms) if sms else None, device)
        partition.setup([group])
        for n, fn in _step_calls(model, step, [int(c) for c in args.num_ubatches.split(",")], partition, args):
            wall = median_ms(fn, device, warmup=2, repeats=5)
            rows, origin = profile_rows(fn, device, names)
            summary = {"mode": spec, "num_ubatches": n, "wall_ms": round(wall, 3), **summarize(rows)}
            report["configs"].append({**summary, "origin_us": origin, "kernels": rows})
            if rank == 0:
                print(json.dumps(summary), flush=True)
    report["kernel_names"] = sorted(names, key=names.get)
    with gzip.open(os.path.join(args.out, f"profile{args.tag}_rank{dist.get_rank()}.json.gz"), "wt") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
