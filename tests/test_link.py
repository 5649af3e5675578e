"""The host-link stand-in: a world of one in values, a world of W in bytes moved; CPU deadlines,
validation, the CLI form; on the GPU values, graph capture and replay, and the throttle."""

import collections
import contextlib
import importlib.util
import math
import random
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tests.link_graphs import replay_captured_collectives
from ubatch import link as link_module
from ubatch.link import (
    DEFAULT_CPU_GBPS,
    HostLink,
    LinkWork,
    chunk_plan,
    is_link,
    parse_link,
)
from ubatch.scheduler import UBatchScheduler, current_ubatch

FAST = 1e6  # GB/s: CPU transfers that take no measurable time


def _run_every_op(link, x, async_op=False):
    """Every collective once on copies of ``x``; returns (results, works)."""
    works = []
    reduced = x.clone()
    works.append(link.all_reduce(reduced, async_op=async_op))
    exchanged = torch.zeros_like(x)
    works.append(link.all_to_all_single(exchanged, x, async_op=async_op))
    gathered = torch.zeros(x.numel(), dtype=x.dtype, device=x.device)
    works.append(link.all_gather_into_tensor(gathered, x, async_op=async_op))
    scattered = torch.zeros(x.numel(), dtype=x.dtype, device=x.device)
    works.append(link.reduce_scatter_tensor(scattered, x, op=dist.ReduceOp.MAX, async_op=async_op))
    return [reduced, exchanged, gathered.view(x.shape), scattered.view(x.shape)], works


