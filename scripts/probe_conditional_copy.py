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
engines overlap as the stand-in's do. Each with host memory from torch's pinned pool and
registered by hand (``host_buffer``).

``python scripts/probe_conditional_copy.py --mib 64 --chunks 8`` (one GPU). One JSON line per
(variant, host memory, count); a variant that cannot be captured or replayed prints its error instead.
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
            with torch.cuda.stream(side):  # joins the capture at its first wait
                for j, (predicate, event) in enumerate(zip(predicates, staged)):
                    side.wait_event(event)
                    part = slice(j * piece, (j + 1) * piece)
                    graph.begin_capture_to_if_node(predicate)
                    dst[part].copy_(host[part], non_blocking=True)
                    graph.end_capture_to_conditional_node()
            capture.wait_stream(side)
    return graph, predicates


def host_buffer(kind: str, nbytes: int) -> torch.Tensor:
    """Page-locked host memory: from torch's pinned pool (``pool``, what the link stand-in uses), or
    a plain tensor registered with CUDA (``registered``). A copy into the pool's memory records an
    event for the pool, and a conditional node's body may hold copies but no event records, so the
    registered kind is the one a body can take if the pool's cannot."""
    if kind == "pool":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host = torch.empty(nbytes, dtype=torch.uint8)
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0))
    return host


def probe(variant: str, host_kind: str, mib: int, chunks: int) -> None:
    nbytes = (mib << 20) // chunks * chunks
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = host_buffer(host_kind, nbytes)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    count = torch.zeros((), dtype=torch.int64, device="cuda")
    try:
        graph, _ = build(variant, src, host, dst, count, chunks)
    except Exception as error:  # the probe's answer is whether this works at all
        print(json.dumps({"variant": variant, "host": host_kind, "capture_error": f"{type(error).__name__}: {error}"}))
        return
    piece = nbytes // chunks
    for n in range(chunks + 1):
        count.fill_(n)
        dst.zero_()
        try:
            ms = median_ms(graph.replay, src.device, warmup=2, repeats=11)
        except Exception as error:
            failed = {"variant": variant, "host": host_kind, "count": n}
            print(json.dumps(failed | {"replay_error": f"{type(error).__name__}: {error}"}))
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
                    "host": host_kind,
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
    parser.add_argument("--hosts", default="registered,pool", help="host memory kinds (see host_buffer)")
    args = parser.parse_args()
    variants, hosts = args.variants.split(","), args.hosts.split(",")
    if args.mib < 1 or args.chunks < 1:
        parser.error(f"--mib and --chunks must be positive, got {args.mib} and {args.chunks}")
    if unknown := [v for v in variants if v not in ("same", "two_streams")]:
        parser.error(f"unknown variants {unknown}: same or two_streams")
    if unknown := [h for h in hosts if h not in ("registered", "pool")]:
        parser.error(f"unknown host memory kinds {unknown}: registered or pool")
    if not torch.cuda.is_available():
        parser.error("this probe needs a CUDA GPU")
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}))
    for variant in variants:
        for host in hosts:
            probe(variant, host, args.mib, args.chunks)


if __name__ == "__main__":
    main()
