"""How much communication a graph-replayed step hid, from the kernels torch.profiler records.

No Python runs inside a CUDA graph, so the scheduler's event trace sees nothing of a replay; the
GPU's own kernel activity does. A kernel whose name contains "nccl" is communication, any other
kernel compute. So are the link stand-in's (``ubatch.link``) copies between device and pinned
host memory (its pacing included) and the proxy link's waiting warp (``_proxy_link_transfer``,
``ubatch.proxy_link`` with ``wait="warp"``); other copies and memsets count as neither. A proxy
link that waits in the driver leaves only the copies of its sizes here (they still mark where
each collective starts), and ``ubatch.bench.link_clock`` times its transfers.
An NCCL kernel's time includes spinning until the other ranks arrive; gathered over the ranks,
the kernels split it into transfer and waiting (``transfer_ms``).
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from ubatch.bench.measure import drain
from ubatch.trace import Interval, busy_ms, hidden_comm_fraction

logger = logging.getLogger(__name__)

# trace.hidden_comm_fraction counts compute of *other* ubatches; kernels belong to no ubatch, so
# comm kernels get an id that no compute kernel has and every compute kernel can hide them.
_COMPUTE_ID, _COMM_ID = 0, -1


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float

    @property
    def is_comm(self) -> bool:
        return is_comm_activity(self.name)


def kernel_family(name: str) -> str:
    """A kernel's name without ``void``, template arguments or parameters, at most 60 characters:
    what groups a step's kernels by the op that launched them."""
    bare = name.removeprefix("void ")
    return re.split(r"[<(]", bare, maxsplit=1)[0][:60] or bare[:60]


def is_comm_activity(name: str) -> bool:
    """Whether a profiled kernel or copy of this name is communication (see the module docstring)."""
    name = name.lower()
    return "nccl" in name or "proxy_link" in name or _is_link_activity(name)


def _is_link_activity(name: str) -> bool:
    return "pinned" in name and ("dtoh" in name or "htod" in name)


def kernels_in_trace(trace: dict[str, Any]) -> list[Kernel]:
    """The kernels of a Chrome trace that torch.profiler exported: its complete events ("ph"
    "X") of category "kernel", and the link stand-in's host copies ("gpu_memcpy"), in
    microseconds."""
    return [
        Kernel(e["name"], e["ts"], e["ts"] + e["dur"])
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X"
        and (e.get("cat") == "kernel" or (e.get("cat") == "gpu_memcpy" and _is_link_activity(e["name"].lower())))
    ]


def _intervals(kernels: Sequence[Kernel]) -> list[Interval]:
    return [
        Interval(
            _COMM_ID if k.is_comm else _COMPUTE_ID,
            "comm" if k.is_comm else "compute",
            k.name,
            k.start_us / 1e3,
            k.end_us / 1e3,
        )
        for k in kernels
    ]


def hidden_kernel_fraction(kernels: Sequence[Kernel]) -> float | None:
    """Communication kernel time overlapped by the union of compute kernel intervals, over all
    communication kernel time; None without communication kernels (one rank: no NCCL)."""
    return hidden_comm_fraction(_intervals(kernels))


def kernel_costs(kernels: Sequence[Kernel]) -> tuple[float, float]:
    """(compute ms, comm ms): how long compute kernels, and communication kernels, were busy
    (overlaps within a kind counted once). Of an unsplit replay these are the step's C and M;
    NCCL kernels also count time spent waiting for a peer that started late."""
    intervals = _intervals(kernels)
    return busy_ms(intervals, "compute"), busy_ms(intervals, "comm")


def attention_share(kernels: Sequence[Kernel]) -> float | None:
    """Of an unsplit replay, the share of compute kernel time spent before each layer's first
    collective (from the previous layer's second on; the embedding's and the final norm's kernels
    count on this side too): what ``ubatch.bench.schedule`` calls the attention share. Decode's is
    far above prefill's (its attention reads the KV cache; its experts see few rows), and the model
    bounds a split by it. A collective is a run of communication activity (the link stand-in's
    chunked copies make one) that no compute kernel starts after; each compute kernel counts in the
    gap before the first collective that starts after it. None unless the collectives come in
    pairs (a MoE layer's dispatch and combine, a tensor-parallel block's two all-reduces), as in
    an unsplit step, or without compute."""
    collective_starts: list[float] = []
    comm_until = float("-inf")
    compute_since_comm = True
    for k in sorted(kernels, key=lambda k: k.start_us):
        if not k.is_comm:
            compute_since_comm = compute_since_comm or k.start_us >= comm_until
            continue
        if compute_since_comm:
            collective_starts.append(k.start_us)
            compute_since_comm = False
        comm_until = max(comm_until, k.end_us)
    if not collective_starts or len(collective_starts) % 2:
        return None
    before_first = total = 0.0
    for k in kernels:
        if k.is_comm:
            continue
        gap = bisect.bisect_right(collective_starts, k.start_us)  # collectives started by then
        total += k.end_us - k.start_us
        before_first += (k.end_us - k.start_us) if gap % 2 == 0 else 0.0
    return before_first / total if total > 0 else None


def comm_durations_us(kernels: Sequence[Kernel]) -> list[float]:
    """Each communication kernel's duration, in start order: the k-th is the k-th collective on
    every rank, since every rank issues its collectives in the same order."""
    return [k.end_us - k.start_us for k in sorted(kernels, key=lambda k: k.start_us) if k.is_comm]


def transfer_ms(durations_per_rank: Sequence[Sequence[float]]) -> float:
    """How long the ranks' collectives moved data: per collective, the shortest of its kernel
    durations over the ranks (us in, ms out). A rank that reaches a collective first spins in its
    kernel until the last one arrives, so the rest of each rank's kernel time is waiting."""
    counts = [len(d) for d in durations_per_rank]
    if len(set(counts)) > 1:
        raise ValueError(f"ranks ran different numbers of communication kernels: {counts}")
    return sum(min(per_collective) for per_collective in zip(*durations_per_rank)) / 1e3


def gathered_transfer_ms(kernels: Sequence[Kernel], group: Any = None) -> float | None:
    """``transfer_ms`` of one profiled step, every rank's kernel durations gathered over ``group``
    (every rank calls this alike); None on one rank or without communication kernels."""
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, comm_durations_us(kernels), group=group)
    return transfer_ms(gathered) if gathered[0] else None


def profile_kernels(fn: Callable[[], Any], device: torch.device, *, chrome_trace: str | None = None) -> list[Kernel]:
    """The kernels of one call of ``fn`` on a CUDA device (every rank calls it alike).

    A first, discarded call absorbs the profiler's start-up, which differs between ranks and
    would otherwise stretch the first collective; ``chrome_trace`` keeps the recorded call's trace.
    """
    # torch's own workaround for CUDA graphs: CUPTI torn down and re-initialised (the next
    # profiled configuration) can crash graph replays.
    os.environ.setdefault("TEARDOWN_CUPTI", "0")
    drain(device)
    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
        for _ in range(2):
            fn()
            torch.cuda.synchronize(device)
            prof.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        if chrome_trace:
            shutil.copyfile(path, chrome_trace)
        with open(path) as f:
            kernels = kernels_in_trace(json.load(f))
    if not kernels:
        logger.warning("torch.profiler recorded no kernels of the profiled step (is CUPTI working?)")
    return kernels
