"""A link stand-in paced by a host thread, as a NIC's proxy paces a transfer: any bandwidth, no SM.

``HostLink`` moves each collective's bytes through pinned memory on the copy engines, so it cannot
model a link faster than they go (about 41 GB/s on an H100, below one 400 Gb/s NIC per GPU), and
its staging adds a stretch of its own (the last piece of each collective returns after the rest).
``ProxyLink`` keeps HostLink's contract (a world of one that charges the bytes a rank of
``world_size`` sends; see ``ubatch.link``) and times each transfer the way a network proxy does:

- the comm stream writes the payload's size and rings a doorbell in pinned host memory (stream
  memory operations, ``cuStreamWriteValue64`` / ``cuStreamWriteValue32``: no kernel, capturable in
  CUDA graphs), then waits for a completion flag there and re-arms it. By default
  (``wait="stream"``) the driver waits (``cuStreamWaitValue32``) and the stream re-arms the flag:
  no SM at all, as with a NIC, and as run 27's probe measured it (13-16 us a round trip on an
  H100). A profiler does not see such a wait, so the link keeps its own clock (``busy_ms()``: each
  transfer's time, summed), from which the bench takes the step's communication (M).
  ``wait="warp"`` waits in one warp instead (``_proxy_link_transfer``), which a trace shows as a
  communication kernel; but the warp needs room on an SM, and where kernels hold every SM's room
  (a persistent grouped GEMM) it waits for one and the transfer lasts that long;
- a host thread (C, compiled on first use with the system's C compiler, as Triton compiles its
  launchers) sees the doorbell, waits ``bytes / bandwidth`` less the round trip the doorbell and the
  flag cost anyway (``overhead_us``, measured at ``prepare()``), and sets the flag. A transfer thus
  takes max(overhead, bytes / bandwidth), one after another as on one communicator. The thread
  also times how long the GPU leaves each flag set before taking it back (``describe()``'s
  ``flag_lag_us``): a few microseconds, unless a waiting warp could not get an SM.

A collective may charge a size the GPU set (``all_to_all_single(..., moved_rows=t)``: the rows a
padded buffer really holds for other ranks, which the MoE layer passes for its static dispatch and
combine, whole, in token runs or per expert group), copied into the mailbox on the comm stream
before the doorbell, beside the row's size in bytes: the host thread multiplies the two, so no
kernel computes the bytes.

The values move as a same-device copy on the stream that produced the input (``own_part_stream``,
as HostLink's own part), joined to the comm stream before the collective completes, so a consumer
that waits reads them. Unlike HostLink, the output is written when the collective starts: a
consumer that skips its wait reads fresh data here, so tests of waits use HostLink or the CPU link.

``bytes_moved`` counts the bytes of each collective's buffers, as HostLink's does: on CUDA a size the
GPU sets stays there (reading it would sync).

On the CPU a ProxyLink is HostLink's CPU link (a deadline per transfer, no thread). The host
thread spins a CPU core while the link is open; ``close()`` (or the link's end) lets it nap between
polls instead and serve every later transfer at once, so a graph that captured the link still
replays (its transfers then take no time) and nothing waits forever. The thread and its mailbox
stay for the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import statistics
import subprocess
import tempfile
from typing import Any

import torch

from ubatch._triton import tl, triton
from ubatch.link import HostLink

CALIBRATION_TRANSFERS = 32  # empty transfers timed at prepare(): the median is the fixed overhead
REACHED_BYTES = (1 << 20, 64 << 20)  # payloads whose bandwidth describe() reports
WAITS = ("stream", "warp")  # where the comm stream waits for a transfer: the driver (no SM), or one warp

_PROXY_SOURCE = r"""
#include <stdint.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>

