"""Which part of `ubatch-bench --quick --graphs` keeps the WORLD process group alive past
destroy_process_group (torchrun, 2 GPUs)? Mode argv[1]: graphs | graphs-noprof | eager.
Prints the group's refcount after the run and whether it survives destroy_process_group.

Result (pg_survivor_bisect.log): only the profiled run keeps it. The 10 extra references are the
default arguments of torch.distributed.nn.functional (group=group.WORLD), imported lazily by
torch.profiler; ubatch.teardown.import_before_init is the fix."""

import sys
import weakref

import torch.distributed as dist

import ubatch.bench.graphs as bench_graphs
from ubatch.bench.cli import parse_args
from ubatch.bench.sweep import run


def main(mode):
    if mode == "graphs-noprof":
        bench_graphs.profile_kernels = lambda fn, device, chrome_trace=None: []
    run(parse_args(["--quick", "--preset", "tiny-moe", *(["--graphs"] if mode.startswith("graphs") else [])]))
    rank = dist.get_rank()
    world = dist.group.WORLD
    print(f"{mode} rank {rank}: WORLD refcount after run {sys.getrefcount(world)}", flush=True)
    ref = weakref.ref(world)
    del world
    dist.destroy_process_group()
    print(f"{mode} rank {rank}: survives destroy: {ref() is not None}", flush=True)


main(sys.argv[1])
