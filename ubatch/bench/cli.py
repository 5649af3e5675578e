"""ubatch-bench: unsplit vs ubatched step time of a reference model, with the ideal beside it.

``ubatch-bench --quick`` on a CPU starts two gloo ranks itself and runs the tiny MoE model
expert-parallel over them, so there is communication to hide. Under torchrun
(``torchrun --nproc-per-node 2 -m ubatch.bench``) it runs on torchrun's ranks instead. With
``--graphs`` (CUDA only) the step times are CUDA graph replays (see ``ubatch.bench.graphs``).
``--workload generate`` times whole greedy generations instead, plain and speculative (see
``ubatch.bench.generation``). Every flag is checked, and every output file opened, before the
run starts, so a long run never ends in a lost report.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ubatch.bench.generation import DRAFTERS, format_generation_table
from ubatch.bench.graphs import PREFILL_GRAPHS, graph_mode_for
from ubatch.bench.launch import run_on_local_ranks, under_torchrun
from ubatch.bench.options import (
    MeasuredCapacityArg,
    add_model_overrides,
    int_list,
    model_overrides,
    non_negative_int,
    positive_int,
    ubatch_counts,
)
from ubatch.bench.outputs import check_outputs
from ubatch.bench.report import (
    CPU_NOTE,
    LEGEND,
    format_modes_table,
    format_table,
    modes_policy_sentence,
    policy_sentence,
    row_note,
    run_summary,
)
from ubatch.bench.schedule import DEFAULT_ATTENTION_SHARE
from ubatch.bench.sweep import attention_backend, run, run_device
from ubatch.context import CUDAGraphMode
from ubatch.link import parse_link
from ubatch.models import PRESETS, ModelConfig
from ubatch.overlap import parse_modes
from ubatch.sm import MODES
from ubatch.teardown import destroy_process_groups_or_warn

logger = logging.getLogger("ubatch.bench")

QUICK_RANKS = 2


def _drafter_list(text: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    unknown = [v for v in values if v not in DRAFTERS]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"expected drafters among {', '.join(DRAFTERS)}, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ubatch-bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["moe", "dense"], default="moe")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="model preset (default: tiny-moe / tiny on CPU, moe-bench / dense-bench on CUDA)",
    )
    add_model_overrides(p, measured_capacity=True)
    p.add_argument(
        "--workload",
        choices=["prefill", "decode", "mixed", "generate"],
        default="prefill",
        help="mixed: a quarter of the tokens are decodes (1 each), the rest prefill chunks; "
        "generate: tokens/s of whole generations, plain and speculative (one process)",
    )
    p.add_argument("--tokens", type=int_list, help="tokens per rank per step, e.g. 256,1024 (default 512; quick: 256)")
    p.add_argument("--prompt-len", type=positive_int, default=128, help="prefill: tokens per request")
    p.add_argument("--context-len", type=non_negative_int, default=512, help="decode: cached tokens per request")
    p.add_argument(
        "--kv-block-size",
        type=positive_int,
        help="tokens per KV cache page (default: the attention backend's fastest, 128 for flash-attn 4, else 16)",
    )
    p.add_argument(
        "--num-ubatches",
        type=ubatch_counts,
        help="ubatch counts to try, e.g. 2,3,4 (default 2; generate: 1, and only the first count is used)",
    )
    p.add_argument("--requests", type=positive_int, help="generate: requests per generation (default 32; quick: 4)")
    p.add_argument(
        "--max-new-tokens", type=positive_int, help="generate: tokens generated per request (default 64; quick: 8)"
    )
    p.add_argument(
        "--spec-k", type=int_list, help="generate: speculative tokens per step to try (default 2,4; quick: 2)"
    )
    p.add_argument(
        "--drafter",
        type=_drafter_list,
        default=list(DRAFTERS),
        help=f"generate: drafters to try ({', '.join(DRAFTERS)})",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--nproc",
        type=positive_int,
        help=f"ranks to start on this host, gloo on CPU, NCCL with a GPU each on CUDA (default "
        f"{QUICK_RANKS} with --quick on CPU, else 1); under torchrun its ranks are used",
    )
    p.add_argument(
        "--attention",
        choices=["auto", "torch", "flash", "triton"],
        default="auto",
        help="attention backend: auto on CUDA takes decode steps through ubatch's Triton decode kernel "
        "where Triton runs and the rest through flash-attn where installed (torch for queries it cannot "
        "run), else torch; triton: auto with Triton required; flash: flash-attn alone (an error without "
        "flash-attn or CUDA)",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="time steps replayed from CUDA graphs (FULL for decode, PIECEWISE otherwise); needs CUDA",
    )
    p.add_argument(
        "--prefill-graphs",
        choices=PREFILL_GRAPHS,
        default="piecewise",
        help="with --graphs --workload prefill: the graphs prefill steps replay from; full captures the "
        "whole step (its prompts all of --prompt-len tokens, so every --tokens a multiple of it): no "
        "collective or attention call is launched from the host between its kernels (default: piecewise)",
    )
    p.add_argument(
        "--sm-partition",
        choices=MODES,
        default="none",
        help="how ubatch compute and communication share the SMs (see ubatch.sm)",
    )
    p.add_argument("--comm-sms", type=positive_int, help="SMs for communication (default: ubatch.sm's)")
    p.add_argument(
        "--policy",
        choices=["fixed", "auto"],
        help="auto: also report what the calibrated split policy picks at every point (default: fixed; quick: auto)",
    )
    p.add_argument(
        "--calibrate-tokens",
        type=int_list,
        help="token counts the auto policy calibrates on (default 256,2048; quick: 64,256)",
    )
    p.add_argument(
        "--attention-share",
        type=float,
        help="share of a layer's compute before its first collective, for the schedule model's "
        "estimate in each row (default: with --modes, measured from the unsplit replay's kernels "
        f"where it has collectives; else {DEFAULT_ATTENTION_SHARE}, assumed)",
    )
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed rounds before the timed ones")
    p.add_argument(
        "--repeats",
        type=positive_int,
        help="timed rounds, each running the step unsplit and ubatched (default 10; quick: 15)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small run that shows what the library does: on a CPU, well under a minute",
    )
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--plot", help="write a timeline PNG of the first configuration's ubatched step here")
    p.add_argument(
        "--chrome-trace",
        help="write the same timeline as a Chrome trace (chrome://tracing, Perfetto); "
        "with --graphs, torch.profiler's trace of the first configuration's replayed ubatched step "
        "(with --modes: of the first mode after unsplit, at the first --tokens size)",
    )
    p.add_argument("--label", default="", help="a free-form tag stored in the report (e.g. the NCCL regime)")
    p.add_argument(
        "--modes",
        type=_modes,
        help="time these overlap modes of each step side by side instead of the ubatch counts, e.g. "
        "overlap,pipeline2,split2,split2+pipeline2,split2+join+pipeline2 (unsplit is always the baseline; "
        "docs/overlap-modes.md)",
    )
    p.add_argument(
        "--fuse-glue",
        nargs="?",
        const="dynamic",
        choices=["dynamic", "static"],
        help="compile the reference models' elementwise glue (norms, rotary, MoE dispatch plan and combine) "
        "with torch.compile on CUDA: fewer, fused kernels (ubatch.models.fusion); static: once per shape",
    )
    p.add_argument(
        "--link",
        type=_link,
        help="one process: communicate over a link stand-in instead of a process group, "
        "host[:GB/s][:wW] (the copy engines through host memory; bandwidth per direction, default their "
        "speed; world size W, default 2) or proxy:GB/s[:wW][:warp] (a host thread paces each transfer, "
        "at any bandwidth; the GPU waits in the driver, or with :warp in one warp that traces show): "
        "would overlap pay on my cluster's links? Figures are labelled stand-in",
    )
    return p


def _modes(text: str) -> list:
    try:
        return parse_modes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _link(text: str) -> str:
    try:
        parse_link(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's arguments with every default filled in; argparse's usage error (exit 2) for any
    flag, or combination, that the run would otherwise fail on later."""
    p = build_parser()
    args = p.parse_args(argv)
    generate = args.workload == "generate"
    _fill_defaults(args, generate)
    world = _check_ranks(p, args, generate)
    _check_graph_modes(p, args)
    if generate and (args.policy != "fixed" or args.sm_partition != "none"):
        p.error("--policy and --sm-partition apply to single steps, not to --workload generate")
    if args.model != "moe" and (args.num_experts or args.capacity_factor):
        p.error("--num-experts and --capacity-factor apply to --model moe")
    if args.attention_share is not None and not 0 <= args.attention_share < 1:
        p.error(f"--attention-share must be in [0, 1), got {args.attention_share}")
    if args.graphs and args.plot:
        p.error(
            "--plot draws the scheduler's per-ubatch timeline, which graph replays do not record; "
            "--chrome-trace writes the profiled kernels of a replayed ubatched step instead"
        )
    if args.graphs and (args.device == "cpu" or not torch.cuda.is_available()):
        p.error(
            "--graphs replays CUDA graphs and needs a CUDA GPU, but "
            + ("--device cpu was given" if args.device == "cpu" else "torch sees none")
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda was given, but torch sees no CUDA GPU")
    _check_model(p, args, world)
    if not generate:
        _check_sweep(p, args)
    if os.environ.get("RANK", "0") == "0":  # the rank that writes them
        _check_outputs(p, args)
    return args


def _fill_defaults(args: argparse.Namespace, generate: bool) -> None:
    """The defaults, smaller with ``--quick``; a flag given explicitly wins over both."""
    quick = args.quick
    defaults = {
        "tokens": [256] if quick else [512],
        "num_ubatches": [1] if generate else [2],
        "requests": 4 if quick else 32,
        "max_new_tokens": 8 if quick else 64,
        "spec_k": [2] if quick else [2, 4],
        "repeats": 15 if quick else 10,
        "policy": "auto" if quick and not generate else "fixed",
        "calibrate_tokens": [64, 256] if quick else [256, 2048],
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if args.nproc is None:
        args.nproc = QUICK_RANKS if quick and on_cpu and not generate and not under_torchrun() else 1
    if args.preset is None:
        args.preset = {
            ("moe", True): "tiny-moe",
            ("dense", True): "tiny",
            ("moe", False): "moe-bench",
            ("dense", False): "dense-bench",
        }[(args.model, on_cpu)]


def _check_ranks(p: argparse.ArgumentParser, args: argparse.Namespace, generate: bool) -> int:
    """How the ranks come about (``args.launched``); the world size."""
    if under_torchrun():
        if args.nproc > 1:
            p.error("--nproc starts ranks of its own; under torchrun, its --nproc-per-node decides")
        args.launched, world = "torchrun", int(os.environ["WORLD_SIZE"])
    else:
        args.launched, world = ("here" if args.nproc > 1 else "one process"), args.nproc
    if generate and world > 1:
        p.error("--workload generate runs in one process; launch it without torchrun or --nproc")
    if args.link and world > 1:
        p.error("--link stands in for the other ranks of one process; launch it without torchrun or --nproc")
    if args.link and generate:
        p.error("--link applies to single steps, not to --workload generate")
    if args.modes and generate:
        p.error("--modes applies to single steps, not to --workload generate")
    if isinstance(args.capacity_factor, MeasuredCapacityArg) and not args.modes:
        p.error(f"--capacity-factor {args.capacity_factor} is measured over the modes of a --modes run; give --modes")
    return world


def _check_graph_modes(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """FULL prefill graphs need prompts of one length; joined experts need FULL graphs."""
    full_prefill = args.prefill_graphs == "full"
    if full_prefill and not (args.graphs and args.workload == "prefill"):
        p.error("--prefill-graphs full applies to --graphs --workload prefill")
    uneven = [t for t in args.tokens if full_prefill and t % args.prompt_len]
    if uneven:
        p.error(
            f"--prefill-graphs full replays prompts of one length: --tokens {','.join(map(str, uneven))} "
            f"is not a multiple of --prompt-len {args.prompt_len}"
        )
    joined = [m.name for m in args.modes or () if m.join_experts]
    if joined and args.graphs and graph_mode_for(args.workload, args.prefill_graphs) == CUDAGraphMode.PIECEWISE:
        p.error(
            f"--modes {','.join(joined)}: joined experts run eagerly or from FULL graphs (decode, or "
            f"--prefill-graphs full), not from the PIECEWISE graphs of --workload {args.workload}"
        )


def _check_model(p: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    try:
        config = ModelConfig.preset(args.preset, **model_overrides(args))
    except ValueError as exc:
        p.error(f"--preset {args.preset} with these overrides: {exc}")
    if config.kind != args.model:
        p.error(f"preset {args.preset!r} is a {config.kind} model but --model {args.model} was given")
    ranks = f"{world} ranks"
    link = parse_link(args.link) if args.link else None
    if link is not None:  # a world of one that shards the model for its world size
        world, ranks = link.world_size, f"the {args.link} stand-in's {link.world_size} ranks"
    if config.kind == "moe" and world > 1 and config.num_experts % world:
        p.error(
            f"{config.num_experts} experts cannot be split evenly over {ranks}; "
            f"use --num-experts with a multiple of {world}"
        )


def _check_sweep(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every configuration (and the auto policy's calibration) can run, so none fails midway."""
    for tokens in args.tokens:
        for n in args.num_ubatches:
            if n > tokens:
                p.error(f"--tokens {tokens} cannot be split into {n} ubatches (one token each at least)")
    if args.policy == "auto" and not args.graphs:
        sizes = sorted(set(args.calibrate_tokens))
        if len(sizes) < 2 or sizes[0] < 2:
            p.error(
                f"--calibrate-tokens needs two or more different sizes of at least 2 tokens (each is split "
                f"in two), got {','.join(map(str, args.calibrate_tokens))}"
            )


def _check_outputs(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each output path can be written (a file is created only to be removed again), and
    matplotlib imports for ``--plot``."""
    check_outputs(p, files={"--out": args.out, "--plot": args.plot, "--chrome-trace": args.chrome_trace})
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install 'ubatch[plot]'")


def rank_report(args: argparse.Namespace) -> dict[str, Any] | None:
    """One rank started by ``main``: its report on rank 0, None on the others."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as torchrun does: the ranks share the host's cores
    try:
        report = run(args)
        rank = dist.get_rank()
    finally:
        if dist.is_initialized():
            destroy_process_groups_or_warn()
    return report if rank == 0 else None


def print_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The table, then what it says: every row's meaning with ``--quick``, else only the rows
    whose speedup is ruled out; the policy's picks."""
    results = report["results"]
    if args.workload == "generate":
        print(format_generation_table(results))
        return
    if args.modes:
        print(format_modes_table(results))
        for point in report.get("auto", {}).get("points", []):
            print(f"- {modes_policy_sentence(point)}")
        print(f"- {model_share_sentence(args.attention_share, results)}")
        capacity = report.get("setup", {}).get("capacity")
        if capacity:
            per_chunk = "".join(
                f"; with {k} expert groups, per chunk {' / '.join(f'{f:g}' for f in factors)}"
                for k, factors in capacity.get("chunk_dispatch", {}).items()
            )
            per_shape = ", ".join(
                f"{shape} {' / '.join(f'{f:g}' for f in factors)}"
                for shape, factors in capacity.get("shape_dispatch", {}).items()
            )
            print(
                f"- capacity factors {capacity['dispatch']:g} (dispatch) and {capacity['expert']:g} (experts): "
                f"the fullest block held {capacity['dispatch_fill']:g}x its balanced share and the fullest "
                f"expert {capacity['expert_fill']:g}x, times a margin of {capacity['margin']:g}{per_chunk}"
                + (f"; per call (expert groups:tokens) {per_shape}" if per_shape else "")
            )
        return
    if args.quick:
        print(run_summary(report))
    print(format_table(results))
    notes = [row_note(r) for r in results if args.quick or r["ruled_out"]]
    notes += [policy_sentence(point, results) for point in report.get("auto", {}).get("points", [])]
    for note in notes:
        print(f"- {note}")
    if args.quick:
        print(LEGEND)
        if report["environment"]["device"] == "cpu" and report["environment"]["world_size"] > 1:
            print(CPU_NOTE)


def model_share_sentence(given: float | None, results: list[dict[str, Any]]) -> str:
    """Which attention share the rows' schedule model took, in words."""
    if given is not None:
        return f"the schedule model took an attention share of {given:g} (--attention-share)"
    measured = sorted({r["attention_share_measured"] for r in results if r.get("attention_share_measured") is not None})
    if measured:
        shares = ", ".join(f"{m:.2f}" for m in measured)
        return f"the schedule model took the attention share the unsplit replay measured: {shares}"
    return f"the schedule model took an assumed attention share of {DEFAULT_ATTENTION_SHARE:g} (none measured)"


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv)
    if args.launched == "here":
        attention_backend(args, run_device(args.device, 0))  # an unusable backend fails here, not on every rank
        logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
        report = run_on_local_ranks(rank_report, args, nproc=args.nproc)
    else:
        report = run(args)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print_report(args, report)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2, default=str)
            logger.info("report written to %s", args.out)
    if dist.is_initialized():
        destroy_process_groups_or_warn()