# --- values and bytes (CPU) ---------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_every_op_leaves_one_rank_values(world, dtype):
    x = (torch.randn(24, 5) * 100).to(dtype)
    results, _ = _run_every_op(HostLink(world, FAST), x)
    for got in results:
        assert torch.equal(got, x)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_bytes_moved_are_those_of_one_rank_of_w(world):
    link = HostLink(world, FAST)
    x = torch.randn(24, 5)  # 480 bytes; 24 rows divide by every world size tried
    _, works = _run_every_op(link, x, async_op=True)
    nbytes, elements = x.nbytes, x.numel()
    expected = [
        2 * (world - 1) * nbytes // world,  # ring all-reduce
        (world - 1) * nbytes // world,  # all-to-all: every row but one's own share
        (elements - elements // world) * 4,  # all-gather: the other ranks' part of the buffer
        (elements - elements // world) * 4,  # reduce-scatter
    ]
    assert [w.nbytes for w in works] == expected
    assert link.bytes_moved == sum(expected)


def test_all_to_all_with_splits_moves_the_rows_for_other_ranks():
    link = HostLink(3, FAST)
    x = torch.randn(10, 4)
    out = torch.zeros_like(x)
    work = link.all_to_all_single(out, x, [2, 5, 3], [2, 5, 3], async_op=True)
    assert torch.equal(out, x)
    assert work.nbytes == 8 * 4 * 4  # rows 2..9 of 16 bytes each


def test_all_to_all_in_place_and_empty():
    link = HostLink(2, FAST)
    x = torch.randn(6, 2)
    before = x.clone()
    link.all_to_all_single(x, x)
    assert torch.equal(x, before)
    empty = torch.empty(0, 3)
    assert link.all_to_all_single(torch.empty(0, 3), empty, async_op=True).nbytes == 0


def test_cpu_work_takes_bytes_over_bandwidth_and_queues_on_the_link():
    link = HostLink(2, 1e-3)  # 1 MB/s
    x = torch.zeros(25_000)  # 100 kB per all-reduce: 0.1 s each
    first = link.all_reduce(x, async_op=True)
    second = link.all_reduce(x, async_op=True)
    assert first.seconds == pytest.approx(x.nbytes / 1e6)
    assert second.deadline == pytest.approx(first.deadline + second.seconds)
    assert not first.is_completed()


def test_cpu_default_bandwidth_is_stated():
    link = HostLink(2)
    work = link.all_reduce(torch.zeros(1000), async_op=True)
    assert work.seconds == pytest.approx(4000 / (DEFAULT_CPU_GBPS * 1e9))
    assert link.describe()["bandwidth_reached_gbps"] == DEFAULT_CPU_GBPS


def test_cpu_wait_sleeps_until_the_deadline():
    link = HostLink(2, 1e-3)
    x = torch.zeros(5_000)  # 20 kB at 1 MB/s: 20 ms
    start = time.monotonic()
    work = link.all_reduce(x, async_op=True)
    assert work.wait(timedelta(seconds=5)) is True
    assert work.is_completed()
    assert time.monotonic() - start >= work.seconds - 1e-3


def test_cpu_blocking_call_returns_after_the_transfer():
    link = HostLink(2, 1e-3)
    x = torch.zeros(5_000)
    start = time.monotonic()
    assert link.all_reduce(x) is None
    assert time.monotonic() - start >= x.nbytes / 1e6 - 1e-3


def test_cpu_wait_past_its_timeout_raises_at_once():
    # 20 s of transfer: no stall of a loaded CI host outlasts it before the wait below
    work = HostLink(2, 1e-3).all_reduce(torch.zeros(5_000_000), async_op=True)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="past the wait timeout"):
        work.wait(timedelta(milliseconds=10))
    assert time.monotonic() - start < 10
    assert not work.is_completed()
    with pytest.raises(TypeError, match="timedelta"):
        work.wait(1.0)


def test_link_work_zero_timeout_means_no_limit():
    work = LinkWork("all_reduce", 0, 0.0, time.monotonic() + 0.005)
    assert work.wait(timedelta(0))
    assert work.is_completed()


def test_the_scheduler_waits_on_a_cpu_link_work():
    link = HostLink(2, 1e-3)
    inputs = [torch.full((2_500,), float(i)) for i in range(2)]  # 10 ms each
    outputs = [torch.zeros(2_500) for _ in range(2)]

    def task(i):
        def run():
            current_ubatch().run_collective(
                "all_to_all_single",
                lambda is_async: link.all_to_all_single(outputs[i], inputs[i], async_op=is_async),
                None,
            )
            return outputs[i].sum().item()

        return run

    assert UBatchScheduler(2, "cpu").run([task(0), task(1)]) == [0.0, 2_500.0]
    assert link.bytes_moved == 2 * inputs[0].nbytes // 2


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(world_size=0), ValueError, "world_size"),
        (dict(world_size=True), ValueError, "world_size"),
        (dict(world_size=2.0), ValueError, "world_size"),
        (dict(world_size=2, bandwidth_gbps=0), ValueError, "positive"),
        (dict(world_size=2, bandwidth_gbps=math.inf), ValueError, "positive"),
        (dict(world_size=2, bandwidth_gbps="25"), TypeError, "number"),
        (dict(world_size=2, chunk_bytes=1000), ValueError, "chunk_bytes"),
        (dict(world_size=2, device="meta"), ValueError, "cpu or cuda"),
    ],
)
def test_constructor_rejects_bad_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        HostLink(**kwargs)


def test_collectives_reject_bad_tensors():
    link = HostLink(2, FAST)
    x = torch.randn(4, 3)
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        link.all_to_all_single(torch.empty(4, 3), [1, 2])
    with pytest.raises(ValueError, match="output must be contiguous"):
        link.all_to_all_single(torch.empty(3, 4).t(), x)
    with pytest.raises(TypeError, match="dtypes differ"):
        link.all_to_all_single(torch.empty(4, 3, dtype=torch.float64), x)
    with pytest.raises(ValueError, match="output.shape == input.shape"):
        link.all_to_all_single(torch.empty(2, 6), x)
    with pytest.raises(ValueError, match="0-dim"):
        link.all_to_all_single(torch.empty(()), torch.ones(()))
    with pytest.raises(ValueError, match="overlap in memory"):
        buffer = torch.zeros(10)
        link.all_gather_into_tensor(buffer[2:8], buffer[:6])
    with pytest.raises(ValueError, match="equal sizes"):
        link.all_gather_into_tensor(torch.empty(8, 3), x)
    with pytest.raises(ValueError, match="identity over one rank"):
        link.all_reduce(x, op=dist.ReduceOp.PREMUL_SUM)
    with pytest.raises(ValueError, match="identity over one rank"):
        link.reduce_scatter_tensor(torch.empty_like(x), x, op="sum")
    with pytest.raises(TypeError, match="async_op must be a bool"):
        link.all_reduce(x, async_op=1)
    with pytest.raises(ValueError, match="HostLink is on cpu"):
        link.all_reduce(torch.empty(3, device="meta"))


