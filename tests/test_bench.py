"""ubatch-bench on CPU, single process and under torchrun: --quick writes a consistent report
and a timeline plot; --graphs refuses to run without CUDA; the kernel arithmetic behind --graphs'
hidden fraction and the comm stretch; the auto policy picks nothing for graph replays."""

import json
from argparse import Namespace

import pytest
import torch

from ubatch.bench import _auto_policy, format_table, main, parse_args
from ubatch.bench.kernels import (Kernel, comm_durations_us, gathered_transfer_ms, hidden_kernel_fraction, kernel_costs,
                                  kernels_in_trace, transfer_ms)
from ubatch.bench.schedule import schedule_estimates, step_ms


def test_quick_run_writes_report_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "report.json", tmp_path / "timeline.png"
    main(["--quick", "--device", "cpu", "--out", str(out), "--plot", str(plot)])
    report = json.loads(out.read_text())
    assert report["environment"]["torch"] and report["results"]
    for r in report["results"]:
        assert abs(r["speedup"] - r["baseline_ms"] / r["ubatched_ms"]) < 1e-2
        assert r["ideal_speedup"] >= 1.0 and r["compute_ms"] > 0
        assert r["graphs"] is False and r["eager_baseline_ms"] == r["baseline_ms"]
        if r["comm_ms"] > 0:
            assert abs(r["hideable_comm_fraction"] - min(r["compute_ms"], r["comm_ms"]) / r["comm_ms"]) < 1e-3
        else:
            assert r["hideable_comm_fraction"] is None
        assert r["comm_stretch"] is None and r["ubatched_comm_ms"] is None, "host-observed on CPU: not reported"
        assert r["schedule_model_ms"] == pytest.approx(
            step_ms(r["num_ubatches"], report["args"]["layers"] or 2, r["compute_ms"], r["comm_ms"], 0.2), abs=1e-3)
        assert r["schedule_model_stretched_ms"] is None, "no measured stretch, no stretched estimate"
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert "speedup" in capsys.readouterr().out


def test_mixed_workload_and_chrome_trace(tmp_path):
    out, trace = tmp_path / "report.json", tmp_path / "trace.json"
    main(["--device", "cpu", "--workload", "mixed", "--tokens", "96", "--prompt-len", "32", "--context-len", "8",
          "--num-ubatches", "2,3", "--warmup", "0", "--repeats", "1", "--out", str(out), "--chrome-trace", str(trace)])
    results = json.loads(out.read_text())["results"]
    assert [r["num_ubatches"] for r in results] == [2, 3] and all(r["workload"] == "mixed" for r in results)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} >= {"ubatch 0 compute", "ubatch 1 compute"}


def test_graphs_on_cpu_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--graphs", "--device", "cpu", "--workload", "decode"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--graphs" in err and "CUDA" in err and "--device cpu" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where torch sees no GPU")
def test_graphs_without_a_gpu_is_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        main(["--graphs", "--quick"])
    assert "torch sees none" in capsys.readouterr().err


