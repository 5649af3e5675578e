"""A vLLM-style serving loop: requests arrive over time, the runner schedules a step at a time,
and a split policy calibrated on the model decides per step whether to split it (or, with
``--modes``, a policy calibrated over those overlap modes picks one per step).

    torchrun --nproc-per-node 2 examples/runner_loop.py     # DP=2 over gloo, experts parallel over both
    python examples/runner_loop.py                           # one process
    torchrun --nproc-per-node 2 examples/runner_loop.py --modes pipeline2,split2+join

Each data-parallel rank serves requests of its own; the experts of the MoE model are spread over
all ranks, so every step runs all-to-alls, and ranks that have nothing to do still step (padding)
so the collectives match. The ranks vote every step: all split or none. Each rank checks its
outputs against greedy decoding of the same model unsplit, request by request, and prints how
many steps were split.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter

import torch
import torch.distributed as dist

from ubatch.bench.calibration import calibrated_mode_policy, calibrated_policy
from ubatch.models import ModelConfig, build_model
from ubatch.runner import ModelRunner

MAX_NEW_TOKENS = 6


def init_process_group() -> dist.ProcessGroup | None:
    """gloo under torchrun; None (no data parallelism) in a plain ``python`` run."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    dist.init_process_group("gloo")
    return dist.group.WORLD


def make_runner(model, config, group, policy=None, mode_policy=None) -> ModelRunner:
    """A split policy (or none: every step that can split does) or, given ``mode_policy``, an
    overlap mode picked per step."""
    how = dict(overlap_mode=mode_policy) if mode_policy else dict(num_ubatches=2, split_policy=policy)
    return ModelRunner(
        model, config, device="cpu", num_kv_blocks=64, block_size=16, max_num_batched_tokens=256, dp_group=group, **how
    )


def serve(runner: ModelRunner, arrivals: dict[int, list[list[int]]]) -> tuple[dict[int, list[int]], int, int, Counter]:
    """Step until every request is done, adding each request at its arrival step; (outputs by
    request id, steps, split steps, steps per overlap mode). Every rank steps as long as any
    rank has work."""
    outputs: dict[int, list[int]] = {}
    step = split = 0
    modes: Counter = Counter()
    while True:
        for prompt in arrivals.get(step, []):
            runner.add_request(prompt, MAX_NEW_TOKENS)
        busy = torch.tensor([float(runner.has_unfinished_requests() or step < max(arrivals))])
        if dist.is_initialized():
            dist.all_reduce(busy)
        if not busy.item():
            return outputs, step, split, modes
        out = runner.step()
        split += out.num_ubatches > 1
        modes[out.overlap_mode] += 1
        for request_id, tokens in out.finished.items():
            outputs[request_id] = tokens
        step += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", help="overlap modes to calibrate a per-step policy over, comma-separated")
    args = parser.parse_args()
    group = init_process_group()
    rank = dist.get_rank() if group is not None else 0
    config = ModelConfig.preset("tiny-moe")
    model = build_model(config, device="cpu", ep_group=group)
    policy = mode_policy = None
    if args.modes:  # every rank, same sizes; each mode's time is the slowest rank's, so they pick alike
        mode_policy = calibrated_mode_policy(model, args.modes, sizes=(8, 64), seed=rank, repeats=3, group=group)
    else:
        policy = calibrated_policy(model, sizes=(64, 256), seed=rank, repeats=3)  # every rank, same sizes
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=g).tolist() for n in (40, 9, 120, 3, 64)]
    arrivals = {0: prompts[:2], 2: prompts[2:4], 5: prompts[4:]}
    outputs, steps, split, modes = serve(make_runner(model, config, group, policy, mode_policy), arrivals)
    expected = make_runner(model, config, group).generate(prompts, MAX_NEW_TOKENS)
    got = [outputs[i] for i in sorted(outputs)]
    served = f"steps per mode {dict(sorted(modes.items()))}" if mode_policy else f"{split} split by the policy"
    print(
        f"rank {rank}: {len(got)} requests, {steps} steps, {served}; equals unsplit greedy decoding: {got == expected}",
        flush=True,
    )
    if group is not None:
        dist.destroy_process_group()
    if got != expected:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
