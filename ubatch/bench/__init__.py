"""ubatch-bench: unsplit vs ubatched step time of a reference model, with the ideal beside it.

Runs single-process or under torchrun (``torchrun --nproc-per-node 2 -m ubatch.bench``): the MoE
model is then expert-parallel over all ranks (each rank its own tokens), the dense model
tensor-parallel (the same tokens). NCCL on CUDA, gloo on CPU. With ``--graphs`` (CUDA only) the
step times are CUDA graph replays (see ``ubatch.bench.graphs``). ``--workload generate`` times
whole greedy generations instead, plain and speculative (see ``ubatch.bench.generation``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ubatch.attention import get_backend
from ubatch.attention.backends import AttentionBackend, describe_backend
from ubatch.bench.capacity import dropped_fractions
from ubatch.bench.generation import DRAFTERS, GenerationShape, capture_sizes_for, format_generation_table, generation_sweep
from ubatch.bench.graphs import GRAPH_MODES, measure_graphs
from ubatch.bench.measure import Measurement, keep_freed_cpu_memory, measure
from ubatch.bench.plot import plot_timeline, write_chrome_trace
from ubatch.bench.schedule import DEFAULT_ATTENTION_SHARE, schedule_estimates
from ubatch.bench.workload import Step, make_step
from ubatch.models import ModelConfig, build_model
from ubatch.policy import SplitPolicy, calibrate_from_samples
from ubatch.sm import MODES, SMPartition
from ubatch.teardown import destroy_process_groups_or_warn, import_before_init

logger = logging.getLogger("ubatch.bench")

GRAPH_POLICY_NOTE = ("graph replays: the policy picks the ubatch count whose graph replayed faster in a "
                     "short timing right after capture (capture_time_ms), separate from the measured figures")


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(cast: type, what: str) -> Any:
    """An argparse type: ``cast(text)`` when it is > 0, else an error naming ``what`` was expected."""
    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _positive(int, "a positive integer")
_positive_float = _positive(float, "a positive number")


def _drafter_list(text: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    unknown = [v for v in values if v not in DRAFTERS]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"expected drafters among {', '.join(DRAFTERS)}, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ubatch-bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["moe", "dense"], default="moe")
    p.add_argument("--preset", help="model preset (default: tiny-moe / tiny on CPU, moe-bench / dense-bench on CUDA)")
    add_model_overrides(p)
    p.add_argument("--workload", choices=["prefill", "decode", "mixed", "generate"], default="prefill",
                   help="mixed: a quarter of the tokens are decodes (1 each), the rest prefill chunks; "
                        "generate: tokens/s of whole generations, plain and speculative (one process)")
    p.add_argument("--tokens", type=int_list, default=[512], help="tokens per rank per step, e.g. 256,1024")
    p.add_argument("--prompt-len", type=int, default=128, help="prefill: tokens per request")
    p.add_argument("--context-len", type=int, default=512, help="decode: cached tokens per request")
    p.add_argument("--num-ubatches", type=int_list, help="ubatch counts to try, e.g. 2,3,4 (default 2; "
                   "generate: 1, and only the first count is used)")
    p.add_argument("--requests", type=_positive_int, default=32, help="generate: requests per generation")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64, help="generate: tokens generated per request")
    p.add_argument("--spec-k", type=int_list, default=[2, 4], help="generate: speculative tokens per step to try")
    p.add_argument("--drafter", type=_drafter_list, default=list(DRAFTERS),
                   help=f"generate: drafters to try ({', '.join(DRAFTERS)})")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--attention", choices=["auto", "torch", "flash"], default="auto",
                   help="attention backend: auto takes flash-attn on CUDA where it is installed (the torch backend "
                        "for queries it cannot run), else torch; flash without flash-attn or CUDA is an error")
    p.add_argument("--graphs", action="store_true",
                   help="time steps replayed from CUDA graphs (FULL for decode, PIECEWISE otherwise); needs CUDA")
    p.add_argument("--sm-partition", choices=MODES, default="none",
                   help="how ubatch compute and communication share the SMs (see ubatch.sm)")
    p.add_argument("--comm-sms", type=int, help="SMs for communication (default: ubatch.sm's)")
    p.add_argument("--policy", choices=["fixed", "auto"], default="fixed",
                   help="auto: also report what the calibrated split policy picks at every point")
    p.add_argument("--calibrate-tokens", type=int_list,
                   help="token counts the auto policy calibrates on (default 256,2048; quick: 64,256)")
    p.add_argument("--attention-share", type=float, default=DEFAULT_ATTENTION_SHARE,
                   help="share of a layer's compute before its first collective, for the schedule model's "
                        "estimate in each row (an assumption, not measured)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="a small run that finishes in well under a minute on a CPU")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--plot", help="write a timeline PNG of the first configuration's ubatched step here")
    p.add_argument("--chrome-trace", help="write the same timeline as a Chrome trace (chrome://tracing, Perfetto); "
                   "with --graphs, torch.profiler's trace of the first configuration's replayed ubatched step")
    p.add_argument("--label", default="", help="a free-form tag stored in the report (e.g. the NCCL regime)")
    args = p.parse_args(argv)
    if args.workload == "generate" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--workload generate runs in one process; launch it without torchrun")
    if args.workload == "generate" and (args.policy != "fixed" or args.sm_partition != "none"):
        p.error("--policy and --sm-partition apply to single steps, not to --workload generate")
    if args.model != "moe" and (args.num_experts or args.capacity_factor):
        p.error("--num-experts and --capacity-factor apply to --model moe")
    if not 0 <= args.attention_share < 1:
        p.error(f"--attention-share must be in [0, 1), got {args.attention_share}")
    if args.graphs and args.plot:
        p.error("--plot draws the scheduler's per-ubatch timeline, which graph replays do not record; "
                "--chrome-trace writes the profiled kernels of a replayed ubatched step instead")
    if args.graphs and (args.device == "cpu" or not torch.cuda.is_available()):
        p.error("--graphs replays CUDA graphs and needs a CUDA GPU, but "
                + ("--device cpu was given" if args.device == "cpu" else "torch sees none"))
    args.num_ubatches = args.num_ubatches or [1 if args.workload == "generate" else 2]
    if args.quick:
        args.tokens, args.num_ubatches, args.warmup, args.repeats = [256], args.num_ubatches[:1], 1, 3
        args.requests, args.max_new_tokens, args.spec_k = 4, 8, args.spec_k[:1]
    args.calibrate_tokens = args.calibrate_tokens or ([64, 256] if args.quick else [256, 2048])
    return args


def add_model_overrides(p: argparse.ArgumentParser) -> None:
    """The options that change a preset's shape (also used by scripts/torchrun_generate.py)."""
    p.add_argument("--layers", type=_positive_int, help="override the preset's number of layers")
    p.add_argument("--num-experts", type=_positive_int, help="MoE: override the preset's number of experts "
                   "(expert parallelism needs a multiple of the world size)")
    p.add_argument("--capacity-factor", type=_positive_float, help="MoE: bound the rows each rank sends each "
                   "peer to ceil(f * tokens * top_k / world) (default: worst case, nothing dropped); reports "
                   "the share of assignments dropped, unsplit and ubatched")


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ModelConfig fields the options of ``add_model_overrides`` set."""
    given = {"num_layers": args.layers, "num_experts": args.num_experts, "capacity_factor": args.capacity_factor}
    return {name: value for name, value in given.items() if value is not None}


def _device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA GPU")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _init_distributed(device: torch.device) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        import_before_init()  # --graphs profiles replays; the profiler would pin the default group
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _environment(device: torch.device, world: int, attention: AttentionBackend) -> dict[str, Any]:
    env = {
        "machine": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "attention": describe_backend(attention),
        "world_size": world,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def _shape(args: argparse.Namespace, tokens: int) -> tuple[list[int], list[int]]:
    """(query lengths, cached context lengths) of the step's requests."""
    decodes = {"decode": tokens, "mixed": tokens // 4, "prefill": 0}[args.workload]
    full, rest = divmod(tokens - decodes, args.prompt_len)
    prefill = [args.prompt_len] * full + ([rest] if rest else [])
    return [1] * decodes + prefill, [args.context_len] * decodes + [0] * len(prefill)


def run(args: argparse.Namespace) -> dict[str, Any]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(args.device, local_rank)
    if device.type == "cpu":
        keep_freed_cpu_memory()
    rank, world = _init_distributed(device)
    preset = args.preset or {("moe", False): "tiny-moe", ("dense", False): "tiny",
                             ("moe", True): "moe-bench", ("dense", True): "dense-bench"}[(args.model, device.type == "cuda")]
    config = ModelConfig.preset(preset, **model_overrides(args))
    if (config.kind == "moe") != (args.model == "moe"):
        raise ValueError(f"preset {preset!r} is a {config.kind} model but --model {args.model} was given")
    attention = get_backend(None if args.attention == "auto" else args.attention, device)
    if args.workload == "generate":
        return _generation_report(args, config, build_model(config, device=device, attn_backend=attention), preset,
                                  attention)
    group = dist.group.WORLD if world > 1 else None
    model = build_model(config, device=device, ep_group=group if config.kind == "moe" else None,
                        tp_group=group if config.kind == "dense" else None, attn_backend=attention)
    partition = SMPartition(args.sm_partition, args.comm_sms, device)
    if world > 1:
        partition.setup([group])
    results, first_timeline = [], None

    @functools.lru_cache(maxsize=1)
    def step_at(tokens: int) -> Step:
        """One step (and KV cache) per size, shared by its ubatch counts: sizes are swept outermost."""
        query, context = _shape(args, tokens)
        return make_step(model, query, context, seed=rank if config.kind == "moe" else 0)[0]

    def measure_at(tokens: int, n: int, chrome_trace: str | None = None) -> Measurement:
        step = step_at(tokens)
        if args.graphs:
            return measure_graphs(model, step, n, mode=GRAPH_MODES[args.workload], warmup=args.warmup,
                                  repeats=args.repeats, sm_partition=partition, chrome_trace=chrome_trace)
        return measure(model, step, n, warmup=args.warmup, repeats=args.repeats, sm_partition=partition)

    configs = [(t, n) for t in args.tokens for n in args.num_ubatches]
    for tokens, n in tqdm(configs, desc="configurations", disable=rank != 0):
        profiled_trace = args.chrome_trace if args.graphs and rank == 0 and not results else None
        m = measure_at(tokens, n, profiled_trace)
        first_timeline = first_timeline or m.timeline
        results.append({
            "model": preset, "workload": args.workload, "tokens_per_rank": tokens, "num_ubatches": n,
            "world_size": world, "label": args.label, "sm_partition": partition.effective_mode,
            "comm_sms": partition.comm_sms_for(), **m.as_dict(),
            **schedule_estimates(m.compute_ms, m.comm_ms, m.comm_stretch, num_ubatches=n, layers=config.num_layers,
                                 attention_share=args.attention_share),
            "dropped_fraction": dropped_fractions(model, step_at(tokens), n, sm_partition=partition),
        })
    report = {"environment": _environment(device, world, attention), "args": vars(args), "results": results}
    if args.policy == "auto":
        report["auto"] = _auto_policy(args, results, measure_at, stages=2 * config.num_layers)
    if rank == 0 and args.chrome_trace and first_timeline:
        write_chrome_trace(first_timeline, args.chrome_trace)
    if rank == 0 and args.plot and first_timeline:
        r = results[0]
        plot_timeline(first_timeline, args.plot,
                      f"{preset} {args.workload}, {r['tokens_per_rank']} tokens/rank, N={r['num_ubatches']}, "
                      f"world {world} {args.label}: speedup {r['speedup']:.2f}x of ideal {r['ideal_speedup']:.2f}x")
    return report


def _generation_report(args: argparse.Namespace, config: ModelConfig, model: Any, preset: str,
                       attention: AttentionBackend) -> dict[str, Any]:
    """Plain and speculative generation, eager (and replayed from graphs with ``--graphs``)."""
    shape = GenerationShape(args.requests, args.prompt_len, args.max_new_tokens)
    graph_modes = [False, True] if args.graphs else [False]
    with tqdm(total=len(graph_modes) * (1 + len(args.drafter) * len(args.spec_k)), desc="generations") as bar:
        rows = generation_sweep(model, config, shape, graph_modes=graph_modes, spec_ks=args.spec_k,
                                drafters=args.drafter, capture_sizes=capture_sizes_for(shape, max(args.spec_k)),
                                num_ubatches=args.num_ubatches[0], progress=bar)
    results = [{"model": preset, "workload": "generate", "num_requests": shape.num_requests,
                "prompt_len": shape.prompt_len, "max_new_tokens": shape.max_new_tokens, "label": args.label, **row}
               for row in rows]
    return {"environment": _environment(model.device, 1, attention), "args": vars(args), "results": results}


def _auto_policy(args: argparse.Namespace, results: list[dict[str, Any]], measure_at: Any,
                 stages: int) -> dict[str, Any]:
    """Calibrate on sizes of their own, then compare the policy's pick with the best measured
    configuration at every sweep point (all from this run); ``stages`` collectives per step
    (two per layer: dispatch and combine, or two all-reduces). Under ``--graphs`` the eager cost
    model does not apply (no host launch cost): see ``GRAPH_POLICY_NOTE``."""
    if args.graphs:
        return {"note": GRAPH_POLICY_NOTE,
                "points": [_point(results, tokens, _fastest_at_capture(results, tokens)) for tokens in args.tokens]}
    calibration = {t: measure_at(t, 2).calibration_sample() for t in args.calibrate_tokens}
    costs = calibrate_from_samples(calibration, stages=stages)
    policy = SplitPolicy(costs, candidates=[1, *args.num_ubatches])
    return {"calibration": {str(t): sample for t, sample in calibration.items()},
            "costs": {"compute_ms_per_token": costs.compute_ms_per_token, "comm_ms": vars(costs.comm_ms),
                      "host_ms": costs.host_ms, "ubatch_host_ms": costs.ubatch_host_ms,
                      "split_stretch": costs.split_stretch, "stages": costs.stages},
            "points": [_point(results, tokens, policy.decide(tokens)) for tokens in args.tokens]}


def _fastest_at_capture(results: list[dict[str, Any]], tokens: int) -> int:
    """The ubatch count whose graph was fastest in the timings right after capture."""
    timed: dict[int, float] = {}
    for r in results:
        if r["tokens_per_rank"] == tokens:
            timed.update({int(n): ms for n, ms in r["capture_time_ms"].items()})
    return min(timed, key=timed.get)


def _point(results: list[dict[str, Any]], tokens: int, choice: int) -> dict[str, Any]:
    """The policy's ``choice`` beside the best measured ubatch count at ``tokens``."""
    rows = [r for r in results if r["tokens_per_rank"] == tokens]
    measured = {1: rows[0]["baseline_ms"], **{r["num_ubatches"]: r["ubatched_ms"] for r in rows}}
    best = min(measured, key=measured.get)
    point = {"tokens_per_rank": tokens, "choice": choice, "best": best, "best_ms": measured[best]}
    return {**point, "auto_ms": measured[choice], "auto_vs_best": round(measured[best] / measured[choice], 4)}


def format_table(results: list[dict[str, Any]]) -> str:
    graphs = any(r["graphs"] for r in results)
    cols = ["tokens_per_rank", "num_ubatches", *(["eager_baseline_ms"] if graphs else []), "baseline_ms", "ubatched_ms",
            "speedup", "compute_ms", "comm_ms", "ideal_speedup", "efficiency", *(["efficiency_bound"] if graphs else []),
            "hidden_comm_fraction", "hideable_comm_fraction", "comm_stretch", "schedule_model_stretched_ms"]
    heads = ["tokens", "N", *(["eager ms", "graph ms", "graph N ms"] if graphs else ["unsplit ms", "ubatched ms"]),
             "speedup", "C ms", "M ms", "ideal", "effic.", *(["bound"] if graphs else []), "hidden", "hideable",
             "M stretch", "model ms"]
    rows = [[("-" if r.get(c) is None else f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c])) for c in cols]
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _describe(point: dict[str, Any]) -> str:
    best = f"best N={point['best']} ({point['best_ms']:.3f} ms)"
    return (f"auto at {point['tokens_per_rank']} tokens: N={point['choice']} ({point['auto_ms']:.3f} ms), "
            f"{best}: {point['auto_vs_best']:.3f}x of best")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv)
    report = run(args)
    if not dist.is_initialized() or dist.get_rank() == 0:
        generate = args.workload == "generate"
        print((format_generation_table if generate else format_table)(report["results"]))
        for point in report.get("auto", {}).get("points", []):
            print(_describe(point))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2, default=str)
            logger.info("report written to %s", args.out)
    if dist.is_initialized():
        destroy_process_groups_or_warn()