def test_own_part_stream_must_be_a_cuda_stream():
    link = HostLink(2)
    x = torch.zeros(4)
    for op in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"):
        with pytest.raises(TypeError, match=f"{op}: own_part_stream must be a torch.cuda.Stream or None, got str"):
            getattr(link, op)(torch.zeros(4), x, own_part_stream="stream")


@pytest.mark.parametrize(
    "splits, match",
    [
        ([2, 2], "must hold 3 ints"),
        ([2, 2, -1, 3], "must hold 3 ints"),
        ([1, 1, True], "must hold 3 ints"),
        ([2, 2, 3], "sums to 7"),
    ],
)
def test_all_to_all_rejects_bad_split_sizes(splits, match):
    x = torch.randn(6, 2)
    with pytest.raises(ValueError, match=match):
        HostLink(3, FAST).all_to_all_single(torch.empty_like(x), x, splits, splits)


def test_all_to_all_split_rules_of_a_world_of_one():
    link = HostLink(3, FAST)
    x = torch.randn(6, 2)
    with pytest.raises(ValueError, match="must equal input_split_sizes"):
        link.all_to_all_single(torch.empty_like(x), x, [1, 2, 3], [3, 2, 1])
    with pytest.raises(ValueError, match="must equal input_split_sizes"):
        link.all_to_all_single(torch.empty_like(x), x, None, [1, 2, 3])
    with pytest.raises(ValueError, match=r"divisible by the world size \(3\)"):
        link.all_to_all_single(torch.empty(4, 2), torch.randn(4, 2))
    with pytest.raises(TypeError, match="list of ints"):
        link.all_to_all_single(torch.empty_like(x), x, None, torch.tensor([2, 2, 2]))


def test_link_keeps_the_device_it_first_saw():
    link = HostLink(2, FAST)
    link.all_reduce(torch.zeros(2))
    assert link.describe()["device"] == "cpu"
    with pytest.raises(ValueError, match="prepare"):
        link.prepare("meta")


def test_world_and_rank_are_what_models_shard_for():
    link = HostLink(4, 12.5)
    assert (link.size(), link.rank()) == (4, 0)
    assert is_link(link) and not is_link(None) and not is_link(object())
    info = link.describe()
    assert info["kind"] == "host-link stand-in" and info["world_size"] == 4 and info["bandwidth_set_gbps"] == 12.5


# --- the CLI form -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, world, gbps",
    [
        ("host", 2, None),
        ("host:25", 2, 25.0),
        ("host:12.5:w4", 4, 12.5),
        ("host::w8", 8, None),
        ("host:50:w1", 1, 50.0),
        ("proxy:100:w8", 8, 100.0),
        ("proxy:12.5", 2, 12.5),
        ("proxy:25:w8:warp", 8, 25.0),
        ("proxy:25:w4:stream", 4, 25.0),
    ],
)
def test_parse_link(text, world, gbps):
    link = parse_link(text)
    assert (link.world_size, link.bandwidth_gbps) == (world, gbps)
    assert type(link).__name__ == ("ProxyLink" if text.startswith("proxy") else "HostLink")
    assert link.transfers_in_trace == (not text.startswith("proxy") or text.endswith(":warp"))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hosts",
        "nccl:25",
        "host:",
        "host:fast",
        "host:0",
        "host:-3",
        "host:nan",
        "host:25:4",
        "host:25:w0",
        "host:25:wx",
        "host:25:w4:1",
        "proxy",
        "proxy::w8",
        "proxy:0",
        "proxy:25:w8:spin",
        "proxy:25:warp",
        "host:25:w8:warp",
    ],
)
def test_parse_link_names_the_bad_text(text):
    with pytest.raises(ValueError, match=f"link {text!r}"):
        parse_link(text)


