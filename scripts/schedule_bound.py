"""The best step time ubatching can reach for a MoE step, from its compute and communication.

A list-scheduling model of how the executor runs N ubatches: per layer, each ubatch computes its
attention block (``A``), dispatches (``D``), computes its experts (``E``) and combines (``C``),
each collective after the compute that feeds it and before the compute that reads it. Compute
runs on one lane in the order the host issues it (round-robin over ubatches, as the scheduler
does), collectives run on one comm lane in the same order. Costs scale linearly with the ubatch's
share of tokens and nothing slows down when overlapped, so the result is a bound: what is left
between it and a measured step is overlap slowdown, fill and drain the model misses, and noise.
``--comm-stretch`` puts the measured overlap slowdown back (a report's ``comm_stretch``): split
collectives take that much longer, while the unsplit step and the ideal keep the plain M.

Example (the 4096-token slow-link prefill of benchmarks/h200x2):
``python scripts/schedule_bound.py --compute-ms 71 --comm-ms 126 --layers 8 --attention-share 0.2``
"""

from __future__ import annotations

import argparse


def step_ms(num_ubatches: int, layers: int, compute_ms: float, comm_ms: float, attention_share: float,
            comm_stretch: float = 1.0) -> float:
    """Makespan of one step in ``num_ubatches`` ubatches under the model above; with more than one
    ubatch each collective takes ``comm_stretch`` times its share of ``comm_ms``."""
    attention = compute_ms * attention_share / layers / num_ubatches
    experts = compute_ms * (1 - attention_share) / layers / num_ubatches
    stretch = comm_stretch if num_ubatches > 1 else 1.0
    collective = stretch * comm_ms / 2 / layers / num_ubatches  # dispatch and combine carry the same rows
    compute_free = comm_free = 0.0
    ready = [0.0] * num_ubatches  # when each ubatch's last collective delivered its result
    for _ in range(layers):
        for work in (attention, experts):
            for u in range(num_ubatches):
                compute_free = max(compute_free, ready[u]) + work
                comm_free = max(comm_free, compute_free) + collective
                ready[u] = comm_free
    return max(compute_free, *ready)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compute-ms", type=float, required=True, help="C: the unsplit step's compute")
    p.add_argument("--comm-ms", type=float, required=True, help="M: the unsplit step's communication")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--attention-share", type=float, default=0.2,
                   help="share of compute before the dispatch (attention, norms, router)")
    p.add_argument("--comm-stretch", type=float, default=1.0,
                   help="how much slower the split collectives run (a report's comm_stretch)")
    p.add_argument("--num-ubatches", default="1,2,3,4")
    args = p.parse_args()
    if not 0 <= args.attention_share < 1:
        p.error(f"--attention-share must be in [0, 1), got {args.attention_share}")
    if args.comm_stretch <= 0:
        p.error(f"--comm-stretch must be positive, got {args.comm_stretch}")
    unsplit = args.compute_ms + args.comm_ms
    ideal = unsplit / max(args.compute_ms, args.comm_ms)
    for n in map(int, args.num_ubatches.split(",")):
        t = step_ms(n, args.layers, args.compute_ms, args.comm_ms, args.attention_share, args.comm_stretch)
        speedup = unsplit / t
        efficiency = (speedup - 1) / (ideal - 1) if ideal > 1 else float("nan")
        print(f"N={n}: {t:.1f} ms, speedup {speedup:.3f}x of ideal {ideal:.3f}x, efficiency {efficiency:.2f}")


if __name__ == "__main__":
    main()
