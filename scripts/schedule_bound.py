"""The best step time ubatching can reach for a MoE step, from its compute and communication.

The model is ``ubatch.bench.schedule`` (every ubatch-bench row carries it as
``schedule_model_ms`` / ``schedule_model_stretched_ms``); this prints it for any C and M.
``--comm-stretch`` puts the measured overlap slowdown back (a report's ``comm_stretch``): split
collectives (with ``--join``, any cut into ubatches or expert groups) take that much longer,
while the unsplit step and the ideal keep the plain M.

Example (the 4096-token slow-link prefill of benchmarks/h200x2):
``python scripts/schedule_bound.py --compute-ms 71 --comm-ms 126 --layers 8 --attention-share 0.2``

``--join`` models split steps whose ubatches share one expert stage per expert group
(``splitN+join+pipelineK``, ``ubatch.bench.schedule.joined_step_ms``), ``--expert-chunks``
the groups and ``--group-cost-ms`` what each further group adds per layer. Example (the
256-token decode over the link stand-in, benchmarks/RESULTS.md): ``python
scripts/schedule_bound.py --compute-ms 4.15 --comm-ms 3.53 --layers 4 --attention-share 0.51
--join --expert-chunks 1,2,4``

With ``--routing EXPERTS:TOP_K:WORLD`` each expert group's chunk carries what a uniform router
sends it (a row travels with its earliest group on the rank and returns with its latest), not an
equal share: e.g. ``--routing 64:8:8`` for deepseek-bench as one rank of eight.

``--token-chunks`` cuts each ubatch's expert stage into chunks of tokens (``tokensK``,
``splitN+tokensK``), one dispatch and combine each. Example (moe-bench's 4096-token prefill as one
rank of eight, run 18): ``python scripts/schedule_bound.py --compute-ms 22.53 --comm-ms 20.63
--layers 4 --num-ubatches 1,2 --token-chunks 1,2,4``

``--split-tax`` multiplies a split's (or token chunks') compute by its measured tax, the weights
each ubatch reads again: e.g. run 25's deepseek-bench prefill as one rank of four, ``python
scripts/schedule_bound.py --compute-ms 16.76 --comm-ms 19.0 --layers 4 --attention-share 0.26
--split-tax 1.16`` (its ``split4`` measured 21.8 ms).

``--local-share`` lets that share of each ubatch's expert work start before its dispatch lands
(own rows first, ``+local``; 0.5 with two ranks). Example (moe-bench's 4096-token prefill over
the link stand-in): ``python scripts/schedule_bound.py --compute-ms 26.07 --comm-ms 20.87
--layers 4 --attention-share 0.2 --num-ubatches 2 --local-share 0.5``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ubatch.bench.schedule import DEFAULT_ATTENTION_SHARE, ideal_speedup, joined_step_ms, step_ms  # noqa: E402
from ubatch.models.dispatch import balanced_chunk_rows  # noqa: E402


def routing_shares(routing: str, chunks: int) -> list[float]:
    """Each of ``chunks`` expert groups' share of the dispatched rows under a uniform router, for
    ``routing`` = ``EXPERTS:TOP_K:WORLD``; ValueError naming the problem otherwise."""
    try:
        experts, top_k, world = (int(part) for part in routing.split(":"))
    except ValueError:
        raise ValueError(f"--routing {routing!r}: expected EXPERTS:TOP_K:WORLD, e.g. 64:8:8") from None
    if not (experts >= 1 and 1 <= top_k <= experts and world >= 1 and experts % (world * chunks) == 0):
        raise ValueError(
            f"--routing {routing!r} with {chunks} expert groups: need 1 <= TOP_K <= EXPERTS and "
            f"EXPERTS divisible by WORLD * groups"
        )
    rows = balanced_chunk_rows(1, experts, top_k, world, chunks)
    return [r / sum(rows) for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compute-ms", type=float, required=True, help="C: the unsplit step's compute")
    p.add_argument("--comm-ms", type=float, required=True, help="M: the unsplit step's communication")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument(
        "--attention-share",
        type=float,
        default=DEFAULT_ATTENTION_SHARE,
        help="share of compute before the dispatch (attention, norms, router)",
    )
    p.add_argument(
        "--comm-stretch",
        type=float,
        default=1.0,
        help="how much slower the split (or, with --join, cut) collectives run (a report's comm_stretch)",
    )
    p.add_argument(
        "--split-tax",
        type=float,
        default=1.0,
        help="how much more a plain split (or token chunks) computes than the unsplit step, its weights read again "
        "(a profiled step's compute ratio, or 1 + a report's reread_ms / C)",
    )
    p.add_argument("--num-ubatches", default="1,2,3,4")
    p.add_argument(
        "--local-share",
        type=float,
        default=0.0,
        help="share of each ubatch's expert work that starts before its dispatch lands (own rows first: 1/W)",
    )
    p.add_argument("--token-chunks", default="1", help="chunks of each ubatch's tokens through the experts")
    p.add_argument("--join", action="store_true", help="ubatches share one expert stage per expert group")
    p.add_argument("--expert-chunks", default="1", help="with --join: expert groups, comma-separated")
    p.add_argument("--group-cost-ms", type=float, default=0.0, help="with --join: per layer, per further group")
    p.add_argument("--ubatch-cost-ms", type=float, default=0.0, help="with --join: per layer, per ubatch of a split")
    p.add_argument(
        "--routing",
        help="with --join: EXPERTS:TOP_K:WORLD, each group's chunk a uniform router's rows (default: equal chunks)",
    )
    args = p.parse_args()
    if not 0 <= args.attention_share < 1:
        p.error(f"--attention-share must be in [0, 1), got {args.attention_share}")
    if not 0 <= args.local_share <= 1:
        p.error(f"--local-share must be in [0, 1], got {args.local_share}")
    if args.join and args.local_share:
        p.error("--local-share models plain splits; the joined model has no own-rows stage")
    if args.join and args.token_chunks != "1":
        p.error("--token-chunks models plain splits; joined expert stages take whole ubatches")
    if not args.join:
        joined_only = {
            "--expert-chunks": args.expert_chunks != "1",
            "--group-cost-ms": args.group_cost_ms != 0,
            "--ubatch-cost-ms": args.ubatch_cost_ms != 0,
            "--routing": args.routing is not None,
        }
        given = [name for name, set_ in joined_only.items() if set_]
        if given:
            p.error(f"{', '.join(given)} model joined expert stages: add --join")
    if args.comm_stretch <= 0:
        p.error(f"--comm-stretch must be positive, got {args.comm_stretch}")
    if args.split_tax < 1:
        p.error(f"--split-tax must be >= 1 (a split computes at least the unsplit step), got {args.split_tax}")
    if args.join and args.split_tax != 1:
        p.error("--split-tax models plain splits; joined stages read each expert's weights once (--ubatch-cost-ms)")
    unsplit = args.compute_ms + args.comm_ms
    ideal = ideal_speedup(args.compute_ms, args.comm_ms)

    def report(label: str, t: float) -> None:
        speedup = unsplit / t
        efficiency = (speedup - 1) / (ideal - 1) if ideal > 1 else float("nan")
        print(f"{label}: {t:.2f} ms, speedup {speedup:.3f}x of ideal {ideal:.3f}x, efficiency {efficiency:.2f}")

    for n in map(int, args.num_ubatches.split(",")):
        if not args.join:
            for chunks in map(int, args.token_chunks.split(",")):
                t = step_ms(
                    n,
                    args.layers,
                    args.compute_ms * (args.split_tax if n > 1 or chunks > 1 else 1.0),
                    args.comm_ms,
                    args.attention_share,
                    args.comm_stretch,
                    args.local_share,
                    token_chunks=chunks,
                )
                label = f"N={n}" + (f", {chunks} token chunks" if chunks > 1 else "")
                label += f", tax {args.split_tax:g}" if args.split_tax != 1 and (n > 1 or chunks > 1) else ""
                report(label + (f", own rows first ({args.local_share:g})" if args.local_share else ""), t)
            continue
        for k in map(int, args.expert_chunks.split(",")):
            try:
                shares = None if args.routing is None else routing_shares(args.routing, k)
            except ValueError as exc:
                p.error(str(exc))
            t = joined_step_ms(
                n,
                k,
                args.layers,
                args.compute_ms,
                args.comm_ms,
                args.attention_share,
                group_cost_ms=args.group_cost_ms,
                ubatch_cost_ms=args.ubatch_cost_ms,
                comm_stretch=args.comm_stretch,
                chunk_shares=shares,
            )
            report(f"N={n} joined, K={k}", t)


if __name__ == "__main__":
    main()
