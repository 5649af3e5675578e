"""SMPartition: validation and the degrade-to-none path on CPU; disjoint green partitions that run
two kernels concurrently (eager and in graph replay), the start-up self-check and the capped NCCL
communicator on GPUs. GPU thresholds are set for an H200 (132 SMs): a 16-SM comm partition beside
a 116-SM compute one hid 94% of a copy kernel there (benchmarks/h200x2/sm_h200x2.json); the tests
ask for 50%."""

from __future__ import annotations

import enum
import gc
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from ubatch import sm
from ubatch.sm import P2P_CHANNELS_ENV, GreenContextError, SMPartition, round_comm_sms

ROOT = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_sm", ROOT / "scripts" / "bench_sm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sm"] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- CPU: validation and degrade


@pytest.mark.parametrize("mode", ["green", "cooperative"])
def test_modes_degrade_to_none_on_cpu_with_one_warning(mode, caplog):
    with caplog.at_level(logging.WARNING, logger="ubatch.sm"):
        part = SMPartition(mode, 16, device="cpu")
        part.make_streams(2)
        part.self_check()
    assert part.mode == mode
    assert part.effective_mode == "none"
    assert "not a CUDA device" in part.reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and part.reason in warnings[0].getMessage()


def test_none_mode_is_not_a_degrade(caplog):
    with caplog.at_level(logging.WARNING, logger="ubatch.sm"):
        part = SMPartition("none", device="cpu")
    assert part.effective_mode == "none" and part.reason == ""
    assert not caplog.records


def test_unknown_mode_lists_the_modes():
    with pytest.raises(ValueError, match=r"unknown SM partition mode 'blue'.*none, green, cooperative"):
        SMPartition("blue")


@pytest.mark.parametrize("value", [0, -3])
def test_comm_sms_below_one_is_out_of_range(value):
    with pytest.raises(ValueError, match=rf"comm_sms={value} is out of range.*\[1, "):
        SMPartition("green", value, device="cpu")


@pytest.mark.parametrize("value", [1.5, "8", True])
def test_comm_sms_must_be_an_int(value):
    with pytest.raises(ValueError, match=r"comm_sms must be an int in \[1, "):
        SMPartition("green", value, device="cpu")


def test_comm_sms_at_or_above_the_device_sm_count_is_out_of_range(monkeypatch):
    monkeypatch.setattr(sm, "_device_sm_count", lambda device: 132)
    with pytest.raises(ValueError, match=r"comm_sms=132 is out of range: it must be in \[1, 131\]"):
        SMPartition("green", 132, device="cpu")
    with pytest.raises(ValueError, match=r"decode_comm_sms=200 is out of range: it must be in \[1, 131\]"):
        SMPartition("green", 16, device="cpu", decode_comm_sms=200)
    assert SMPartition("green", 131, device="cpu").comm_sms_for() == 131


def test_per_phase_comm_sms_fall_back_to_the_default():
    part = SMPartition("cooperative", 24, device="cpu", prefill_comm_sms=8)
    assert (part.comm_sms_for(), part.comm_sms_for("prefill"), part.comm_sms_for("decode")) == (24, 8, 24)
    assert SMPartition(device="cpu").comm_sms_for() == sm.DEFAULT_COMM_SMS
    with pytest.raises(ValueError, match="unknown phase 'train'"):
        part.comm_sms_for("train")


def test_none_make_streams_on_cpu_gives_the_schedulers_defaults():
    part = SMPartition("none", device="cpu")
    assert part.make_streams(3) == (None, None)
    assert part.make_streams(1, phase="decode") == (None, None)
    assert part.partition_sms() is None
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="num_ubatches must be an int >= 1"):
            part.make_streams(bad)


@pytest.mark.parametrize("mode", ["none", "cooperative"])
def test_comm_group_passes_the_group_through_when_not_cooperative(mode):
    group = object()
    part = SMPartition(mode, 8, device="cpu")
    assert part.comm_group(group) is group
    assert part.comm_group(None, phase="prefill") is None
    part.setup([group, None])


@pytest.mark.parametrize("mode", ["none", "green", "cooperative"])
def test_compute_context_is_a_no_op_where_the_mode_degraded(mode):
    before = torch._C._get_sm_carveout_experimental()
    part = SMPartition(mode, 8, device="cpu")
    with part.compute_context():
        assert torch._C._get_sm_carveout_experimental() == before
    assert torch._C._get_sm_carveout_experimental() == before