def test_graphs_refuse_the_scheduler_timeline_plot(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--graphs", "--plot", "timeline.png"])
    assert "--plot" in capsys.readouterr().err


def _k(name, start, end):
    return Kernel(name, start, end)


def test_hidden_kernel_fraction_counts_comm_under_the_union_of_compute():
    kernels = [
        _k("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 0.0, 10.0),
        _k("ampere_bf16_gemm", 2.0, 4.0),
        _k("flash_fwd", 3.0, 6.0),  # overlaps the GEMM: the union [2, 6] counts once
        _k("silu_kernel", 8.0, 12.0),  # half outside the collective
        _k("NCCL_AllReduce_RING", 20.0, 30.0),  # case-insensitive; nothing runs beside it
    ]
    assert hidden_kernel_fraction(kernels) == pytest.approx((4.0 + 2.0) / 20.0)
    assert hidden_kernel_fraction(kernels[:4]) == pytest.approx(0.6)
    assert hidden_kernel_fraction([_k("ncclKernel", 1.0, 2.0), _k("gemm", 0.0, 5.0)]) == pytest.approx(1.0)
    assert hidden_kernel_fraction([_k("ncclKernel", 1.0, 2.0), _k("gemm", 2.0, 5.0)]) == 0.0


def test_kernel_costs_are_busy_time_per_kind():
    kernels = [_k("gemm", 0.0, 4000.0), _k("flash", 2000.0, 5000.0), _k("ncclKernel", 5000.0, 7000.0),
               _k("ncclKernel", 6000.0, 9000.0)]
    assert kernel_costs(kernels) == pytest.approx((5.0, 4.0))
    assert kernel_costs([]) == (0.0, 0.0)


def test_transfer_is_each_collectives_shortest_kernel_over_the_ranks():
    rank0 = [_k("ncclKernel", 500.0, 800.0), _k("gemm", 0.0, 500.0), _k("ncclKernel", 0.0, 400.0)]
    rank1 = [_k("ncclKernel", 100.0, 400.0), _k("ncclKernel", 600.0, 800.0)]
    assert comm_durations_us(rank0) == [400.0, 300.0], "in start order, compute left out"
    # collective 0: rank 0 spun 100 us for rank 1; collective 1: rank 1 arrived first
    assert transfer_ms([comm_durations_us(rank0), comm_durations_us(rank1)]) == pytest.approx(0.5)
    assert transfer_ms([[], []]) == 0.0
    with pytest.raises(ValueError, match=r"different numbers of communication kernels: \[2, 1\]"):
        transfer_ms([[1.0, 2.0], [1.0]])


def _gathered_transfer_body(rank, world_size):
    durations = [[300.0, 250.0], [200.0, 400.0]][rank]
    kernels = [_k("ncclKernel", 1000.0 * i, 1000.0 * i + d) for i, d in enumerate(durations)]
    assert gathered_transfer_ms(kernels) == pytest.approx(0.45)
    assert gathered_transfer_ms([_k("gemm", 0.0, 5.0)]) is None, "no communication kernels"


def test_transfer_is_gathered_over_the_ranks():
    from tests.dist_utils import run_distributed

    assert gathered_transfer_ms([_k("ncclKernel", 0.0, 5.0)]) is None, "one process: nothing to gather"
    run_distributed(_gathered_transfer_body, 2)


def test_speedup_bound_is_the_longer_of_split_compute_and_transfer():
    from ubatch.bench.measure import Measurement

    # unsplit 10 ms (C 6, M 4: ideal 1.667x); split compute busy 7 ms, its transfers 4.4 of 5 ms busy
    m = Measurement(10.0, 8.0, 6.0, 4.0, 0.5, [], eager_baseline_ms=10.0, ubatched_busy_ms=(7.0, 5.0),
                    transfer_ms=(4.0, 4.4))
    row = m.as_dict()
    assert row["transfer_stretch"] == pytest.approx(1.1) and row["comm_stretch"] == pytest.approx(1.25)
    assert row["speedup_bound"] == pytest.approx(10.0 / 7.0, abs=1e-4)
    assert row["efficiency_bound"] == pytest.approx((10.0 / 7.0 - 1) / (10.0 / 6.0 - 1), abs=1e-4)
    assert row["efficiency"] == pytest.approx(0.375)
    unknown = Measurement(10.0, 8.0, 6.0, 4.0, 0.5, [], eager_baseline_ms=10.0, ubatched_busy_ms=(7.0, 5.0)).as_dict()
    assert unknown["transfer_stretch"] is None and unknown["speedup_bound"] is None and unknown["efficiency_bound"] is None


def test_hidden_kernel_fraction_is_none_without_comm_kernels():
    assert hidden_kernel_fraction([_k("gemm", 0.0, 5.0), _k("elementwise", 5.0, 6.0)]) is None
    assert hidden_kernel_fraction([]) is None


def test_kernels_in_trace_keeps_only_kernel_events():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100.0, "dur": 5.5, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 101.0, "dur": 20.0, "tid": 9},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 90.0, "dur": 1.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "ts": 90.0, "dur": 50.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 95.0, "dur": 3.0},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "ts": 100.0},
        {"ph": "M", "name": "thread_name", "args": {"name": "stream 7"}},
    ]}
    assert kernels_in_trace(trace) == [Kernel("gemm", 100.0, 105.5), Kernel("ncclDevKernel_SendRecv", 101.0, 121.0)]
    assert kernels_in_trace({}) == []


def _graph_row(tokens, n, baseline, ubatched, at_capture):
    return {"tokens_per_rank": tokens, "num_ubatches": n, "graphs": True, "eager_baseline_ms": 9.0,
            "baseline_ms": baseline, "ubatched_ms": ubatched, "speedup": baseline / ubatched, "compute_ms": 1.0,
            "comm_ms": 1.0, "ideal_speedup": 2.0, "efficiency": None, "hidden_comm_fraction": None,
            "capture_time_ms": at_capture}