/* One link's mailbox, in pinned host memory: the GPU writes the size and the doorbell, the host done. */
typedef struct {
    volatile uint32_t doorbell;  /* 1: a transfer of `units` * `unit_bytes` bytes has started */
    volatile uint32_t done;      /* 1: its time on the link is up (the GPU resets it to 0) */
    volatile uint64_t units;     /* bytes, or rows where the GPU set the count */
    volatile uint64_t unit_bytes;
    double bytes_per_ns;         /* GB/s */
    double overhead_ns;          /* the doorbell's and the flag's own round trip, not waited again */
    volatile int32_t stop;       /* 1: the thread ends */
    volatile int32_t closed;     /* 1: transfers take no time, the thread naps between polls */
    volatile uint64_t served;
    volatile double busy_ns;     /* each open transfer's time on the link, the round trip included */
    volatile double lag_total_ns; /* from setting `done` to the GPU taking it back, summed */
    volatile double lag_max_ns;
    volatile uint64_t lagged;    /* transfers whose lag was seen */
    pthread_t thread;
} mailbox_t;

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void *serve(void *arg) {
    mailbox_t *m = (mailbox_t *)arg;
    const struct timespec nap = {0, 100000};
    while (!m->stop) {
        if (m->doorbell != 1) {  /* idle: let the host's other threads run */
            if (m->closed) nanosleep(&nap, 0); else sched_yield();
            continue;
        }
        double start = now_ns();
        m->doorbell = 0;
        __sync_synchronize();
        int open = !m->closed;
        if (open) {
            double end = start + (double)(m->units * m->unit_bytes) / m->bytes_per_ns - m->overhead_ns;
            while (now_ns() < end) {}
        }
        double set = now_ns();
        m->served++;  /* counted before the flag: whoever sees the transfer done sees it counted */
        if (open) m->busy_ns += set - start + m->overhead_ns;
        __sync_synchronize();
        m->done = 1;
        /* How long the GPU leaves the flag set: a warp that could not get an SM (all held by
           kernels that leave no room) holds the comm stream past the link's time. */
        while (m->done == 1 && m->doorbell != 1 && !m->stop) {}
        if (m->done == 0) {
            double lag = now_ns() - set;
            m->lag_total_ns += lag;
            if (lag > m->lag_max_ns) m->lag_max_ns = lag;
            m->lagged++;
        }
    }
    return 0;
}

int proxy_start(mailbox_t *m) { return pthread_create(&m->thread, 0, serve, m); }

