"""Data-parallel greedy generation under torchrun: each rank serves its own random prompts.

    torchrun --nproc-per-node 2 scripts/torchrun_generate.py --model moe --num-ubatches 2 [--split-policy auto]

The MoE model runs DeepSeek-style: attention data-parallel (each rank its own requests and KV
cache), experts expert-parallel over all ranks; the dense model is replicated per rank. Every
rank steps until all are done (idle ranks run padding steps so the expert all-to-alls match).
NCCL on CUDA (one GPU per local rank), gloo on CPU. Rank 0 prints generated tokens per second
of a second pass over the same prompts: the first meets every shape (cuDNN builds an attention
plan per new shape, see the README). ``--split-policy auto`` first calibrates the split policy on
the model (``ubatch.bench.calibration``), so steps too small to gain from a split run whole.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ubatch.bench.calibration import calibrated_policy
from ubatch.bench.options import add_model_overrides, int_list, model_overrides
from ubatch.dp import dp_cpu_group
from ubatch.models import ModelConfig, build_model
from ubatch.runner import ModelRunner
from ubatch.teardown import destroy_process_groups_or_warn

logger = logging.getLogger("torchrun_generate")

DEFAULT_PRESETS = {
    ("moe", "cpu"): "tiny-moe",
    ("dense", "cpu"): "tiny",
    ("moe", "cuda"): "small-moe",
    ("dense", "cuda"): "small",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["moe", "dense"], default="moe")
    p.add_argument("--preset", help="model preset (default: tiny-moe / tiny on CPU, small-moe / small on CUDA)")
    add_model_overrides(p)
    p.add_argument("--prompts-per-rank", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt; lengths are drawn from [len/2, len]")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--num-ubatches", type=int, default=1, help="1: never split; >= 2: split when every rank can")
    p.add_argument(
        "--split-policy",
        choices=["always", "auto"],
        default="always",
        help="auto: split only steps that the policy, calibrated on the model first, picks",
    )
    p.add_argument(
        "--calibrate-tokens", type=int_list, default=[256, 2048], help="token counts --split-policy auto times"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits for a peer")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.split_policy == "auto" and args.num_ubatches < 2:
        p.error(f"--split-policy auto needs --num-ubatches >= 2, got {args.num_ubatches}")
    for name in ("prompts_per_rank", "prompt_len", "max_new_tokens", "num_ubatches", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def init_distributed(choice: str, timeout_s: float) -> tuple[torch.device, int, int]:
    """(device, rank, world size); NCCL with one GPU per local rank on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if use_cuda:
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise SystemExit(
                f"error: local rank {local_rank} needs a GPU of its own but only {visible} are "
                f"visible; use --nproc-per-node <= {visible} (world size {world})"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s), device_id=device if use_cuda else None
        )
        return device, dist.get_rank(), world
    return device, 0, 1


def model_config(args: argparse.Namespace, device: torch.device, world: int) -> tuple[str, ModelConfig]:
    """The preset's name and config, checked against the world size with an error naming it."""
    preset = args.preset or DEFAULT_PRESETS[(args.model, device.type)]
    if args.model != "moe" and (args.num_experts or args.capacity_factor):
        raise SystemExit("error: --num-experts and --capacity-factor apply to --model moe")
    config = ModelConfig.preset(preset, **model_overrides(args))
    if config.kind != args.model:
        raise SystemExit(f"error: preset {preset!r} is a {config.kind} model but --model {args.model} was given")
    if config.kind == "moe" and config.num_experts % world:
        raise SystemExit(
            f"error: preset {preset!r} has {config.num_experts} experts, which cannot be split evenly "
            f"over world size {world}; use a number of ranks that divides {config.num_experts}"
        )
    return preset, config


def random_prompts(args: argparse.Namespace, config: ModelConfig, rank: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed * 100003 + rank)
    lengths = torch.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, (args.prompts_per_rank,), generator=g)
    return [torch.randint(0, config.vocab_size, (int(n),), generator=g).tolist() for n in lengths]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv)
    device, rank, world = init_distributed(args.device, args.timeout)
    generate_and_report(args, device, rank, world)
    if dist.is_initialized():
        destroy_process_groups_or_warn()  # after the model, runner and groups above are gone


def generate_and_report(args: argparse.Namespace, device: torch.device, rank: int, world: int) -> None:
    """Time one generation on every rank; rank 0 prints the throughput. Ranks leave together."""
    preset, config = model_config(args, device, world)
    group = dist.group.WORLD if world > 1 else None
    model = build_model(config, device=device, ep_group=group if config.kind == "moe" else None)
    policy = None
    if args.split_policy == "auto":
        policy = calibrated_policy(
            model, sizes=args.calibrate_tokens, num_ubatches=args.num_ubatches, seed=rank
        )  # EP ranks route tokens of their own, as in the bench
        logger.info("split policy calibrated: %s", policy.costs)
    blocks = args.prompts_per_rank * math.ceil((args.prompt_len + args.max_new_tokens) / args.block_size)
    runner = ModelRunner(
        model,
        config,
        device=device,
        num_kv_blocks=blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_ubatches=args.num_ubatches,
        dp_group=group,
        timeout_s=args.timeout,
        split_policy=policy,
    )
    prompts = random_prompts(args, config, rank)
    runner.generate(prompts, args.max_new_tokens)  # untimed: the timed run meets no shape for the first time
    cpu_group = dp_cpu_group(group, timeout_s=args.timeout) if group is not None else None
    if cpu_group is not None:
        dist.barrier(group=cpu_group)
    start = time.perf_counter()
    outputs = runner.generate(prompts, args.max_new_tokens)
    elapsed = time.perf_counter() - start
    totals = torch.tensor([sum(len(o) for o in outputs), len(prompts)], dtype=torch.float64)
    if cpu_group is not None:
        dist.all_reduce(totals, group=cpu_group)
    if rank == 0:
        tokens, requests = int(totals[0]), int(totals[1])
        print(
            f"{preset} on {world} x {device.type}, "
            f"num_ubatches={args.num_ubatches}, split policy {args.split_policy}: "
            f"{requests} requests, {tokens} tokens in {elapsed:.2f} s = "
            f"{tokens / elapsed:.1f} tokens/s"
        )
    if cpu_group is not None:
        dist.barrier(group=cpu_group)  # tear down in step: gloo aborts a rank whose peer left mid-teardown


if __name__ == "__main__":
    main()
