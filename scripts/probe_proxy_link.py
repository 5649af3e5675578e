"""Can a host thread pace a link whose transfer sizes the GPU sets, with no SM and inside a CUDA graph?

The link stand-in (``ubatch.link``) paces each collective on the copy engines, so its time is the
size fixed when the graph was captured: a split's ubatches and an expert group's chunk pay for the
padding of their own fullest block (1.18-1.66x the rows measured). A NIC proxy does better: the GPU
rings a doorbell in pinned host memory with the bytes it really has, a host thread waits out the
link's time for those bytes and writes a completion flag, and the GPU's comm stream waits on that
flag. Both sides of that are stream memory operations (``cuStreamWriteValue32`` /
``cuStreamWaitValue32``): no kernel, no SM, and capturable. This probe checks, on the GPU machine:

1. the driver calls work on torch's streams, eagerly and captured in a CUDA graph replayed many times;
2. how late the host sees a doorbell and the GPU sees the completion (set delay against the
   elapsed time between CUDA events around the pair), with the thread in C (compiled here with the
   C compiler Triton also needs) and, for comparison, in Python;
3. a device-set size: a kernel writes a byte count, a 8-byte copy puts it in pinned memory before
   the doorbell, and the host waits ``bytes / bandwidth``, so replays of one graph with different
   counts take different times.

Prints one JSON line per measurement. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
import threading
import time

import torch

_PROXY_C = r"""
#include <stdint.h>
#include <time.h>
#include <pthread.h>

typedef struct {
    volatile uint32_t *doorbell;   /* the GPU writes 1: a transfer of *bytes bytes starts */
    volatile uint32_t *done;       /* the host writes 1 once the link's time for them is up */
    volatile uint64_t *bytes;
    double bytes_per_ns;
    double latency_ns;
    volatile int stop;
    uint64_t seen;                 /* transfers served */
} proxy_t;

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void *serve(void *arg) {
    proxy_t *p = (proxy_t *)arg;
    while (!p->stop) {
        if (*p->doorbell != 1) continue;
        double start = now_ns();
        *p->doorbell = 0;
        __sync_synchronize();
        double end = start + p->latency_ns + (double)*p->bytes / p->bytes_per_ns;
        while (now_ns() < end) {}
        __sync_synchronize();
        *p->done = 1;
        p->seen++;
    }
    return 0;
}

static pthread_t thread;