def test_parse_link_none_and_type():
    assert parse_link("none") is None
    with pytest.raises(TypeError):
        parse_link(25)


# --- chunking and the copy model ----------------------------------------------------------------


@given(length=st.integers(1, 1 << 25), passes=st.fractions(0, 2), chunk=st.sampled_from([64 << 10, 1 << 20, 4 << 20]))
def test_chunk_plan_moves_every_byte_in_order(length, passes, chunk):
    total = int(length * passes)  # an all-reduce goes round its buffer up to twice
    pieces = chunk_plan(total, length, chunk)
    assert sum(n for _, n in pieces) == total
    position = 0
    for offset, n in pieces:
        assert offset == position % length and 0 < n <= chunk and offset + n <= length
        position += n


def test_chunk_plan_pipelines_mid_sized_payloads():
    assert len(chunk_plan(8 << 20, 8 << 20, 4 << 20)) == 4  # 2 MiB chunks, not two of 4 MiB
    assert len(chunk_plan(64 << 20, 64 << 20, 4 << 20)) == 16
    assert chunk_plan(100, 100, 4 << 20) == [(0, 100)]
    with pytest.raises(ValueError, match="buffer of 0 bytes"):
        chunk_plan(10, 0, 4 << 20)


# --- the CUDA ordering, on simulated streams (CPU) ----------------------------------------------


