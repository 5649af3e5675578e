"""ubatch-bench over the link stand-in at the bandwidth that makes the step's communication a given
share of its compute (M / C), so a sweep lands in a named regime ("communication 90% of compute")
instead of at a guessed bandwidth. A short probe of the unsplit step at --probe-gbps measures C and
M; taking M as 1 / bandwidth gives a second bandwidth, and where the probe missed the asked ratio
by more than ``RATIO_TOLERANCE`` a second probe there measures again. M is then fitted through the
two as a fixed part (the copies' own latency, which no bandwidth removes) plus bytes / bandwidth,
and the sweep runs at the bandwidth that fit gives (the copy engines' own speed where that is
faster than they go, or where the fixed part alone exceeds the asked share). The sweep's report
carries the probes under ``setup.link_ratio``, and the ratio its own C and M reached
(``reached``; said when it misses the asked one by more than ``RATIO_TOLERANCE``). With
``--capacity-factor measured`` the probe's unsplit step and the sweep's send the same payload:
each call shape takes the factor its own routing asked for (``ubatch.models.capacity``). Before
that, the sweep's unsplit step took its splits' larger factor, and runs 16 and 17 reached M / C
0.98-1.10 where the probes measured 0.88-0.94.

    python scripts/sweep_at_ratio.py --ratio 0.9 --world 8 --out report.json -- \\
        --graphs --workload decode --tokens 256 --preset moe-bench --modes split2,split2+join
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ubatch.bench.outputs import check_outputs  # noqa: E402

PROBE_REPEATS = 3
COPY_ENGINE_SHARE = 0.9  # above this share of the copy engines' speed the pacing has no room left
RATIO_TOLERANCE = 0.05  # a probe this close (relative) to the asked M / C sets the link as it ran
MAX_PROBES = 2
PROXY_MAX_GBPS = 1000.0  # a proxy link has no copy engine to cap it: the fastest it is set to


class Probe(NamedTuple):
    """One short run of the unsplit step: the link's bandwidth and the step's C and M."""

    gbps: float
    compute_ms: float
    comm_ms: float


def bench(flags: list[str], out: Path) -> dict:
    """One ubatch-bench run in its own process (graphs and streams start fresh), its report."""
    result = subprocess.run([sys.executable, "-m", "ubatch.bench", *flags, "--out", str(out)], text=True)
    if result.returncode:
        raise SystemExit(f"ubatch-bench {' '.join(flags)} failed with exit code {result.returncode}")
    return json.loads(out.read_text())


def probe_flags(flags: list[str], link: str) -> list[str]:
    """The sweep's flags for a short run of the unsplit step alone over ``link``."""
    if "--modes" not in flags:
        raise SystemExit("give the sweep's --modes: the probe times the unsplit step of a --modes run")
    probe = list(flags)
    probe[probe.index("--modes") + 1] = "overlap"  # every --modes run times unsplit first
    return [*probe, "--repeats", str(PROBE_REPEATS), "--link", link]