def test_round_comm_sms_respects_minimum_and_alignment():
    assert round_comm_sms(1, 8, 2) == 8
    assert round_comm_sms(9, 8, 2) == 10
    assert round_comm_sms(10, 8, 8) == 16
    assert round_comm_sms(16, 0, 0) == 16


# ---------------------------------------------------------------- CPU: green path on a fake driver


class _CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION = 914


def _fake_driver(total=132, min_partition=8, alignment=8, fail=None):
    """The cuda.bindings.driver calls the green path makes, returning (CUresult, *outputs)."""
    calls = []

    def resource(n):
        return SimpleNamespace(
            sm=SimpleNamespace(smCount=n, minSmPartitionSize=min_partition, smCoscheduledAlignment=alignment)
        )

    def call(name, *outputs):
        def fn(*args):
            calls.append((name, args))
            return (
                (_CUresult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION,)
                if name == fail
                else (_CUresult.CUDA_SUCCESS, *outputs)
            )

        return fn

    def split(nb, res, flags, count):
        calls.append(("cuDevSmResourceSplitByCount", (nb, res, flags, count)))
        if fail == "cuDevSmResourceSplitByCount":
            return _CUresult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, None, 0, None
        return _CUresult.CUDA_SUCCESS, [resource(count)], 1, resource(total - count)

    return SimpleNamespace(
        calls=calls,
        CUresult=_CUresult,
        CUdevResourceType=SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1),
        CUgreenCtxCreate_flags=SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1),
        CUstream_flags=SimpleNamespace(CU_STREAM_NON_BLOCKING=1),
        cuInit=call("cuInit"),
        cuDriverGetVersion=call("cuDriverGetVersion", 13000),
        cuDeviceGet=call("cuDeviceGet", "dev"),
        cuDeviceGetDevResource=call("cuDeviceGetDevResource", resource(total)),
        cuDevSmResourceSplitByCount=split,
        cuDevResourceGenerateDesc=call("cuDevResourceGenerateDesc", "desc"),
        cuGreenCtxCreate=call("cuGreenCtxCreate", "ctx"),
        cuGreenCtxDestroy=call("cuGreenCtxDestroy"),
        cuStreamSynchronize=call("cuStreamSynchronize"),
        cuStreamDestroy=call("cuStreamDestroy"),
    )


def test_green_split_rounds_comm_sms_up_to_the_driver_granularity():
    driver = _fake_driver(total=132, min_partition=8, alignment=8)
    green = sm._GreenContexts(driver, 0, 10)
    assert (green.compute_sms, green.comm_sms, green.total_sms) == (116, 16, 132)
    split = [args for name, args in driver.calls if name == "cuDevSmResourceSplitByCount"]
    assert split[0][3] == 16
    assert [name for name, _ in driver.calls].count("cuGreenCtxCreate") == 2
    del green
    assert [name for name, _ in driver.calls].count("cuGreenCtxDestroy") == 2


def test_green_cuda_error_names_the_call_and_the_code():
    driver = _fake_driver(fail="cuGreenCtxCreate")
    with pytest.raises(
        GreenContextError, match="cuGreenCtxCreate failed with CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"
    ):
        sm._GreenContexts(driver, 0, 16)


def test_green_split_leaving_no_compute_sms_is_an_error():
    with pytest.raises(GreenContextError, match="leaving no SM of 16 for compute"):
        sm._GreenContexts(_fake_driver(total=16, min_partition=8, alignment=8), 0, 12)