class _SimulatedGPU:
    """Streams as queues of deferred copies; events point at a stream's last queued op; ``run``
    executes the queues in a random order that respects stream order and event waits, as a GPU
    may. Values that survive every order need no luck in the timing."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.streams = []
        self.current = None
        self.deferring = False

    def stream(self):
        gpu = self

        class Stream:
            def __init__(self, *args, **kwargs):
                self.queue, self.last = collections.deque(), None
                gpu.streams.append(self)

            def add(self, fn, deps=()):
                self.last = [fn, [d for d in (self.last, *deps) if d is not None], False]
                self.queue.append(self.last)

            def wait_event(self, event):
                self.add(None, [event.op])

        return Stream

    def event(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.op = None

            def record(self, stream=None):
                self.op = (stream or gpu.current).last

            def synchronize(self):
                gpu.run()

            def elapsed_time(self, other):
                return 1.0

        return Event

    def run(self):
        while True:
            ready = [s for s in self.streams if s.queue and all(d[2] for d in s.queue[0][1])]
            if not ready:
                assert not any(s.queue for s in self.streams), "a wait that can never be met"
                return
            op = self.rng.choice(ready).queue.popleft()
            if op[0] is not None:
                op[0]()
            op[2] = True


@pytest.fixture
def simulated_gpu(monkeypatch):
    gpu = _SimulatedGPU(seed=0)
    Stream = gpu.stream()
    gpu.current = Stream()
    real_copy, real_empty = torch.Tensor.copy_, torch.empty

    def copy(dst, src, non_blocking=False):
        if not gpu.deferring:
            return real_copy(dst, src)
        gpu.current.add(lambda: real_copy(dst, src))
        return dst

    @contextlib.contextmanager
    def use_stream(stream):
        previous, gpu.current = gpu.current, stream
        try:
            yield
        finally:
            gpu.current = previous

    for name, value in dict(
        Stream=Stream,
        Event=gpu.event(),
        current_stream=lambda *a: gpu.current,
        stream=use_stream,
        device=lambda d: contextlib.nullcontext(),
        synchronize=lambda *a: gpu.run(),
        _sleep=lambda cycles: gpu.current.add(None),
        is_current_stream_capturing=lambda: False,
        current_device=lambda: 0,
    ).items():
        monkeypatch.setattr(torch.cuda, name, value, raising=False)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    monkeypatch.setattr(HostLink, "_is_cpu", lambda self: False)
    monkeypatch.setattr(link_module, "CALIBRATION_BYTES", (64 << 10, 256 << 10))
    monkeypatch.setattr(link_module, "named_stream", lambda device, role: Stream())  # no pool to alias
    return gpu


@pytest.mark.parametrize("world, bandwidth", [(2, None), (3, 0.1), (4, None)])  # 0.1: throttled (padded)
def test_cuda_ordering_keeps_values_in_every_order(simulated_gpu, world, bandwidth):
    """Several collectives queued on two unordered streams before anything runs: the slot and
    stream events alone must keep every value (remove any one wait and this fails)."""
    gpu = simulated_gpu
    link = HostLink(world, bandwidth, device="cpu", chunk_bytes=64 << 10)
    streams = [gpu.current, type(gpu.current)()]
    rng = random.Random(world)
    checks = []
    for _ in range(2):
        gpu.deferring = True
        for _ in range(4):
            x = torch.randn(world * rng.randint(1, 5), rng.choice([1, 1000, 6000]))
            with torch.cuda.stream(rng.choice(streams)):
                out = torch.zeros_like(x)
                link.all_to_all_single(out, x)
                reduced = x.clone()
                link.all_reduce(reduced)
                gathered = torch.zeros_like(x)
                link.all_gather_into_tensor(gathered, x)
            checks += [(out, x), (reduced, x), (gathered, x)]
        gpu.deferring = False
        gpu.run()
    for got, expected in checks:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("bandwidth", [None, 0.1])  # the simulated copies "reach" 0.26 GB/s
def test_cuda_throttle_pads_each_payload_in_proportion_less_its_tail(simulated_gpu, monkeypatch, bandwidth):
    """A throttled link holds the D2H engine for pad_ratio times the payload less its last chunk
    (whose H2D runs after it), before the payload's first copy, and cuts the payload into the
    fewest chunks the padding can cover; an unthrottled one never pads and cuts MIN_PIECES."""
    gpu = simulated_gpu
    link = HostLink(2, bandwidth, device="cpu", chunk_bytes=64 << 10)
    staging = link._staging()
    assert (staging.pad_ratio > 0) == (bandwidth is not None)
    assert staging.min_pieces == (link_module.PACED_MIN_PIECES if bandwidth else link_module.MIN_PIECES)
    if bandwidth:
        staging.pad_ratio = 2.5  # the simulated clock's calibration is meaningless; fix what it set
    copies = []
    deferred_copy = torch.Tensor.copy_

    def counting_copy(dst, src, non_blocking=False):
        padding = dst.untyped_storage().data_ptr() == staging.pad_dst.untyped_storage().data_ptr()
        copies.append(("pad" if padding else "copy", dst.nbytes))
        return deferred_copy(dst, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    x = torch.randn(2, 50_000)  # 400 kB, half of it to the other rank
    out = torch.zeros_like(x)
    gpu.deferring = True
    link.all_to_all_single(out, x)
    gpu.deferring = False
    gpu.run()
    assert torch.equal(out, x)
    moved = x.nbytes // 2
    pieces = chunk_plan(moved, moved, 64 << 10, staging.min_pieces)
    padded = [n for kind, n in copies if kind == "pad"]
    own_part = 1  # the row kept on the rank: one same-device copy, before the link's
    assert sum(padded) == (round(2.5 * moved) - pieces[-1][1] if bandwidth else 0)
    assert all(kind == "pad" for kind, _ in copies[own_part : own_part + len(padded)])
    assert len(copies) == own_part + len(padded) + 2 * len(pieces)


def test_pacing_corrects_the_padding_until_a_measurement_lands_near_the_set_bandwidth(
    simulated_gpu, monkeypatch, caplog
):
    """A noisy padded measurement (19 GB/s of 25) is corrected by the next ones, not left as the
    padding: after it, the padding follows what the copies then reach, and stops once within 5%."""
    measured = iter([40.0, 19.0, 32.9, 25.4, 25.0, 24.0])  # copy engines, three padded, two reported
    monkeypatch.setattr(link_module._CudaStaging, "_measure", lambda self, nbytes: next(measured))
    with caplog.at_level("WARNING", logger="ubatch.link"):
        staging = HostLink(2, 25.0, device="cpu", chunk_bytes=64 << 10)._staging()
    assert caplog.text == ""  # 24 of 25 at the largest payload is within the tolerance
    ratio = (40 / 25) * (19 / 25) * (32.9 / 25) - 1  # each correction scales 1 + pad_ratio by measured / set
    assert staging.pad_ratio == pytest.approx(ratio)
    assert list(staging.reached_gbps.values()) == [25.0, 24.0]
    assert next(measured, None) is None


def test_pacing_stops_correcting_after_the_last_allowed_measurement_and_says_it_missed(
    simulated_gpu, monkeypatch, caplog
):
    measured = iter([40.0] + [30.0] * link_module.PAD_CORRECTIONS + [30.0, 30.0])
    monkeypatch.setattr(link_module._CudaStaging, "_measure", lambda self, nbytes: next(measured))
    with caplog.at_level("WARNING", logger="ubatch.link"):
        staging = HostLink(2, 25.0, device="cpu", chunk_bytes=64 << 10)._staging()
    assert staging.pad_ratio == pytest.approx(1.6 * 1.2**link_module.PAD_CORRECTIONS - 1)
    assert next(measured, None) is None
    assert "calibrated to 30.0 GB/s" in caplog.text and "where 25.0 was expected" in caplog.text


def test_a_paced_link_cuts_payloads_into_the_chunks_its_padding_can_cover():
    assert len(chunk_plan(8 << 20, 8 << 20, 16 << 20, link_module.PACED_MIN_PIECES)) == 2
    assert len(chunk_plan(64 << 20, 64 << 20, 16 << 20, link_module.PACED_MIN_PIECES)) == 4
    assert len(chunk_plan(100 << 20, 100 << 20, 16 << 20, link_module.PACED_MIN_PIECES)) == 7


@pytest.mark.parametrize("op", ["all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"])
def test_cuda_own_part_goes_on_the_stream_given_and_nothing_else_does(simulated_gpu, op):
    """The rank's own part (a same-device copy, a kernel) is queued on ``own_part_stream``, the
    link's copies on the current stream and the side stream, and every order keeps the values."""
    gpu = simulated_gpu
    link = HostLink(2, None, device="cpu", chunk_bytes=64 << 10)
    link.prepare("cpu")
    link._staging()
    producer = type(gpu.current)()
    x = torch.randn(2, 30_000)
    out = torch.zeros_like(x)
    gpu.deferring = True
    getattr(link, op)(out, x, own_part_stream=producer)
    gpu.deferring = False
    assert len(producer.queue) == 1
    queued_elsewhere = sum(len(s.queue) for s in gpu.streams if s is not producer)
    producer.queue[0][0]()  # the own part alone: the first row, nothing of the second
    assert torch.equal(out[0], x[0]) and not out[1].any()
    producer.queue.clear()
    gpu.run()
    assert torch.equal(out, x) and queued_elsewhere > 1


