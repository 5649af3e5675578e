"""What the host-link stand-in (``ubatch.link.HostLink``) reaches on one GPU: the bandwidth of its
round trip (bytes moved per second; each byte goes device -> pinned host -> device, so this is the
per-direction rate) for payloads of 1-256 MB, unthrottled and throttled, alone and beside a bf16
GEMM loop on another stream, and the GEMM loop's slowdown beside it. Every figure is the
stand-in's, not a network's. Runs in well under a minute on an H200.

    python scripts/link_bandwidth.py --out link_bandwidth.json

Method: each measurement is a loop of all-reduces over a 2-rank link (which moves exactly the
payload once), timed with CUDA events. The streams are held behind a sleep kernel while the host
enqueues the loop, so the figures are the device's, not the Python launch rate (a row says
``host_bound`` if the hold ran out first). Beside the GEMMs, the GEMM loop is sized to last as
long as the link loop; its slowdown is its span over the same number of GEMMs alone. A chunk-size
sweep at 64 MB shows where the pipelined copies saturate.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ubatch.bench.outputs import check_outputs  # noqa: E402
from ubatch.link import HostLink  # noqa: E402

MB = 1 << 20
TARGET_S = 0.02  # device time per measured loop
HOLD_CYCLES = 160_000_000  # the streams wait ~0.08 s (at ~2 GHz) while the host enqueues a loop
MAX_REPEATS = 200


class Bench:
    """The streams, the GEMM operands and the hold that every measurement shares."""

    def __init__(self, device: torch.device, gemm_size: int, trials: int) -> None:
        self.device = device
        self.trials = trials
        self.link_stream = torch.cuda.Stream(device)
        self.gemm_stream = torch.cuda.Stream(device)
        self.hold_stream = torch.cuda.Stream(device)
        self.a = torch.randn(gemm_size, gemm_size, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(gemm_size, gemm_size, device=device, dtype=torch.bfloat16)
        self.gemm_flops = 2 * gemm_size**3
        self.gemm_s = self._gemm_alone()

    def _hold(self) -> torch.cuda.Event:
        released = torch.cuda.Event()
        with torch.cuda.stream(self.hold_stream):
            torch.cuda._sleep(HOLD_CYCLES)
            released.record()
        return released

    def _timed(self, link: HostLink | None, payload: torch.Tensor | None, repeats: int, gemms: int) -> dict:
        """One run: ``repeats`` all-reduces on the link stream and ``gemms`` GEMMs on the GEMM
        stream, released together; the seconds each loop spanned."""
        released = self._hold()
        spans, events = {}, []
        for name, stream, count in (("link", self.link_stream, repeats), ("gemm", self.gemm_stream, gemms)):
            if not count:
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream.wait_event(released)
            with torch.cuda.stream(stream):
                start.record()
                for _ in range(count):
                    if name == "link":
                        link.all_reduce(payload)
                    else:
                        torch.mm(self.a, self.b)
                end.record()
            events.append((name, start, end))
        host_bound = released.query()
        torch.cuda.synchronize(self.device)
        for name, start, end in events:
            spans[name] = start.elapsed_time(end) / 1e3
        spans["host_bound"] = host_bound
        return spans

    def _gemm_alone(self) -> float:
        with torch.cuda.stream(self.gemm_stream):  # the stream's cuBLAS workspace, before timing
            torch.mm(self.a, self.b)
        count = 20
        return statistics.median([self._timed(None, None, 0, count)["gemm"] / count for _ in range(self.trials)])

    def link_row(self, link: HostLink, nbytes: int) -> dict[str, Any]:
        payload = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        info = link.describe()
        expected_gbps = min(x for x in (info["bandwidth_set_gbps"], info["copy_engine_gbps"]) if x)
        repeats = max(2, min(MAX_REPEATS, math.ceil(TARGET_S / (nbytes / (expected_gbps * 1e9)))))
        link.all_reduce(payload)  # warm this size
        alone = [self._timed(link, payload, repeats, 0) for _ in range(self.trials)]
        alone_s = statistics.median(r["link"] for r in alone)
        gemms = max(1, round(alone_s / self.gemm_s))
        beside = [self._timed(link, payload, repeats, gemms) for _ in range(self.trials)]
        beside_s = statistics.median(r["link"] for r in beside)
        gemm_s = statistics.median(r["gemm"] for r in beside)
        moved = nbytes * repeats
        return {
            "bandwidth_set_gbps": info["bandwidth_set_gbps"],
            "payload_mb": nbytes / MB,
            "repeats": repeats,
            "alone_gbps": moved / alone_s / 1e9,
            "beside_gemm_gbps": moved / beside_s / 1e9,
            "gemms": gemms,
            "gemm_slowdown": gemm_s / (gemms * self.gemm_s),
            "host_bound": any(r["host_bound"] for r in alone + beside),
        }


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'set GB/s':>9} {'MB':>6} {'alone GB/s':>11} {'w/ GEMM GB/s':>13} {'GEMM slowdown':>14}  note")
    for r in rows:
        set_gbps = "copy" if r["bandwidth_set_gbps"] is None else f"{r['bandwidth_set_gbps']:g}"
        note = "host-bound" if r["host_bound"] else ""
        if r["bandwidth_set_gbps"] is not None and r["payload_mb"] >= 16:
            error = r["alone_gbps"] / r["bandwidth_set_gbps"] - 1
            note = f"{note} {error:+.0%} vs set".strip()
        print(
            f"{set_gbps:>9} {r['payload_mb']:>6g} {r['alone_gbps']:>11.1f} {r['beside_gemm_gbps']:>13.1f} "
            f"{r['gemm_slowdown']:>13.3f}x  {note}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument(
        "--bandwidths",
        nargs="+",
        default=["copy", "25", "12.5"],
        help="GB/s to throttle to; 'copy' is unthrottled (as fast as the copy engines go)",
    )
    parser.add_argument(
        "--chunks-mb",
        type=float,
        nargs="*",
        default=[1, 2, 4, 8, 16],
        help="chunk sizes to sweep at 64 MB, unthrottled (none: skip the sweep)",
    )
    parser.add_argument("--gemm-size", type=int, default=8192, help="M = N = K of the bf16 GEMM loop")
    parser.add_argument("--trials", type=int, default=3, help="median of this many runs per figure")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    if not torch.cuda.is_available():
        print("link_bandwidth.py needs a CUDA GPU", file=sys.stderr)
        return 2
    bandwidths = [None if b == "copy" else float(b) for b in args.bandwidths]
    device = torch.device("cuda", torch.cuda.current_device())
    bench = Bench(device, args.gemm_size, args.trials)
    print(
        f"stand-in: host-staged link on {torch.cuda.get_device_name(device)}; bf16 GEMM {args.gemm_size}^3 "
        f"{bench.gemm_s * 1e3:.2f} ms ({bench.gemm_flops / bench.gemm_s / 1e12:.0f} TFLOP/s) alone"
    )

    rows, links = [], []
    for gbps in bandwidths:
        link = HostLink(2, gbps, device=device)
        link.prepare()
        links.append(link.describe())
        rows += [bench.link_row(link, int(mb * MB)) for mb in args.sizes_mb]
    _print_table(rows)

    sweep = []
    for chunk_mb in args.chunks_mb:
        link = HostLink(2, device=device, chunk_bytes=int(chunk_mb * MB))
        link.prepare()
        row = bench.link_row(link, 64 * MB)
        sweep.append({"chunk_mb": chunk_mb, **{k: row[k] for k in ("alone_gbps", "beside_gemm_gbps", "host_bound")}})
        print(
            f"chunk {chunk_mb:g} MB at 64 MB: {row['alone_gbps']:.1f} GB/s alone, "
            f"{row['beside_gemm_gbps']:.1f} beside the GEMMs"
        )

    result = {
        "what": "host-link stand-in (pinned host round trip on the copy engines), not a network",
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "gemm": {"size": args.gemm_size, "ms": bench.gemm_s * 1e3, "tflops": bench.gemm_flops / bench.gemm_s / 1e12},
        "links": links,
        "rows": rows,
        "chunk_sweep_64mb": sweep,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