@pytest.fixture
def fake_hopper(monkeypatch):
    """A CUDA device as SMPartition sees it (capability 9.0, 132 SMs), driven by a fake driver."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(sm, "_device_sm_count", lambda device: 132)
    monkeypatch.setattr(sm, "_activate_primary_context", lambda device: None)

    def use(driver=None, capability=(9, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        if driver is None:
            monkeypatch.setattr(
                sm, "_load_driver", lambda: (_ for _ in ()).throw(ImportError("No module named 'cuda'"))
            )
        else:
            monkeypatch.setattr(sm, "_load_driver", lambda: driver)
        return driver

    return use


def test_green_builds_one_disjoint_pair_per_distinct_phase_budget(fake_hopper, caplog):
    driver = fake_hopper(_fake_driver())
    with caplog.at_level(logging.INFO, logger="ubatch.sm"):
        part = SMPartition("green", 16, "cuda:0", decode_comm_sms=8)
    assert part.effective_mode == "green" and part.reason == ""
    assert part.partition_sms() == (116, 16) and part.partition_sms("decode") == (124, 8)
    assert [name for name, _ in driver.calls].count("cuGreenCtxCreate") == 4
    assert "116 compute SMs, 16 comm SMs" in caplog.text


def test_green_contexts_are_made_once_per_size_and_outlive_their_partitions(fake_hopper):
    """A dropped partition must not destroy streams the caching allocator may still know (a
    block used on one records an event on it when freed): partitions of one size share a kept pair."""
    driver = fake_hopper(_fake_driver())
    first = SMPartition("green", 16, "cuda:0")
    assert SMPartition("green", 16, "cuda:0")._green[16] is first._green[16]
    del first
    gc.collect()
    names = [name for name, _ in driver.calls]
    assert names.count("cuGreenCtxCreate") == 2 and "cuGreenCtxDestroy" not in names
    SMPartition("green", 8, "cuda:0")
    assert [name for name, _ in driver.calls].count("cuGreenCtxCreate") == 4, "another size, another pair"


def test_green_carves_every_sm_outside_the_compute_partition_out_of_gemms(fake_hopper):
    fake_hopper(_fake_driver())
    part = SMPartition("green", 16, "cuda:0", decode_comm_sms=8)
    assert part.carveout_for() == 16 and part.carveout_for("decode") == 8
    before = torch._C._get_sm_carveout_experimental()
    with part.compute_context(phase="decode"):
        assert torch._C._get_sm_carveout_experimental() == 8
    assert torch._C._get_sm_carveout_experimental() == before


def test_no_carveout_without_a_partition():
    assert SMPartition("none", 8, device="cpu").carveout_for() is None
    assert SMPartition("green", 8, device="cpu").carveout_for() is None  # degraded: no partition


@pytest.mark.parametrize(
    "driver_kwargs, capability, reason",
    [
        (
            dict(fail="cuGreenCtxCreate"),
            (9, 0),
            "cuGreenCtxCreate failed with CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION",
        ),
        (dict(fail="cuDevSmResourceSplitByCount"), (9, 0), "cuDevSmResourceSplitByCount failed"),
        (dict(), (8, 0), "compute capability 8.0 < 9.0"),
        (None, (9, 0), "cuda.bindings is not installed"),
    ],
)
def test_green_degrades_on_driver_errors_and_old_hardware(fake_hopper, caplog, driver_kwargs, capability, reason):
    fake_hopper(None if driver_kwargs is None else _fake_driver(**driver_kwargs), capability)
    with caplog.at_level(logging.WARNING, logger="ubatch.sm"):
        part = SMPartition("green", 16, "cuda:0")
    assert part.effective_mode == "none" and reason in part.reason
    assert part.partition_sms() is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_green_degrades_on_a_driver_older_than_cuda_12_4(fake_hopper):
    driver = _fake_driver()
    driver.cuDriverGetVersion = lambda: (_CUresult.CUDA_SUCCESS, 12020)
    fake_hopper(driver)
    part = SMPartition("green", 16, "cuda:0")
    assert part.effective_mode == "none" and "CUDA 12.2 < 12.4" in part.reason


@pytest.mark.parametrize(
    "times, passes",
    [((1.0, 7.0, 7.1), True), ((1.0, 1.5, 7.0), False), ((1.0, 7.0, 1.2), False)],
    ids=["real", "eager-not-slower", "graph-not-slower"],
)
def test_self_check_degrades_when_the_small_partition_is_not_slower(fake_hopper, monkeypatch, caplog, times, passes):
    fake_hopper(_fake_driver())
    part = SMPartition("green", 16, "cuda:0")
    monkeypatch.setattr(sm, "_gemm_times", lambda green, size, device: times)
    with caplog.at_level(logging.WARNING, logger="ubatch.sm"):
        assert part.self_check() is passes
    assert part.effective_mode == ("green" if passes else "none")
    assert ("the partition is not real" in part.reason) is not passes


# ---------------------------------------------------------------- CPU: the benchmark's pure parts


def test_bench_hidden_fraction_and_interleave():
    bench = _load_bench()
    assert bench.hidden_fraction(10.0, 4.0, 10.0) == 1.0
    assert bench.hidden_fraction(10.0, 4.0, 14.0) == 0.0
    assert bench.hidden_fraction(10.0, 4.0, 12.0) == pytest.approx(0.5)
    assert bench.hidden_fraction(10.0, 4.0, 20.0) == 0.0
    assert bench.hidden_fraction(0.0, 4.0, 4.0) == 0.0
    order = bench.interleave([2, 4])
    assert order == [1, 0, 1, 1, 0, 1]


def test_bench_arguments_are_checked():
    bench = _load_bench()
    args = bench.parse_args(["--modes", "none,green", "--comm-sms", "8,16", "--comm", "copy"])
    assert args.modes == ["none", "green"] and args.comm_sms == [8, 16] and args.comm == ["copy"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "purple"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--comm", "broadcast"])


def test_bench_dry_run_prints_a_table_and_writes_json(tmp_path, capsys):
    bench = _load_bench()
    out = tmp_path / "sm.json"
    rows = bench.main(["--dry-run", "--out", str(out), "--comm-sms", "8,16"])
    cases = [(r.mode, r.comm_sms) for r in rows]
    assert cases == [("none", None), ("green", 8), ("green", 16), ("cooperative", 8), ("cooperative", 16)]
    assert all(r.comm == "copy" and r.effective_mode == "none" and 0.0 <= r.hidden <= 1.0 for r in rows)
    assert all(r.comm_stretch > 0 for r in rows)
    table = capsys.readouterr().out
    assert table.startswith("| comm | mode |") and table.count("\n| copy |") == len(rows)
    assert "| comm stretch |" in table.splitlines()[0]
    report = json.loads(out.read_text())
    assert report["config"]["world_size"] == 1 and len(report["rows"]) == len(rows)
    assert report["self_checks"]["green:8"]["reason"]


# ---------------------------------------------------------------- GPU (H200)


def _overlap_jobs(compute_stream, comm_stream, size=4096, reps=20):
    """A long bf16 GEMM loop for the compute stream and an elementwise copy loop sized to match it."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    src = torch.randn(64 << 20, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def gemms():
        for _ in range(reps):
            torch.mm(a, a, out=c)

    def copy_once():
        torch.mul(src, 1, out=dst)

    gemm_ms = _alone(compute_stream, gemms)
    copy_ms = _alone(comm_stream, copy_once)
    copy_reps = max(1, round(gemm_ms / copy_ms))

    def copies():
        for _ in range(copy_reps):
            copy_once()

    return gemms, copies