# --- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_values_unchanged_and_bytes_moved(world):
    link = HostLink(world)
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, cols, dtype in [(1, 1, torch.float32), (7, 143, torch.bfloat16), (1, 3 << 18, torch.float32)]:
        x = torch.randn(world * rows, cols, device="cuda", generator=g).to(dtype)
        before = link.bytes_moved
        results, _ = _run_every_op(link, x)
        torch.cuda.synchronize()
        for got in results:
            assert torch.equal(got, x)
        n = x.nbytes
        assert link.bytes_moved - before == 2 * (world - 1) * n // world + 3 * (n - n // world)


@pytest.mark.cuda
def test_cuda_eager_collectives_do_not_sync_once_prepared():
    link = HostLink(2, 25.0)
    link.prepare()
    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results, works = _run_every_op(link, x.view(2, -1), async_op=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(w.is_completed() and w.wait() for w in works)
    for got in results:
        assert torch.equal(got, x.view(2, -1))


@pytest.mark.cuda
@pytest.mark.parametrize("bandwidth", [None, 25.0])
def test_cuda_graph_capture_and_replay(bandwidth):
    link = HostLink(4, bandwidth)
    link.prepare()
    replay_captured_collectives(link, torch.randn(4, 3 << 18, device="cuda"))  # 12 MiB; the all-reduce moves 18


@pytest.mark.cuda
def test_cuda_first_use_inside_a_capture_asks_for_prepare():
    link = HostLink(2)
    x = torch.randn(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare"):
        with torch.cuda.graph(graph):
            link.all_reduce(x)
    link.all_reduce(x)  # usable after the failed capture
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_link_on_the_schedulers_comm_stream():
    link = HostLink(2)
    sched = UBatchScheduler(2, "cuda")
    inputs = [torch.randn(2, 1 << 20, device="cuda") for _ in range(2)]
    outputs = [torch.zeros_like(x) for x in inputs]

    def task(i):
        def run():
            current_ubatch().run_collective(
                "all_to_all_single",
                lambda is_async: link.all_to_all_single(outputs[i], inputs[i], async_op=is_async),
                None,
            )
            return outputs[i] * 2

        return run

    got = sched.run([task(0), task(1)])
    torch.cuda.synchronize()
    for g, x in zip(got, inputs, strict=True):
        assert torch.equal(g, x * 2)


@pytest.mark.cuda
@pytest.mark.parametrize("capture", [False, True])
def test_cuda_an_input_dropped_after_an_async_start_still_arrives(capture):
    """The MoE dispatch's pattern: a buffer made on one stream, sent from another (the comm
    stream), dropped at once, and its maker goes on allocating and writing while the slow link
    still reads it: the output must be what was sent, eager and replayed."""
    link = HostLink(2, 1.0)  # 8 MiB at 1 GB/s: ~4 ms in flight
    link.prepare()
    maker, comm_stream = torch.cuda.Stream(), torch.cuda.Stream()
    sent = torch.arange(1 << 21, device="cuda", dtype=torch.float32)
    out = torch.zeros_like(sent)
    overwritten = []

    def step():
        origin = torch.cuda.current_stream()
        maker.wait_stream(origin)
        with torch.cuda.stream(maker):
            x = sent.clone()
            comm_stream.wait_stream(maker)
            with torch.cuda.stream(comm_stream):
                link.all_to_all_single(out, x, async_op=True)
            del x
            overwritten.append(torch.full_like(sent, -1.0))  # the freed block, if nothing holds it
            maker.wait_stream(comm_stream)
        origin.wait_stream(maker)

    torch.cuda.synchronize()
    if capture:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        out.zero_()
        graph.replay()
    else:
        step()
    torch.cuda.synchronize()
    assert torch.equal(out, sent)


def test_link_bandwidth_script_table_and_cpu_exit(capsys):
    spec = importlib.util.spec_from_file_location(
        "link_bandwidth", Path(__file__).resolve().parents[1] / "scripts" / "link_bandwidth.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    row = dict(
        bandwidth_set_gbps=25.0,
        payload_mb=64,
        alone_gbps=24.0,
        beside_gemm_gbps=23.0,
        gemm_slowdown=1.08,
        host_bound=False,
    )
    script._print_table([row, {**row, "bandwidth_set_gbps": None, "payload_mb": 1, "host_bound": True}])
    out = capsys.readouterr().out
    assert "-4% vs set" in out and "host-bound" in out
    if not torch.cuda.is_available():
        assert script.main([]) == 2


@pytest.mark.cuda
def test_cuda_inside_a_ubatch_the_own_part_is_copied_on_the_compute_stream(monkeypatch):
    """On the comm stream the own part's copy kernel would wait for SMs behind a persistent GEMM
    and hold up the link; ``ubatch.comm`` hands the stand-in the ubatch's compute stream."""
    from ubatch import comm

    link = HostLink(2, device="cuda")
    link.prepare()
    x = torch.randn(2, 1 << 16, device="cuda")
    out = torch.zeros_like(x)
    streams = {}
    real_copy = torch.Tensor.copy_

    def noting_copy(dst, src, non_blocking=False):
        streams.setdefault(dst.data_ptr(), torch.cuda.current_stream())
        return real_copy(dst, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", noting_copy)
    computes = []

    def task():
        computes.append(torch.cuda.current_stream())
        comm.all_to_all_single(out, x, group=link)
        return out.sum()

    sched = UBatchScheduler(1, "cuda")
    total = sched.run([task])[0]
    torch.cuda.synchronize()
    assert torch.equal(out, x) and torch.equal(total, x.sum())
    assert streams[out.data_ptr()] == computes[0] != sched.comm_stream
