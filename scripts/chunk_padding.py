"""How many rows a static dispatch sends when it is cut by expert group, against one capacity for
the whole call cut into runs, for a uniform router.

Under CUDA graphs every block a rank sends another has a fixed size. Cut by expert group, each
group's block (the rows whose earliest expert group on the destination is that one) is sized for
its own fullest case, and the small blocks of fine-grained experts vary most: at deepseek-bench's
256-token decode as one rank of eight the groups' capacities add up to 1.6-1.7x the mean rows,
where one capacity for the call needs 1.1x (run 23 measured 1.63x the rows). One capacity cut
into runs sends the call's padding only; a run's boundary then sits at the expected number of
rows of the groups before it plus ``z`` standard deviations, and this prints how often a group's
rows spill past its run (a spilled row's pairs would run with the next group).

Example: ``python scripts/chunk_padding.py --tokens 256 --experts 64 --top-k 8 --world 8 --groups 8``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ubatch.models.dispatch import balanced_chunk_rows  # noqa: E402
from ubatch.runner.checks import check_count  # noqa: E402

SAMPLE_BATCH = 100  # samples routed at once (tokens x experts random numbers each)


def group_rows(
    tokens: int, experts: int, top_k: int, world: int, groups: int, samples: int, seed: int = 0
) -> torch.Tensor:
    """Rows one rank sends one destination, per expert group (a row's group is its earliest one
    there), for ``samples`` batches of ``tokens`` routed uniformly: [samples, groups]."""
    for name, value in (
        ("tokens", tokens),
        ("top_k", top_k),
        ("world", world),
        ("groups", groups),
        ("samples", samples),
    ):
        check_count(name, value)
    if top_k > experts:
        raise ValueError(f"top_k={top_k} is more than the {experts} experts")
    if experts % (world * groups):
        raise ValueError(f"{experts} experts do not split into {world} ranks of {groups} groups")
    size = experts // (world * groups)
    generator = torch.Generator().manual_seed(seed)
    counts = []
    for start in range(0, samples, SAMPLE_BATCH):
        batch = min(SAMPLE_BATCH, samples - start)
        ids = torch.rand(batch, tokens, experts, generator=generator).topk(top_k, dim=2).indices
        # the destination is rank 0, whose experts are 0 .. experts / world - 1
        group = torch.where(ids < experts // world, ids // size, groups).amin(dim=2)
        counts.append(torch.nn.functional.one_hot(group, groups + 1)[..., :groups].sum(dim=1))
    return torch.cat(counts)


def padding(counts: torch.Tensor, quantile: float, z: float) -> dict[str, object]:
    """Rows sent per mean row: one capacity for the call (the ``quantile`` of a block's rows), the
    groups' own capacities (each group's ``quantile``) added up; the runs' ends as shares of the
    call's capacity, and per group how often its rows (with the earlier groups') pass its run's end."""
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must lie between 0 and 1, got {quantile}")
    counts = counts.double()
    total = counts.sum(dim=1)
    mean = float(total.mean())
    call = float(torch.quantile(total, quantile))
    own = torch.quantile(counts, quantile, dim=0)
    cumulative = counts.cumsum(dim=1)
    ends = torch.clamp(cumulative.mean(dim=0) + z * cumulative.std(dim=0), max=call)
    return {
        "mean_rows": mean,
        "call_capacity": call / mean,
        "group_capacities": [float(c) / float(m) for c, m in zip(own, counts.mean(dim=0))],
        "groups_sum": float(own.sum()) / mean,
        "run_ends": [float(e) / call for e in ends],
        "spill": [float(p) for p in (cumulative > ends).double().mean(dim=0)],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--world", type=int, default=8, help="expert-parallel ranks")
    p.add_argument("--groups", type=int, default=8, help="expert groups per rank")
    p.add_argument("--samples", type=int, default=2000, help="routed batches of one block")
    p.add_argument("--quantile", type=float, default=0.999, help="a capacity's share of blocks that fit")
    p.add_argument("--z", type=float, default=3.0, help="a run's end past its expected rows, in standard deviations")
    args = p.parse_args(argv)
    counts = group_rows(args.tokens, args.experts, args.top_k, args.world, args.groups, args.samples)
    report = padding(counts, args.quantile, args.z)
    expected = sum(balanced_chunk_rows(args.tokens, args.experts, args.top_k, args.world, args.groups))
    print(f"rows per block: {report['mean_rows']:.1f} sampled, {expected:.1f} expected")
    print(f"one capacity for the call: {report['call_capacity']:.2f}x the mean rows")
    groups = " / ".join(f"{c:.2f}" for c in report["group_capacities"])
    print(f"a capacity per expert group: {groups}x each group's mean, {report['groups_sum']:.2f}x in all")
    print("runs of the call's capacity end at " + " / ".join(f"{e:.2f}" for e in report["run_ends"]))
    print("a group's rows pass its run's end in " + " / ".join(f"{s:.2%}" for s in report["spill"]) + " of blocks")


if __name__ == "__main__":
    main()
