"""One rank's part of an ``ubatch-bench`` run: the model, then every (tokens, ubatch count) of
the sweep timed unsplit and ubatched, or whole generations with ``--workload generate``.

Under several ranks the MoE model is expert-parallel over all of them (each rank its own
tokens), the dense model tensor-parallel (the same tokens); NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ubatch.attention import get_backend
from ubatch.attention.backends import AttentionBackend
from ubatch.bench.auto import auto_policy_report
from ubatch.bench.capacity import dropped_fractions, set_measured_capacity
from ubatch.bench.ceiling import ceiling_fields
from ubatch.bench.generation import GenerationShape, capture_sizes_for, generation_sweep
from ubatch.bench.graphs import graph_mode_for, measure_graphs
from ubatch.bench.measure import Measurement, keep_freed_cpu_memory, measure
from ubatch.bench.modes import modes_report
from ubatch.bench.options import MeasuredCapacityArg, model_overrides
from ubatch.bench.plot import plot_timeline, write_chrome_trace
from ubatch.bench.report import environment, plot_title
from ubatch.bench.roofline import device_ceilings, roofline_fields, shard_worlds
from ubatch.bench.schedule import DEFAULT_ATTENTION_SHARE, schedule_estimates
from ubatch.bench.workload import Step, make_step
from ubatch.link import parse_link
from ubatch.models import ModelConfig, build_model
from ubatch.models.fusion import fused_glue
from ubatch.overlap import OverlapMode
from ubatch.sm import SMPartition
from ubatch.teardown import import_before_init


def run_device(choice: str, local_rank: int) -> torch.device:
    """The device ``--device`` names for this local rank (one GPU per local rank on CUDA)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA GPU")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def attention_backend(args: argparse.Namespace, device: torch.device) -> AttentionBackend:
    """The ``--attention`` backend on ``device`` (RuntimeError where it cannot run)."""
    return get_backend(None if args.attention == "auto" else args.attention, device)