def test_auto_policy_for_graph_replays_picks_the_faster_graph_at_capture_time():
    results = [_graph_row(64, 2, 1.0, 1.5, {1: 1.1, 2: 1.4}),
               _graph_row(256, 2, 3.0, 2.0, {1: 3.1, 2: 2.6}), _graph_row(256, 3, 3.0, 2.5, {1: 3.0, 3: 2.4})]

    def measure_at(*_):
        raise AssertionError("graph rows need no calibration")

    auto = _auto_policy(Namespace(graphs=True, tokens=[64, 256]), results, measure_at, stages=4)
    assert "capture" in auto["note"]
    assert [(p["tokens_per_rank"], p["choice"], p["best"], p["auto_vs_best"]) for p in auto["points"]] == [
        (64, 1, 1, 1.0), (256, 3, 2, 0.8)], "a pick from the short timing may miss the measured best"
    assert "eager ms" in format_table(results).splitlines()[0]


def test_capacity_factor_reports_the_dropped_share_unsplit_and_ubatched(tmp_path):
    out = tmp_path / "report.json"
    common = ["--device", "cpu", "--tokens", "64", "--prompt-len", "32", "--warmup", "0", "--repeats", "1"]
    main([*common, "--num-experts", "4", "--capacity-factor", "0.6", "--out", str(out)])
    dropped = json.loads(out.read_text())["results"][0]["dropped_fraction"]
    assert set(dropped) == {"unsplit", "ubatched"}
    assert all(0.0 < share < 1.0 for share in dropped.values()), dropped  # one rank keeps 60% of its rows
    main([*common, "--out", str(out)])
    assert json.loads(out.read_text())["results"][0]["dropped_fraction"] is None  # worst case: none dropped


@pytest.mark.parametrize("argv, message", [
    (["--model", "dense", "--capacity-factor", "1"], "apply to --model moe"),
    (["--capacity-factor", "0"], "expected a positive number"),
    (["--num-experts", "-2"], "expected a positive integer"),
])
def test_model_overrides_refuse_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def _dropped_body(rank, world_size):
    import torch.distributed as dist

    from ubatch.bench.capacity import dropped_fractions
    from ubatch.bench.workload import make_step
    from ubatch.models import ModelConfig, build_model

    config = ModelConfig.preset("tiny-moe", capacity_factor=0.5)
    model = build_model(config, device="cpu", ep_group=dist.group.WORLD)
    step, _ = make_step(model, [16] * 4, seed=rank)
    shares = dropped_fractions(model, step, 2)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, shares)
    assert gathered[0] == gathered[1], "every rank reports the share over all ranks"
    assert all(0.0 < s < 1.0 for s in shares.values()), shares
    assert all(int(c) == 0 for c in model.overflow_counters().values()), "counters are left reset"


def test_dropped_share_is_summed_over_expert_parallel_ranks():
    from tests.dist_utils import run_distributed

    run_distributed(_dropped_body, 2)


def test_comm_stretch_is_the_ubatched_comm_busy_time_over_m():
    from ubatch.bench.measure import Measurement, _device_busy_ms
    from ubatch.trace import Interval

    timeline = [Interval(0, "compute", "c", 0.0, 4.0), Interval(0, "comm", "a2a", 4.0, 7.0),
                Interval(1, "compute", "c", 4.0, 8.0), Interval(1, "comm", "a2a", 6.5, 9.0)]
    busy = _device_busy_ms(timeline, torch.device("cuda"))
    assert busy == (8.0, 5.0), "overlapping intervals of one kind count once"
    assert _device_busy_ms(timeline, torch.device("cpu")) is None
    m = Measurement(10.0, 6.0, 8.0, 4.0, 0.5, timeline, eager_baseline_ms=10.0, ubatched_busy_ms=busy)
    row = m.as_dict()
    assert row["comm_stretch"] == 1.25 and row["ubatched_comm_ms"] == 5.0 and row["ubatched_compute_ms"] == 8.0
    assert Measurement(10.0, 6.0, 8.0, 0.0, None, [], eager_baseline_ms=10.0, ubatched_busy_ms=busy).comm_stretch is None