def _alone(stream, fn):
    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def _concurrent(streams_and_fns):
    """Launch each fn on its stream after a common start; each one's (start, end) in ms from it."""
    origin = torch.cuda.current_stream()
    zero = torch.cuda.Event(enable_timing=True)
    zero.record(origin)
    marks = []
    for stream, fn in streams_and_fns:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_event(zero)
        with torch.cuda.stream(stream):
            start.record(stream)
            fn()
            end.record(stream)
        marks.append((start, end))
    torch.cuda.synchronize()
    return [(zero.elapsed_time(s), zero.elapsed_time(e)) for s, e in marks]


def _overlap_share(a, b):
    """How much of the shorter interval lies inside the other."""
    inter = min(a[1], b[1]) - max(a[0], b[0])
    return max(0.0, inter) / min(a[1] - a[0], b[1] - b[0])


def _green(comm_sms=16):
    part = SMPartition("green", comm_sms, "cuda")
    assert part.effective_mode == "green", f"green contexts should work on an H200 with cuda-bindings: {part.reason}"
    return part


@pytest.mark.cuda
def test_green_partition_gives_disjoint_streams():
    part = _green(16)
    compute, comm = part.make_streams(3)
    handles = {s.cuda_stream for s in compute} | {comm.cuda_stream}
    assert len(compute) == 3 and len(handles) == 4, "one stream per ubatch plus the comm stream, all distinct"
    compute_sms, comm_sms = part.partition_sms()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    assert comm_sms >= 16 and compute_sms >= 1 and compute_sms + comm_sms <= total, (
        f"split {compute_sms}/{comm_sms} of {total} SMs (H200: 116/16 expected)"
    )


@pytest.mark.cuda
def test_green_rounds_a_tiny_comm_budget_up():
    part = _green(1)
    compute_sms, comm_sms = part.partition_sms()
    assert comm_sms >= 1 and compute_sms + comm_sms <= torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.cuda