int proxy_stop(mailbox_t *m) {
    m->stop = 1;
    return pthread_join(m->thread, 0);
}
"""


class _Mailbox(ctypes.Structure):
    _fields_ = [
        ("doorbell", ctypes.c_uint32),
        ("done", ctypes.c_uint32),
        ("units", ctypes.c_uint64),
        ("unit_bytes", ctypes.c_uint64),
        ("bytes_per_ns", ctypes.c_double),
        ("overhead_ns", ctypes.c_double),
        ("stop", ctypes.c_int32),
        ("closed", ctypes.c_int32),
        ("served", ctypes.c_uint64),
        ("busy_ns", ctypes.c_double),
        ("lag_total_ns", ctypes.c_double),
        ("lag_max_ns", ctypes.c_double),
        ("lagged", ctypes.c_uint64),
        ("thread", ctypes.c_ulong),
    ]


if triton is not None:

    @triton.jit
    def _proxy_link_transfer(done):
        """Wait until the host thread sets the flag, then re-arm it: the transfer as seen in a trace
        (``wait="warp"``)."""
        flag = tl.load(done, volatile=True)
        while flag != 1:
            flag = tl.load(done, volatile=True)
        tl.store(done, 0)


_DONE_OFFSET = _Mailbox.done.offset
_UNITS_OFFSET = _Mailbox.units.offset
_UNIT_BYTES_OFFSET = _Mailbox.unit_bytes.offset
# Mailboxes of closed links, kept for the process with their napping threads: a graph that
# captured a link still rings its doorbell and waits for its flag when replayed.
_CLOSED_MAILBOXES: list[torch.Tensor] = []
CU_STREAM_WAIT_VALUE_EQ = 1
_library: ctypes.CDLL | None = None
_driver: ctypes.CDLL | None = None


def proxy_library() -> ctypes.CDLL:
    """The compiled proxy thread (built once per source version into the temp directory)."""
    global _library
    if _library is None:
        digest = hashlib.sha256(_PROXY_SOURCE.encode()).hexdigest()[:16]
        folder = os.path.join(tempfile.gettempdir(), f"ubatch-proxy-{os.getuid()}")
        os.makedirs(folder, exist_ok=True)
        library = os.path.join(folder, f"proxy_{digest}.so")
        if not os.path.exists(library):
            source = os.path.join(folder, f"proxy_{digest}.c")
            with open(source, "w") as f:
                f.write(_PROXY_SOURCE)
            errors = []
            for compiler in (os.environ.get("CC"), "cc", "gcc", "clang"):
                if not compiler:
                    continue
                partial = f"{library}.{os.getpid()}"
                command = [compiler, "-O2", "-shared", "-fPIC", "-pthread", source, "-o", partial]
                try:
                    subprocess.run(command, check=True, capture_output=True, text=True)
                except (OSError, subprocess.CalledProcessError) as exc:
                    errors.append(f"{compiler}: {getattr(exc, 'stderr', '') or exc}")
                    continue
                os.replace(partial, library)
                break
            else:
                raise RuntimeError(f"ProxyLink needs a C compiler to build its host thread; tried: {errors}")
        _library = ctypes.CDLL(library)
        _library.proxy_start.argtypes = _library.proxy_stop.argtypes = [ctypes.c_void_p]
    return _library


def _cuda_driver() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        driver = ctypes.CDLL("libcuda.so.1")
        for name in ("cuStreamWriteValue32", "cuStreamWriteValue64", "cuStreamWaitValue32"):
            fn = getattr(driver, name + "_v2", None) or getattr(driver, name)
            value = ctypes.c_uint64 if name.endswith("64") else ctypes.c_uint32
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, value, ctypes.c_uint]
            fn.restype = ctypes.c_int
            setattr(driver, "ubatch_" + name, fn)
        driver.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        _driver = driver
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"ProxyLink: {what} failed with CUresult {result}")


class _ProxyThread:
    """The pinned mailbox, its host thread and the comm-stream side of one ProxyLink on one device."""

    def __init__(self, device: torch.device, bandwidth_gbps: float, wait: str) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "ProxyLink was first used inside a CUDA graph capture: it must start its host thread and "
                "calibrate outside one. Call link.prepare() (or run the step once eagerly) before capturing"
            )
        if wait == "warp" and triton is None:
            raise RuntimeError('ProxyLink(wait="warp") needs Triton (its transfers wait in a one-warp kernel)')
        self.device, self.wait = device, wait
        self.memory = torch.zeros(ctypes.sizeof(_Mailbox), dtype=torch.uint8, pin_memory=True)
        self.mailbox = _Mailbox.from_address(self.memory.data_ptr())
        self.done_flag = self.memory[_DONE_OFFSET : _DONE_OFFSET + 4].view(torch.int32)
        self.units_word = self.memory[_UNITS_OFFSET : _UNITS_OFFSET + 8].view(torch.int64)
        self.mailbox.bytes_per_ns = bandwidth_gbps
        driver = _cuda_driver()
        pointer = ctypes.c_uint64()
        _check(driver.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), self.memory.data_ptr(), 0), "mapping")
        self.base = pointer.value
        self.driver = driver
        self.done = torch.cuda.Event()
        self.last_stream: Any = None
        self.open = True
        _check(proxy_library().proxy_start(ctypes.addressof(self.mailbox)), "starting the host thread")
        self.overhead_us = statistics.median(self._time_us(0) for _ in range(CALIBRATION_TRANSFERS))
        self.mailbox.overhead_ns = self.overhead_us * 1e3
        self.reached_gbps = {n: n / (self._time_us(n) * 1e3) for n in REACHED_BYTES}

    def busy_ms(self) -> float:
        """The link's time so far, each transfer's round trip included (the calibration's too)."""
        return self.mailbox.busy_ns / 1e6

    def flag_lag_us(self) -> dict[str, float | int]:
        """How long the GPU took to take each completion flag back, in us (mean and max over the
        link's transfers so far): a few us where its wait sat ready (the driver's always does), far
        more where a waiting warp waited for an SM behind kernels that held them all, which the
        link's time then does not bound (each transfer takes at least that long)."""
        box = self.mailbox
        mean = box.lag_total_ns / box.lagged / 1e3 if box.lagged else 0.0
        return {"mean": round(mean, 2), "max": round(box.lag_max_ns / 1e3, 2), "transfers": box.lagged}

    def close(self) -> None:
        """Let the thread nap between polls and serve every later transfer at once (kept, with the
        mailbox, for the process: graphs that captured the link may still be replayed)."""
        if self.open:
            self.mailbox.closed = 1
            self.open = False
            _CLOSED_MAILBOXES.append(self.memory)

    def __del__(self) -> None:
        self.close()

    def transfer(self, units: int | torch.Tensor, unit_bytes: int = 1) -> None:
        """Hold the current stream for ``units * unit_bytes`` bytes over the link (``units`` a
        one-element int64 tensor on the device: a count the GPU set, copied into the mailbox):
        size, doorbell, then the wait for the flag and its re-arming."""
        stream = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing and self.last_stream is not None and self.last_stream != stream:
            stream.wait_event(self.done)  # one mailbox: the previous stream's transfer goes first
        handle = ctypes.c_void_p(stream.cuda_stream)
        driver = self.driver
        if isinstance(units, torch.Tensor):
            self.units_word.copy_(units.reshape(1), non_blocking=True)
        else:
            _check(driver.ubatch_cuStreamWriteValue64(handle, self.base + _UNITS_OFFSET, units, 0), "writing the size")
        _check(
            driver.ubatch_cuStreamWriteValue64(handle, self.base + _UNIT_BYTES_OFFSET, unit_bytes, 0),
            "writing the size",
        )
        _check(driver.ubatch_cuStreamWriteValue32(handle, self.base, 1, 0), "ringing the doorbell")
        if self.wait == "warp":
            _proxy_link_transfer[(1,)](self.done_flag, num_warps=1)
        else:
            flag = self.base + _DONE_OFFSET
            _check(driver.ubatch_cuStreamWaitValue32(handle, flag, 1, CU_STREAM_WAIT_VALUE_EQ), "waiting")
            _check(driver.ubatch_cuStreamWriteValue32(handle, flag, 0, 0), "re-arming the flag")
        if not capturing:
            self.done.record(stream)
            self.last_stream = stream

    def _time_us(self, nbytes: int) -> float:
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.transfer(nbytes)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3


class ProxyLink(HostLink):
    """A world of one that charges the bytes of a world of ``world_size`` to a link that a host
    thread paces at ``bandwidth_gbps``; the comm stream waits for each transfer in the driver
    (``wait="stream"``, no SM) or in one warp (``"warp"``, seen in traces). See the module
    docstring."""

    sizes_on_device = True  # all_to_all_single's moved_rows: the size the comm stream writes

    def __init__(
        self,
        world_size: int,
        bandwidth_gbps: float,
        *,
        device: torch.device | str | None = None,
        wait: str = "stream",
    ) -> None:
        if bandwidth_gbps is None:
            raise ValueError("ProxyLink needs a bandwidth in GB/s (it has no copy engine speed to default to)")
        if wait not in WAITS:
            raise ValueError(f"ProxyLink's wait must be one of {', '.join(WAITS)}, got {wait!r}")
        super().__init__(world_size, bandwidth_gbps, device=device)
        self.wait = wait
        self._proxy: _ProxyThread | None = None

    def __repr__(self) -> str:
        return f"ProxyLink(world_size={self.world_size}, bandwidth_gbps={self.bandwidth_gbps}, wait={self.wait!r})"

    @property
    def transfers_in_trace(self) -> bool:
        """Whether a profiler sees the transfers (as the waiting warp's kernels); the driver's
        waits it does not, and the link's own clock (``busy_ms``) stands in."""
        return self.wait == "warp"

    def busy_ms(self) -> float:
        """The link's time so far: on CUDA each transfer's, its round trip included (the host
        thread's clock, so no sync), on the CPU the charged bytes over the bandwidth. Differences
        around a step give its communication time."""
        if self.device is not None and self.device.type == "cuda":
            return 0.0 if self._proxy is None else self._proxy.busy_ms()
        return self.bytes_moved / (self.bandwidth_gbps * 1e6)

    def prepare(self, device: torch.device | str | None = None) -> None:
        """Start the host thread and measure its overhead, as the first collective would; call it
        before capturing a graph that uses a link nothing has run over yet. A no-op on CPU."""
        if device is None:
            device = self.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._bind(torch.device(device), "prepare(device)")
        if self.device.type == "cuda":
            self._thread()

    def close(self) -> None:
        """Stop pacing: the host thread (which spins a CPU core while the link is open) naps
        between polls from now on and serves at once, so graphs that captured the link still
        replay, moving the values, with transfers that take no time. A later collective opens
        the link again."""
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None

    def describe(self) -> dict[str, Any]:
        """The link for reports; every figure that uses it must say it is the stand-in."""
        row = super().describe()
        row.update(kind="proxy-link stand-in", copy_engine_gbps=None, wait=self.wait)
        if self._proxy is not None:
            by_bytes = self._proxy.reached_gbps
            row.update(
                bandwidth_reached_gbps=by_bytes[REACHED_BYTES[-1]],
                reached_gbps_by_bytes=by_bytes,
                overhead_us=round(self._proxy.overhead_us, 2),
                flag_lag_us=self._proxy.flag_lag_us(),
            )
        if self.device is None or self.device.type == "cuda":
            waiter = "the driver" if self.wait == "stream" else "one warp"
            row["method"] = (
                f"host thread paces a doorbell and a flag in pinned memory (stream memory operations), {waiter} "
                "waits for the flag; static MoE dispatches and combines (whole, in token runs or per expert group) "
                "charge their real rows"
            )
        return row

    def _transfer(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        moved: int,
        data_stream: torch.cuda.Stream,
        sized: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        current = torch.cuda.current_stream()
        if dst.data_ptr() != src.data_ptr():
            with torch.cuda.stream(data_stream):
                dst.copy_(src)
            current.wait_stream(data_stream)
        self._thread().transfer(*((moved,) if sized is None else sized))

    def _thread(self) -> _ProxyThread:
        if self._proxy is None:
            with torch.cuda.device(self.device):
                self._proxy = _ProxyThread(self.device, self.bandwidth_gbps, self.wait)
        return self._proxy