def _torchrun_bench(tmp_path, *args: str):
    from tests.dist_utils import torchrun

    out = tmp_path / "report.json"
    result = torchrun(2, "-m", "ubatch.bench", "--quick", "--out", str(out), *args, timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "outlived destroy_process_group" not in result.stderr, result.stderr[-3000:]
    assert result.stdout.count("M stretch") == 1, "only rank 0 prints the table"
    return json.loads(out.read_text())["results"]


def test_bench_under_torchrun_on_two_cpu_ranks(tmp_path):
    (r,) = _torchrun_bench(tmp_path, "--device", "cpu", "--attention-share", "0.5")
    assert r["world_size"] == 2 and r["comm_ms"] > 0, "two EP ranks exchange tokens"
    assert r["comm_stretch"] is None
    assert r["schedule_model_ms"] == pytest.approx(step_ms(2, 2, r["compute_ms"], r["comm_ms"], 0.5), abs=1e-3)


def test_schedule_estimates_bracket_a_stretched_split_step():
    plain = schedule_estimates(71.0, 126.0, 1.18, num_ubatches=2, layers=8)
    assert plain["schedule_model_ms"] == pytest.approx(step_ms(2, 8, 71.0, 126.0, 0.2), abs=1e-3)
    assert plain["schedule_model_ms"] < plain["schedule_model_stretched_ms"], "stretched collectives end later"
    assert 1.18 * 126.0 <= plain["schedule_model_stretched_ms"] < 71.0 + 126.0
    assert schedule_estimates(71.0, 126.0, 1.18, num_ubatches=1, layers=8)["schedule_model_stretched_ms"] == 197.0


def test_attention_backend_is_chosen_up_front_and_reported(tmp_path):
    out = tmp_path / "report.json"
    main(["--quick", "--attention", "torch", "--tokens", "32", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["environment"]["attention"] == "torch" and report["args"]["attention"] == "torch"
    with pytest.raises(RuntimeError, match="attention backend 'flash' needs a CUDA device, got cpu"):
        main(["--quick", "--attention", "flash", "--device", "cpu"])


def test_attention_share_outside_its_range_is_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--attention-share", "1.0"])
    assert "--attention-share must be in [0, 1), got 1.0" in capsys.readouterr().err


@pytest.mark.multigpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_bench_under_torchrun_on_two_gpus_reports_the_comm_stretch(tmp_path, graphs):
    (r,) = _torchrun_bench(tmp_path, "--preset", "tiny-moe", *(["--graphs"] if graphs else []))
    assert r["world_size"] == 2 and r["comm_ms"] > 0 and r["graphs"] is graphs
    assert r["ubatched_comm_ms"] > 0 and r["comm_stretch"] == pytest.approx(r["ubatched_comm_ms"] / r["comm_ms"], rel=1e-2)
    if graphs:  # the ranks' kernels gathered: transfer is NCCL time less waiting
        assert 0 < r["transfer_ms"] <= r["comm_ms"] * 1.001 and 0 < r["ubatched_transfer_ms"] <= r["ubatched_comm_ms"] * 1.001
        assert r["speedup_bound"] == pytest.approx(
            r["baseline_ms"] / max(r["ubatched_compute_ms"], r["ubatched_transfer_ms"]), rel=1e-2)
    else:
        assert r["transfer_ms"] is None and r["efficiency_bound"] is None
    expected = step_ms(r["num_ubatches"], 2, r["compute_ms"], r["comm_ms"], 0.2, r["comm_stretch"])
    assert r["schedule_model_stretched_ms"] == pytest.approx(expected, rel=1e-3)


_FAULTS_OF_A_REALLOCATED_BUFFER = """
import resource, sys, torch
from ubatch.bench.measure import keep_freed_cpu_memory
if sys.argv[1] == "keep":
    keep_freed_cpu_memory()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)  # 64 MB, touched, freed at once
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults[3:]))  # the heap settles first: in 30 runs, two of the first three faulted, never later
"""


def test_cpu_runs_reuse_freed_large_buffers_instead_of_faulting_them_in_again():
    """With glibc's defaults a freed 64 MB tensor goes back to the OS and the next one faults in
    16k fresh pages; the bench keeps it, so CPU timings do not reward smaller (split) buffers.
    Fresh interpreters: how a long-lived heap serves one allocation depends on its history."""
    import subprocess
    import sys

    def faults(mode: str) -> int:
        result = subprocess.run([sys.executable, "-c", _FAULTS_OF_A_REALLOCATED_BUFFER, mode],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return int(result.stdout.split()[-1])

    assert faults("default") > 10_000
    assert faults("keep") < 1_000