def test_kernels_on_disjoint_partitions_overlap_eagerly():
    part = _green(16)
    (compute,), comm = part.make_streams(1)
    gemms, copies = _overlap_jobs(compute, comm)
    _concurrent([(compute, gemms), (comm, copies)])  # warm-up
    g, c = _concurrent([(compute, gemms), (comm, copies)])
    share = _overlap_share(g, c)
    assert share >= 0.5, f"GEMM {g} and copy {c} (ms) should run concurrently on 116/16 H200 SMs; overlap {share:.0%}"


@pytest.mark.cuda
def test_kernels_on_disjoint_partitions_overlap_in_graph_replay():
    part = _green(16)
    (compute,), comm = part.make_streams(1)
    gemms, copies = _overlap_jobs(compute, comm)
    graphs = []
    for stream, fn in ((compute, gemms), (comm, copies)):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
        graphs.append(graph)
    jobs = [(compute, graphs[0].replay), (comm, graphs[1].replay)]
    _concurrent(jobs)
    g, c = _concurrent(jobs)
    share = _overlap_share(g, c)
    assert share >= 0.5, f"replayed GEMM {g} and copy {c} (ms) should overlap on 116/16 H200 SMs; overlap {share:.0%}"


@pytest.mark.cuda
def test_one_graph_forked_across_partitions_hides_the_copy():
    part = _green(16)
    (compute,), comm = part.make_streams(1)
    gemms, copies = _overlap_jobs(compute, comm)
    gemm_ms, copy_ms = _alone(compute, gemms), _alone(comm, copies)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=compute):
        comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            copies()
        gemms()
        compute.wait_stream(comm)
    both_ms = _alone(compute, graph.replay)
    hidden = (gemm_ms + copy_ms - both_ms) / min(gemm_ms, copy_ms)
    assert hidden >= 0.5, (
        f"one graph forked into both partitions: GEMM {gemm_ms:.2f} + copy {copy_ms:.2f} -> {both_ms:.2f} ms, "
        f"hidden {hidden:.0%} (H200 116/16)"
    )


@pytest.mark.cuda
def test_self_check_passes_on_a_real_partition():
    part = _green(16)
    assert part.self_check(), f"a 16-SM partition of an H200 should slow a GEMM >= 2x: {part.reason}"
    assert part.effective_mode == "green"


@pytest.mark.cuda
def test_cooperative_compute_context_sets_and_restores_the_carveout():
    part = SMPartition("cooperative", 24, "cuda")
    assert part.effective_mode == "cooperative", part.reason
    before = torch._C._get_sm_carveout_experimental()
    with part.compute_context():
        assert torch._C._get_sm_carveout_experimental() == 24
    assert torch._C._get_sm_carveout_experimental() == before


@pytest.mark.cuda
def test_green_compute_context_sizes_gemms_to_the_compute_partition():
    part = _green(16)
    compute_sms, _ = part.partition_sms()
    with part.compute_context():
        assert torch._C._get_sm_carveout_experimental() == part.total_sms - compute_sms


def _cooperative_body(rank, world_size):
    part = SMPartition("cooperative", 16, torch.device("cuda", rank), decode_comm_sms=8)
    os.environ.pop(P2P_CHANNELS_ENV, None)
    part.setup([None])
    group = part.comm_group(None)
    assert group is not None and group is not dist.group.WORLD, "cooperative mode makes a dedicated communicator"
    assert part.comm_group(None) is group, "the communicator is cached per group and cap"
    assert part.comm_group(None, phase="decode") is not group, "a different cap gets its own communicator"
    assert P2P_CHANNELS_ENV not in os.environ, "the P2P channel variable is restored"
    assert dist.get_world_size(group) == world_size
    t = torch.full((1024,), float(rank + 1), device="cuda")
    dist.all_reduce(t, group=group)
    assert torch.all(t == sum(range(1, world_size + 1))).item()
    out = torch.empty(world_size * 4, device="cuda")
    dist.all_to_all_single(out, torch.full((world_size * 4,), float(rank), device="cuda"), group=group)
    assert out.view(world_size, 4)[:, 0].tolist() == [float(r) for r in range(world_size)]


@pytest.mark.multigpu
def test_cooperative_mode_uses_a_dedicated_nccl_communicator():
    run_distributed(_cooperative_body, 2, backend="nccl", timeout_s=180)