def link_for_ratio(ratio: float, probes: list[Probe], copy_gbps: float | None, kind: str = "host") -> str:
    """The bandwidth that makes M ``ratio`` times the last probe's C, as a --link value of ``kind``
    (host or proxy) without the world size; for a host link "" (the copy engines' speed) where that
    is as fast as they go or no bandwidth reaches it, for a proxy link ``PROXY_MAX_GBPS`` there.
    M is bytes / bandwidth from one probe, and fixed part + bytes / bandwidth through the last two
    (back to the first model where their M does not fall with bandwidth: noise)."""
    last = probes[-1]
    latency, transfer = 0.0, last.comm_ms * last.gbps  # ms, and ms * GB/s (the bytes)
    if len(probes) > 1 and probes[-2].gbps != last.gbps:
        before = probes[-2]
        slope = (before.comm_ms - last.comm_ms) / (1 / before.gbps - 1 / last.gbps)
        if slope > 0:
            latency, transfer = last.comm_ms - slope / last.gbps, slope
    fastest = f"proxy:{PROXY_MAX_GBPS:g}" if kind == "proxy" else "host:"
    wanted = ratio * last.compute_ms - latency
    if wanted <= 0:
        return fastest
    gbps = transfer / wanted
    if kind == "host" and copy_gbps is not None and gbps >= COPY_ENGINE_SHARE * copy_gbps:
        return fastest
    return f"{kind}:{min(gbps, PROXY_MAX_GBPS) if kind == 'proxy' else gbps:.3g}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ratio", type=float, required=True, help="M / C to aim at, e.g. 0.9")
    p.add_argument("--world", type=int, default=2, help="the stand-in's world size W (default 2)")
    p.add_argument(
        "--kind",
        choices=("host", "proxy"),
        default="host",
        help="the stand-in: host (copy engines, ubatch.link) or proxy (a paced host thread, ubatch.proxy_link)",
    )
    p.add_argument("--probe-gbps", type=float, default=10.0, help="bandwidth of the probe run")
    p.add_argument("--out", type=Path, required=True, help="the sweep's report")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the sweep's ubatch-bench flags, with --modes")
    args = p.parse_args(argv)
    check_outputs(p, files={"--out": args.out})
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if not args.ratio > 0 or not args.probe_gbps > 0 or args.world < 1:
        p.error("--ratio and --probe-gbps must be > 0 and --world >= 1")
    if "--link" in flags:
        p.error("the script sets --link; give --world and --ratio instead")
    probes: list[Probe] = []
    gbps = args.probe_gbps
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(MAX_PROBES):
            report = bench(probe_flags(flags, f"{args.kind}:{gbps:g}:w{args.world}"), Path(tmp) / f"probe{n}.json")
            unsplit = next(row for row in report["results"] if row["mode"] == "unsplit")
            c, m = unsplit["compute_ms"], unsplit["comm_ms"]
            probes.append(Probe(gbps, c, m))
            copy_gbps = report["setup"].get("link", {}).get("copy_engine_gbps")
            print(f"probe at {gbps:g} GB/s: C {c:.3f} ms, M {m:.3f} ms, M / C {m / c:.2f}")
            if abs(m / c / args.ratio - 1) <= RATIO_TOLERANCE:
                link = f"{args.kind}:{gbps:g}"
                break
            link = link_for_ratio(args.ratio, probes, copy_gbps, args.kind)
            if link == "host:":
                break
            gbps = float(link.split(":")[1])
    link = f"{link}:w{args.world}"
    print(f"M / C {args.ratio:g} asks --link {link}")
    report = bench([*flags, "--link", link], args.out)
    unsplit = next(row for row in report["results"] if row["mode"] == "unsplit")
    reached = unsplit["comm_ms"] / unsplit["compute_ms"]
    report["setup"]["link_ratio"] = {
        "asked": args.ratio,
        "probes": [probe._asdict() for probe in probes],
        "link": link,
        "reached": round(reached, 4),
    }
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(
        f"the sweep reached M / C {reached:.2f} (asked {args.ratio:g}){miss_reason(args.ratio, reached, link)}"
        + flag_lag_note(report["setup"].get("link", {}))
    )


def flag_lag_note(link: dict) -> str:
    """For a proxy-paced link, how late the GPU took its completion flags back (a waiting warp that
    waited for an SM stretched those transfers past the link's time); "" for any other link."""
    lag = link.get("flag_lag_us")
    if not lag:
        return ""
    return f"; the GPU took the link's flags back {lag['mean']:g} us late on average, {lag['max']:g} at most"


def miss_reason(asked: float, reached: float, link: str) -> str:
    """Why the sweep's M / C missed the asked one by more than ``RATIO_TOLERANCE`` ("" where it did
    not): above it at the copy engines' own speed (``link`` ``host::wW``), the stand-in has no faster
    setting; otherwise the link ran otherwise in the sweep's process than in the probe's."""
    if abs(reached / asked - 1) <= RATIO_TOLERANCE:
        return ""
    if reached > asked and link.split(":")[1] == "":
        return (
            ": at the copy engines' full speed, the stand-in's fastest, this step's transfers still take "
            "longer; a smaller --world sends fewer rows"
        )
    return ": the link ran otherwise in the sweep's process than in the probe's"


if __name__ == "__main__":
    main()