int proxy_start(proxy_t *p) { return pthread_create(&thread, 0, serve, p); }
int proxy_stop(proxy_t *p) { p->stop = 1; return pthread_join(thread, 0); }
"""


class _Proxy(ctypes.Structure):
    _fields_ = [
        ("doorbell", ctypes.c_void_p),
        ("done", ctypes.c_void_p),
        ("bytes", ctypes.c_void_p),
        ("bytes_per_ns", ctypes.c_double),
        ("latency_ns", ctypes.c_double),
        ("stop", ctypes.c_int),
        ("seen", ctypes.c_uint64),
    ]


def _driver() -> ctypes.CDLL:
    cuda = ctypes.CDLL("libcuda.so.1")
    for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        fn = getattr(cuda, name + "_v2", None) or getattr(cuda, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        setattr(cuda, "probe_" + name, fn)
    cuda.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    return cuda


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} returned CUresult {result}")


def _device_pointer(cuda: ctypes.CDLL, tensor: torch.Tensor) -> int:
    out = ctypes.c_uint64()
    _check(cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(tensor.data_ptr()), 0), "device ptr")
    return out.value


def _c_proxy() -> ctypes.CDLL | None:
    folder = tempfile.mkdtemp(prefix="ubatch_proxy_")
    source, library = os.path.join(folder, "proxy.c"), os.path.join(folder, "proxy.so")
    with open(source, "w") as f:
        f.write(_PROXY_C)
    for compiler in ("cc", "gcc", "clang"):
        try:
            command = [compiler, "-O2", "-shared", "-fPIC", "-pthread", source, "-o", library]
            subprocess.run(command, check=True, capture_output=True)
            return ctypes.CDLL(library)
        except (OSError, subprocess.CalledProcessError):
            continue
    return None


class _PythonProxy:
    """The same loop as the C one, in a Python thread (the GIL's switch interval can delay it)."""

    def __init__(self, state: _Proxy, views: dict[str, torch.Tensor]) -> None:
        self.state, self.views, self.stop = state, views, False
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        doorbell, done, nbytes = self.views["doorbell"], self.views["done"], self.views["bytes"]
        while not self.stop:
            if int(doorbell[0]) != 1:
                continue
            start = time.perf_counter_ns()
            doorbell[0] = 0
            end = start + self.state.latency_ns + int(nbytes[0]) / self.state.bytes_per_ns
            while time.perf_counter_ns() < end:
                pass
            done[0] = 1

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop = True
        self.thread.join()


def _transfer(cuda: ctypes.CDLL, stream: torch.cuda.Stream, ptrs: dict[str, int]) -> None:
    """Ring the doorbell, wait for the completion, re-arm it: three stream memory operations."""
    handle = ctypes.c_void_p(stream.cuda_stream)
    _check(cuda.probe_cuStreamWriteValue32(handle, ptrs["doorbell"], 1, 0), "write doorbell")
    _check(cuda.probe_cuStreamWaitValue32(handle, ptrs["done"], 1, 1), "wait done")  # 1: CU_STREAM_WAIT_VALUE_EQ
    _check(cuda.probe_cuStreamWriteValue32(handle, ptrs["done"], 0, 0), "re-arm done")


def _time_transfers(
    cuda: ctypes.CDLL,
    stream: torch.cuda.Stream,
    ptrs: dict[str, int],
    views: dict[str, torch.Tensor],
    counts: torch.Tensor,
    size: int,
    mode: str,
    replays: int,
) -> list[float]:
    """Sorted microseconds between events around one paced transfer of ``size`` bytes: set from the
    host (``eager``), or by the GPU inside a captured graph (``graph``: a copy of ``counts`` to the
    pinned size word, then the doorbell and the wait)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = None
    if mode == "graph":
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            views["bytes"].copy_(counts, non_blocking=True)
            _transfer(cuda, stream, ptrs)
        counts.fill_(size)
    else:
        views["bytes"][0] = size
    torch.cuda.synchronize()
    times = []
    for _ in range(replays if graph is not None else 20):
        with torch.cuda.stream(stream):
            begin.record()
            if graph is not None:
                graph.replay()
            else:
                _transfer(cuda, stream, ptrs)
            end.record()
        end.synchronize()
        times.append(round(begin.elapsed_time(end) * 1e3, 1))
    return sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbps", type=float, default=25.0, help="the paced link's bandwidth")
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    if not args.gbps > 0 or args.replays < 1:
        parser.error(f"--gbps must be > 0 and --replays >= 1, got {args.gbps} and {args.replays}")
    if not torch.cuda.is_available():
        parser.error("probe_proxy_link.py needs a CUDA GPU")
    torch.cuda.init()
    cuda = _driver()
    views = {name: torch.zeros(2, dtype=torch.int32).pin_memory() for name in ("doorbell", "done")}
    views["bytes"] = torch.zeros(1, dtype=torch.int64).pin_memory()
    ptrs = {name: _device_pointer(cuda, t) for name, t in views.items()}
    state = _Proxy(
        doorbell=views["doorbell"].data_ptr(),
        done=views["done"].data_ptr(),
        bytes=views["bytes"].data_ptr(),
        bytes_per_ns=args.gbps,
        latency_ns=0.0,
    )
    library = _c_proxy()
    stream = torch.cuda.Stream()
    counts = torch.zeros(1, dtype=torch.int64, device="cuda")
    for kind in ("c", "python") if library is not None else ("python",):
        proxy = _PythonProxy(state, views) if kind == "python" else None
        if proxy is None:
            _check(library.proxy_start(ctypes.byref(state)), "proxy_start")
        else:
            proxy.start()
        for mode in ("eager", "graph"):
            for size in (0, 64 << 10, 1 << 20, 8 << 20):
                times = _time_transfers(cuda, stream, ptrs, views, counts, size, mode, args.replays)
                expected = size / args.gbps / 1e3
                row = {"proxy": kind, "mode": mode, "bytes": size, "expected_us": round(expected, 1)}
                row.update({"median_us": times[len(times) // 2], "min_us": times[0], "max_us": times[-1]})
                print(json.dumps(row), flush=True)
        if proxy is None:
            _check(library.proxy_stop(ctypes.byref(state)), "proxy_stop")
            state.stop = 0
        else:
            proxy.close()


if __name__ == "__main__":
    main()
