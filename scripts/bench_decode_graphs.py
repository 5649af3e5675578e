"""Decode step time: eager vs FULL CUDA graph vs FULL ubatched graph (N=2), one run.

    python scripts/bench_decode_graphs.py --out decode.json                        # one GPU
    torchrun --nproc-per-node 2 scripts/bench_decode_graphs.py --out decode.json   # EP over 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from ubatch.graphed import GraphedModel
from ubatch.bench.measure import median_ms
from ubatch.bench.workload import make_step
from ubatch.context import CUDAGraphMode
from ubatch.models import ModelConfig, build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="moe-bench")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sizes", default="64,128,256,512")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    if world > 1:
        dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD if world > 1 else None
    config = ModelConfig.preset(args.preset, num_layers=args.layers)
    model = build_model(config, device=device, ep_group=group if config.kind == "moe" else None)
    max_blocks = -(-(args.context_len + 1) // args.block_size)
    _, cache = make_step(model, [1] * max(sizes), [args.context_len] * max(sizes), block_size=args.block_size, seed=rank)
    graphed = GraphedModel(model, capture_sizes=sizes, max_blocks_per_req=max_blocks, ubatch_counts=(1, 2),
                           modes=(CUDAGraphMode.FULL,))
    graphed.capture()
    rows = []
    for size in sizes:
        step, _ = make_step(model, [1] * size, [args.context_len] * size, block_size=args.block_size,
                            cache=cache, seed=rank)
        md = step.attn_metadata[model.layer_names[0]]
        time = {}
        for name, fn in [
            ("eager_ms", lambda: graphed.eager(step.input_ids, step.positions, md)),
            ("full_ms", lambda: graphed.run(step.input_ids, step.positions, md)),
            ("full_ubatched_ms", lambda: graphed.run(step.input_ids, step.positions, md, num_ubatches=2)),
        ]:
            time[name] = round(median_ms(fn, device, warmup=3, repeats=args.repeats), 4)
        rows.append({"tokens_per_rank": size, "world_size": world, **time,
                     "ubatched_vs_full": round(time["full_ms"] / time["full_ubatched_ms"], 4)})
    if rank == 0:
        print(f"{'tokens':>6} {'eager ms':>9} {'FULL ms':>8} {'FULL N=2 ms':>11} {'N=2 speedup':>11}")
        for r in rows:
            print(f"{r['tokens_per_rank']:>6} {r['eager_ms']:>9.3f} {r['full_ms']:>8.3f} "
                  f"{r['full_ubatched_ms']:>11.3f} {r['ubatched_vs_full']:>11.3f}")
        if args.out:
            env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(device),
                   "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
            with open(args.out, "w") as f:
                json.dump({"environment": env, "args": vars(args), "results": rows}, f, indent=2)
    graphed.release()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
