"""Probe: can a CUDA graph move a number of bytes the GPU decides, on the copy engines?

Under a graph every collective's size is fixed at capture, so a dispatch sends its capacity's
padding and a dispatch cut by expert group pads each group (docs/overlap-modes.md). CUDA's
conditional graph nodes run a body only where a device value says so, and their bodies may hold
memory copies. This captures a round trip through pinned host memory (device -> host -> device,
the link stand-in's path) cut into ``--chunks`` pieces, each piece's copies inside an IF node on
``count > piece``, replays it with every count from 0 to ``--chunks``, and prints per count the
replay time and whether exactly the first ``count`` pieces arrived. ``same``: each piece's two
copies in one body on one stream; ``two_streams``: the device-to-host bodies on the capture
stream and each host-to-device body on a side stream after its piece's event, so the two
engines overlap as the stand-in's do.

``python scripts/probe_conditional_copy.py --mib 64 --chunks 8`` (one GPU). One JSON line per
(variant, count); a variant that cannot be captured or replayed prints its error instead.
"""

from __future__ import annotations

import argparse
import json

import torch

from ubatch.bench.measure import median_ms


def build(variant: str, src: torch.Tensor, host: torch.Tensor, dst: torch.Tensor, count: torch.Tensor, chunks: int):
    """The captured graph (see the module docstring) and the predicate tensors it reads."""
    piece = src.numel() // chunks
    predicates = [torch.zeros((), dtype=torch.bool, device=src.device) for _ in range(chunks)]
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capture = torch.cuda.current_stream()
        for j, predicate in enumerate(predicates):
            torch.gt(count, j, out=predicate)
        staged = []
        for j, predicate in enumerate(predicates):
            part = slice(j * piece, (j + 1) * piece)
            graph.begin_capture_to_if_node(predicate)
            host[part].copy_(src[part], non_blocking=True)
            if variant == "same":
                dst[part].copy_(host[part], non_blocking=True)
            graph.end_capture_to_conditional_node()
            if variant == "two_streams":
                event = torch.cuda.Event()
                event.record(capture)
                staged.append(event)
        if variant == "two_streams":
            side.wait_stream(capture)
            with torch.cuda.stream(side):
                for j, (predicate, event) in enumerate(zip(predicates, staged)):
                    side.wait_event(event)
                    part = slice(j * piece, (j + 1) * piece)
                    graph.begin_capture_to_if_node(predicate)
                    dst[part].copy_(host[part], non_blocking=True)
                    graph.end_capture_to_conditional_node()
            capture.wait_stream(side)
    return graph, predicates


def probe(variant: str, mib: int, chunks: int) -> None:
    nbytes = (mib << 20) // chunks * chunks
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    count = torch.zeros((), dtype=torch.int64, device="cuda")
    try:
        graph, _ = build(variant, src, host, dst, count, chunks)
    except Exception as error:  # the probe's answer is whether this works at all
        print(json.dumps({"variant": variant, "capture_error": f"{type(error).__name__}: {error}"}))
        return
    piece = nbytes // chunks
    for n in range(chunks + 1):
        count.fill_(n)
        dst.zero_()
        try:
            ms = median_ms(graph.replay, src.device, warmup=2, repeats=11)
        except Exception as error:
            print(json.dumps({"variant": variant, "count": n, "replay_error": f"{type(error).__name__}: {error}"}))
            return
        dst.zero_()
        graph.replay()
        torch.cuda.synchronize()
        arrived = bool(torch.equal(dst[: n * piece], src[: n * piece]))
        untouched = bool((dst[n * piece :] == 0).all())
        gbps = n * piece / (ms / 1e3) / 1e9 if n else 0.0
        print(
            json.dumps(
                {
                    "variant": variant,
                    "count": n,
                    "bytes": n * piece,
                    "ms": round(ms, 4),
                    "gbps": round(gbps, 1),
                    "arrived": arrived,
                    "rest_untouched": untouched,
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="the largest payload, MiB")
    parser.add_argument("--chunks", type=int, default=8, help="pieces, each behind its own IF node")
    parser.add_argument("--variants", default="same,two_streams")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this probe needs a CUDA GPU")
    if args.mib < 1 or args.chunks < 1:
        raise SystemExit(f"--mib and --chunks must be positive, got {args.mib} and {args.chunks}")
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}))
    for variant in args.variants.split(","):
        if variant not in ("same", "two_streams"):
            raise SystemExit(f"unknown variant {variant!r}: same or two_streams")
        probe(variant, args.mib, args.chunks)


if __name__ == "__main__":
    main()