def _init_distributed(device: torch.device) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        import_before_init()  # --graphs profiles replays; the profiler would pin the default group
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def step_shape(args: argparse.Namespace, tokens: int) -> tuple[list[int], list[int]]:
    """(query lengths, cached context lengths) of the step's requests."""
    decodes = {"decode": tokens, "mixed": tokens // 4, "prefill": 0}[args.workload]
    full, rest = divmod(tokens - decodes, args.prompt_len)
    prefill = [args.prompt_len] * full + ([rest] if rest else [])
    return [1] * decodes + prefill, [args.context_len] * decodes + [0] * len(prefill)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """This rank's report (every rank builds the same one; rank 0 draws the plot and trace), with
    the models' glue compiled under ``--fuse-glue``."""
    with fused_glue(args.fuse_glue is not None, dynamic=args.fuse_glue != "static"):
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    device = run_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cpu":
        keep_freed_cpu_memory()
    rank, world = _init_distributed(device)
    config = ModelConfig.preset(args.preset, **model_overrides(args))
    attention = attention_backend(args, device)
    setup = {
        "preset": args.preset,
        "kind": config.kind,
        "num_layers": config.num_layers,
        "num_experts": config.num_experts,
        "launched": args.launched,
        "fuse_glue": args.fuse_glue,
    }
    if args.workload == "generate":
        model = build_model(config, device=device, attn_backend=attention)
        return {**_generation_report(args, config, model, attention), "setup": setup}
    group = parse_link(args.link) if args.link else dist.group.WORLD if world > 1 else None
    model = build_model(
        config,
        device=device,
        ep_group=group if config.kind == "moe" else None,
        tp_group=group if config.kind == "dense" else None,
        attn_backend=attention,
    )
    ep_world, tp_world = shard_worlds(model)
    ceilings = device_ceilings(device)
    partition = SMPartition(args.sm_partition, args.comm_sms, device)
    if world > 1:
        partition.setup([group])
    steps: dict[int, Step] = {}
    measured: dict[tuple[int, int], Measurement] = {}

    def step_at(tokens: int) -> Step:
        """One step (and KV cache) per size, shared by its ubatch counts: sizes are swept outermost."""
        if tokens not in steps:
            steps.clear()
            query, context = step_shape(args, tokens)
            seed = rank if config.kind == "moe" else 0
            steps[tokens], cache = make_step(model, query, context, block_size=args.kv_block_size, seed=seed)
            setup["kv_block_size"] = cache.block_size
        return steps[tokens]

    def measure_at(tokens: int, n: int, chrome_trace: str | None = None) -> Measurement:
        """The configuration's measurement, taken once (the auto policy's calibration reuses the sweep's)."""
        if (tokens, n) not in measured:
            step = step_at(tokens)
            if args.graphs:
                measured[tokens, n] = measure_graphs(
                    model,
                    step,
                    n,
                    mode=graph_mode_for(args.workload, args.prefill_graphs),
                    warmup=args.warmup,
                    repeats=args.repeats,
                    sm_partition=partition,
                    chrome_trace=chrome_trace,
                )
            else:
                measured[tokens, n] = measure(
                    model, step, n, warmup=args.warmup, repeats=args.repeats, sm_partition=partition
                )
        return measured[tokens, n]

    if args.modes:
        if isinstance(args.capacity_factor, MeasuredCapacityArg):
            setup["capacity"] = set_measured_capacity(model, args, step_at, args.capacity_factor.margin)
        ranks = dist.group.WORLD if world > 1 else None  # they time and pick together
        report = modes_report(model, config, args, step_at, sm_partition=partition, group=ranks)
        if args.link:
            setup["link"] = group.describe()  # with the bandwidth its first use calibrated
        report.update(setup=setup, args=vars(args), environment=environment(device, world, attention))
        return report
    results, first_timeline = [], None
    configs = [(t, n) for t in args.tokens for n in args.num_ubatches]
    for tokens, n in tqdm(configs, desc="configurations", disable=rank != 0):
        profiled_trace = args.chrome_trace if args.graphs and rank == 0 and not results else None
        m = measure_at(tokens, n, profiled_trace)
        first_timeline = first_timeline or m.timeline
        results.append(
            {
                "model": args.preset,
                "workload": args.workload,
                "tokens_per_rank": tokens,
                "num_ubatches": n,
                "world_size": world,
                "label": args.label,
                "sm_partition": partition.effective_mode,
                "comm_sms": partition.comm_sms_for(),
                **m.as_dict(),
                **schedule_estimates(
                    m.compute_ms,
                    m.comm_ms,
                    m.comm_stretch,
                    num_ubatches=n,
                    layers=config.num_layers,
                    attention_share=DEFAULT_ATTENTION_SHARE if args.attention_share is None else args.attention_share,
                ),
                "dropped_fraction": dropped_fractions(model, step_at(tokens), n, sm_partition=partition),
                **roofline_fields(
                    config,
                    step_at(tokens).attn_metadata[model.layer_names[0]],
                    m.baseline_ms,
                    ceilings=ceilings,
                    ep_world=ep_world,
                    tp_world=tp_world,
                ),
                **ceiling_fields(
                    config,
                    OverlapMode(num_ubatches=n),
                    tokens,
                    compute_ms=m.compute_ms,
                    comm_ms=m.comm_ms,
                    unsplit_ms=m.baseline_ms,
                    ceilings=ceilings,
                    ep_world=ep_world,
                    tp_world=tp_world,
                ),
            }
        )
    if args.link:
        setup["link"] = group.describe()
    report = {"setup": setup, "args": vars(args), "results": results}
    if args.policy == "auto":
        report["auto"] = auto_policy_report(
            results,
            measure_at,
            tokens=args.tokens,
            num_ubatches=args.num_ubatches,
            calibrate_tokens=args.calibrate_tokens,
            stages=2 * config.num_layers,
            graphs=args.graphs,
        )
    if rank == 0 and args.chrome_trace and first_timeline:
        write_chrome_trace(first_timeline, args.chrome_trace)
    if rank == 0 and args.plot and first_timeline:
        plot_timeline(
            first_timeline,
            args.plot,
            plot_title(results[0], preset=args.preset, workload=args.workload, world=world, label=args.label),
        )
    report["environment"] = environment(device, world, attention)
    return report


def _generation_report(
    args: argparse.Namespace, config: ModelConfig, model: Any, attention: AttentionBackend
) -> dict[str, Any]:
    """Plain and speculative generation, eager (and replayed from graphs with ``--graphs``)."""
    shape = GenerationShape(args.requests, args.prompt_len, args.max_new_tokens)
    graph_modes = [False, True] if args.graphs else [False]
    with tqdm(total=len(graph_modes) * (1 + len(args.drafter) * len(args.spec_k)), desc="generations") as bar:
        rows = generation_sweep(
            model,
            config,
            shape,
            graph_modes=graph_modes,
            spec_ks=args.spec_k,
            drafters=args.drafter,
            capture_sizes=capture_sizes_for(shape, max(args.spec_k)),
            num_ubatches=args.num_ubatches[0],
            progress=bar,
        )
    results = [
        {
            "model": args.preset,
            "workload": "generate",
            "num_requests": shape.num_requests,
            "prompt_len": shape.prompt_len,
            "max_new_tokens": shape.max_new_tokens,
            "label": args.label,
            **row,
        }
        for row in rows
    ]
    return {"environment": environment(model.device, 1, attention), "args": vars(args), "results": results}
