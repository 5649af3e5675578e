"""ubatch-bench on CPU, single process and under torchrun: --quick writes a consistent report
and a timeline plot; --graphs refuses to run without CUDA; the kernel arithmetic behind --graphs'
hidden fraction and the comm stretch; the auto policy picks nothing for graph replays."""

import json
from pathlib import Path

import pytest
import torch

import ubatch.bench.report as report_module
from ubatch.bench.auto import auto_policy_report
from ubatch.bench.cli import main, parse_args
from ubatch.bench.kernels import (
    Kernel,
    comm_durations_us,
    gathered_transfer_ms,
    hidden_kernel_fraction,
    kernel_costs,
    kernels_in_trace,
    transfer_ms,
)
from ubatch.bench.measure import Measurement
from ubatch.bench.report import (
    CODE_VERSION_ENV,
    code_version,
    format_table,
    plot_title,
    policy_sentence,
    row_note,
    speedup_text,
)
from ubatch.bench.schedule import joined_step_ms, mode_step_ms, schedule_estimates, step_ms
from ubatch.context import CUDAGraphMode
from ubatch.overlap import OverlapMode

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_hides_communication_between_two_ranks_it_starts_and_explains_itself(tmp_path, capsys):
    """The quick path as a user runs it: two gloo ranks started here, medians with their spread,
    the policy's pick beside the measured best, and no speedup its own ideal rules out."""
    import signal

    out, plot = tmp_path / "report.json", tmp_path / "timeline.png"
    handler = signal.getsignal(signal.SIGINT)
    main(["--quick", "--device", "cpu", "--out", str(out), "--plot", str(plot)])
    assert signal.getsignal(signal.SIGINT) is handler, "the launcher's signal handlers are not left behind"
    report = json.loads(out.read_text())
    env = report["environment"]
    assert env["torch"] and env["world_size"] == 2 and env["host_cores"] >= 1
    assert env["host_memory_gib"] > 0 and 0 < env["process_rss_gib"] < env["host_memory_gib"]
    assert env["host_load_1m"] >= 0
    assert env["code"] == code_version()
    assert report["setup"] == {
        "preset": "tiny-moe",
        "kind": "moe",
        "num_layers": 2,
        "num_experts": 4,
        "launched": "here",
        "fuse_glue": None,
        "kv_block_size": 16,
    }
    assert report["results"]
    for r in report["results"]:
        assert r["world_size"] == 2 and r["comm_ms"] > 0, "two EP ranks exchange tokens"
        assert r["repeats"] == 15
        assert r["baseline_min_ms"] <= r["baseline_ms"] <= r["baseline_max_ms"]
        assert r["ubatched_min_ms"] <= r["ubatched_ms"] <= r["ubatched_max_ms"]
        assert abs(r["measured_speedup"] - r["baseline_ms"] / r["ubatched_ms"]) < 1e-2
        assert r["speedup_min"] <= r["measured_speedup"] <= r["speedup_max"]
        ideal = (r["compute_ms"] + r["comm_ms"]) / max(r["compute_ms"], r["comm_ms"])
        assert r["ideal_speedup"] == pytest.approx(ideal, abs=1e-3) and r["compute_ms"] > 0
        assert r["ruled_out"] == (r["speedup_min"] > r["ideal_speedup"])
        if r["ruled_out"]:
            assert r["speedup"] is None and r["efficiency"] is None
        else:
            assert r["speedup"] == r["measured_speedup"]
            assert r["speedup"] - r["ideal_speedup"] <= r["speedup"] - r["speedup_min"], "beyond its spread"
        assert r["graphs"] is False and r["eager_baseline_ms"] == r["baseline_ms"]
        assert abs(r["hideable_comm_fraction"] - min(r["compute_ms"], r["comm_ms"]) / r["comm_ms"]) < 1e-3
        assert r["comm_stretch"] is None and r["ubatched_comm_ms"] is None, "host-observed on CPU: not reported"
        assert r["schedule_model_ms"] == pytest.approx(
            step_ms(r["num_ubatches"], report["args"]["layers"] or 2, r["compute_ms"], r["comm_ms"], 0.2), abs=1e-3
        )
        assert r["schedule_model_stretched_ms"] is None, "no measured stretch, no stretched estimate"
    (point,) = report["auto"]["points"]
    assert point["tokens_per_rank"] == 256 and point["choice"] in (1, 2) and point["best"] in (1, 2)
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "expert-parallel over 2 gloo ranks started by this run" in printed
    assert "speedup" in printed and "What the columns mean" in printed
    assert f"measured best is {point['best']}" in printed
    assert (
        "auto keeps the 256-token step whole" if point["choice"] == 1 else "auto splits the 256-token step in 2"
    ) in printed


def _rows(baseline=(10.0, 10.5, 9.5), ubatched=(8.2, 8.0, 8.4)):
    """A row as the bench reports it from these timed rounds, with an ideal of 1.25x (C 8, M 2)."""
    import statistics

    m = Measurement(
        statistics.median(baseline),
        statistics.median(ubatched),
        8.0,
        2.0,
        0.5,
        [],
        eager_baseline_ms=statistics.median(baseline),
        baseline_samples_ms=baseline,
        ubatched_samples_ms=ubatched,
    )
    return {"tokens_per_rank": 256, "num_ubatches": 2, "world_size": 2, **m.as_dict()}


def test_a_speedup_its_ideal_rules_out_is_flagged_not_reported():
    plausible = _rows()
    assert not plausible["ruled_out"] and plausible["speedup"] == pytest.approx(10.0 / 8.2, abs=1e-4)
    assert plausible["speedup_min"] == pytest.approx(9.5 / 8.4, abs=1e-4)
    assert plausible["speedup_min"] < plausible["ideal_speedup"] == 1.25
    assert plausible["baseline_min_ms"] == 9.5 and plausible["ubatched_max_ms"] == 8.4 and plausible["repeats"] == 3
    impossible = _rows((10.0, 10.2, 9.9), (6.0, 6.1, 5.9))  # 1.6x and more in every round, ideal 1.25x
    assert impossible["ruled_out"] and impossible["speedup"] is None and impossible["efficiency"] is None
    assert impossible["measured_speedup"] == pytest.approx(10.0 / 6.0, abs=1e-4), "the median ratio is kept apart"
    table = format_table([plausible, impossible])
    assert "ruled out" in table.splitlines()[2] and "1.22x (1.13-1.31)" in table.splitlines()[1]
    assert "measurement error" in row_note(impossible) and "not a speedup" in row_note(impossible)
    title = plot_title(impossible, preset="tiny-moe", workload="prefill", world=2, label="")
    assert "ruled out by its ideal 1.25x" in title and "speedup" not in title
    title = plot_title(plausible, preset="tiny-moe", workload="prefill", world=2, label="")
    assert f"speedup {speedup_text(plausible)} of ideal 1.25x" in title and speedup_text(plausible) in table


def test_policy_sentences_say_what_auto_picked_and_what_was_best():
    one_process = {**_rows(), "comm_ms": 0.0}
    whole = {"tokens_per_rank": 256, "choice": 1, "best": 1, "best_ms": 10.0, "auto_ms": 10.0, "auto_vs_best": 1.0}
    assert policy_sentence(whole, [one_process]).startswith(
        "auto keeps the 256-token step whole: nothing to hide (no communication); measured best is 1"
    )
    split = {**whole, "choice": 2, "best": 2, "best_ms": 8.2, "auto_ms": 8.2}
    assert policy_sentence(split, [_rows()]) == "auto splits the 256-token step in 2: measured best is 2 (8.2 ms)"
    missed = {**whole, "best": 2, "best_ms": 8.2}
    assert policy_sentence(missed, [_rows()]) == (
        "auto keeps the 256-token step whole: measured best is 2 (8.2 ms vs 10 ms for auto's pick)"
    )


def test_a_one_process_run_says_there_is_nothing_to_hide(tmp_path, capsys):
    out = tmp_path / "report.json"
    main(
        [
            "--quick",
            "--device",
            "cpu",
            "--nproc",
            "1",
            "--tokens",
            "64",
            "--repeats",
            "3",
            "--calibrate-tokens",
            "16,64",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert report["setup"]["launched"] == "one process" and report["environment"]["world_size"] == 1
    printed = capsys.readouterr().out
    assert "in one process, so nothing is sent between ranks" in printed
    assert "auto keeps the 64-token step whole: nothing to hide" in printed


def test_mixed_workload_and_chrome_trace(tmp_path):
    out, trace = tmp_path / "report.json", tmp_path / "trace.json"
    main(
        [
            "--device",
            "cpu",
            "--workload",
            "mixed",
            "--tokens",
            "96",
            "--prompt-len",
            "32",
            "--context-len",
            "8",
            "--num-ubatches",
            "2,3",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--out",
            str(out),
            "--chrome-trace",
            str(trace),
        ]
    )
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
    kernels = [
        _k("gemm", 0.0, 4000.0),
        _k("flash", 2000.0, 5000.0),
        _k("ncclKernel", 5000.0, 7000.0),
        _k("ncclKernel", 6000.0, 9000.0),
    ]
    assert kernel_costs(kernels) == pytest.approx((5.0, 4.0))
    assert kernel_costs([]) == (0.0, 0.0)
    proxy = [_k("gemm", 0.0, 1000.0), _k("_proxy_link_transfer", 1000.0, 3000.0)]
    assert kernel_costs(proxy) == pytest.approx((1.0, 2.0)), "the proxy link's waiting warp is communication"


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
    # unsplit 10 ms (C 6, M 4: ideal 1.667x); split compute busy 7 ms, its transfers 4.4 of 5 ms busy
    m = Measurement(
        10.0, 8.0, 6.0, 4.0, 0.5, [], eager_baseline_ms=10.0, ubatched_busy_ms=(7.0, 5.0), transfer_ms=(4.0, 4.4)
    )
    row = m.as_dict()
    assert row["transfer_stretch"] == pytest.approx(1.1) and row["comm_stretch"] == pytest.approx(1.25)
    assert row["speedup_bound"] == pytest.approx(10.0 / 7.0, abs=1e-4)
    assert row["efficiency_bound"] == pytest.approx((10.0 / 7.0 - 1) / (10.0 / 6.0 - 1), abs=1e-4)
    assert row["efficiency"] == pytest.approx(0.375)
    unknown = Measurement(10.0, 8.0, 6.0, 4.0, 0.5, [], eager_baseline_ms=10.0, ubatched_busy_ms=(7.0, 5.0)).as_dict()
    assert (
        unknown["transfer_stretch"] is None and unknown["speedup_bound"] is None and unknown["efficiency_bound"] is None
    )


def test_hidden_kernel_fraction_is_none_without_comm_kernels():
    assert hidden_kernel_fraction([_k("gemm", 0.0, 5.0), _k("elementwise", 5.0, 6.0)]) is None
    assert hidden_kernel_fraction([]) is None


def test_kernels_in_trace_keeps_only_kernel_events():
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100.0, "dur": 5.5, "tid": 7},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 101.0, "dur": 20.0, "tid": 9},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 90.0, "dur": 1.0},
            {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "ts": 90.0, "dur": 50.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 95.0, "dur": 3.0},
            {"ph": "f", "cat": "ac2g", "name": "ac2g", "ts": 100.0},
            {"ph": "M", "name": "thread_name", "args": {"name": "stream 7"}},
        ]
    }
    assert kernels_in_trace(trace) == [Kernel("gemm", 100.0, 105.5), Kernel("ncclDevKernel_SendRecv", 101.0, 121.0)]
    assert kernels_in_trace({}) == []


def _graph_row(tokens, n, baseline, ubatched, at_capture):
    return {
        "tokens_per_rank": tokens,
        "num_ubatches": n,
        "graphs": True,
        "eager_baseline_ms": 9.0,
        "baseline_ms": baseline,
        "ubatched_ms": ubatched,
        "speedup": baseline / ubatched,
        "compute_ms": 1.0,
        "comm_ms": 1.0,
        "ideal_speedup": 2.0,
        "efficiency": None,
        "hidden_comm_fraction": None,
        "capture_time_ms": at_capture,
    }


def test_auto_policy_for_graph_replays_picks_the_faster_graph_at_capture_time():
    results = [
        _graph_row(64, 2, 1.0, 1.5, {1: 1.1, 2: 1.4}),
        _graph_row(256, 2, 3.0, 2.0, {1: 3.1, 2: 2.6}),
        _graph_row(256, 3, 3.0, 2.5, {1: 3.0, 3: 2.4}),
    ]

    def measure_at(*_):
        raise AssertionError("graph rows need no calibration")

    auto = auto_policy_report(
        results, measure_at, tokens=[64, 256], num_ubatches=[2, 3], calibrate_tokens=[], stages=4, graphs=True
    )
    assert "capture" in auto["note"]
    assert [(p["tokens_per_rank"], p["choice"], p["best"], p["auto_vs_best"]) for p in auto["points"]] == [
        (64, 1, 1, 1.0),
        (256, 3, 2, 0.8),
    ], "a pick from the short timing may miss the measured best"
    assert "eager ms" in format_table(results).splitlines()[0]


def test_capacity_factor_reports_the_dropped_share_unsplit_and_ubatched(tmp_path):
    out = tmp_path / "report.json"
    common = ["--device", "cpu", "--tokens", "64", "--prompt-len", "32", "--warmup", "0", "--repeats", "1"]
    main([*common, "--num-experts", "4", "--capacity-factor", "0.3", "--out", str(out)])
    dropped = json.loads(out.read_text())["results"][0]["dropped_fraction"]
    assert set(dropped) == {"unsplit", "ubatched"}
    # one rank: 0.3 of the 128 assignments bounds its one block to 39 of its 64 tokens' rows
    assert all(0.0 < share < 1.0 for share in dropped.values()), dropped
    main([*common, "--out", str(out)])
    row = json.loads(out.read_text())["results"][0]
    assert row["dropped_fraction"] is None  # worst case: none dropped
    assert row["efficiency_ceiling"] is None and row["reread_ms"] is None, "a CPU has no ceilings"


def test_the_step_table_shows_the_ceiling_where_rows_have_one():
    rows = [_rows(), {**_rows(), "num_ubatches": 3}]
    assert "ceiling" not in format_table(rows).splitlines()[0], "none measured: no column"
    rows[1]["efficiency_ceiling"] = 0.875
    table = format_table(rows).splitlines()
    assert "ceiling" in table[0].split() and "0.875" in table[2].split() and "-" in table[1].split()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "dense", "--capacity-factor", "1"], "apply to --model moe"),
        (["--capacity-factor", "0"], "expected a positive number"),
        (["--num-experts", "-2"], "expected a positive integer"),
    ],
)
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
    from ubatch.bench.measure import device_busy_ms
    from ubatch.trace import Interval

    timeline = [
        Interval(0, "compute", "c", 0.0, 4.0),
        Interval(0, "comm", "a2a", 4.0, 7.0),
        Interval(1, "compute", "c", 4.0, 8.0),
        Interval(1, "comm", "a2a", 6.5, 9.0),
    ]
    busy = device_busy_ms(timeline, torch.device("cuda"))
    assert busy == (8.0, 5.0), "overlapping intervals of one kind count once"
    assert device_busy_ms(timeline, torch.device("cpu")) is None
    m = Measurement(10.0, 6.0, 8.0, 4.0, 0.5, timeline, eager_baseline_ms=10.0, ubatched_busy_ms=busy)
    row = m.as_dict()
    assert row["comm_stretch"] == 1.25 and row["ubatched_comm_ms"] == 5.0 and row["ubatched_compute_ms"] == 8.0
    assert (
        Measurement(10.0, 6.0, 8.0, 0.0, None, [], eager_baseline_ms=10.0, ubatched_busy_ms=busy).comm_stretch is None
    )


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


@pytest.mark.parametrize(
    "name, expected",
    [
        ("unsplit", lambda c, m: c + m),
        ("split2", lambda c, m: step_ms(2, 4, c, m, 0.2)),
        ("tokens4", lambda c, m: step_ms(1, 4, c, m, 0.2, token_chunks=4)),
        ("split2+tokens2+local", lambda c, m: step_ms(2, 4, c, m, 0.2, local_share=1 / 8, token_chunks=2)),
        ("pipeline2", lambda c, m: joined_step_ms(1, 2, 4, c, m, 0.2)),
        ("split2+join+pipeline2", lambda c, m: joined_step_ms(2, 2, 4, c, m, 0.2)),
        ("overlap", None),
        ("split2+pipeline2", None),
        ("pipeline2+local", None),
        ("split2+join+local", None),
        ("split2+allreduce2", None),
    ],
)
def test_each_mode_gets_the_schedule_model_that_describes_it_or_none(name, expected):
    c, m = 22.5, 20.6
    got = mode_step_ms(OverlapMode.parse(name), layers=4, compute_ms=c, comm_ms=m, ep_world=8)
    assert got == (None if expected is None else pytest.approx(expected(c, m)))


def test_expert_groups_in_the_model_send_their_own_share_of_the_rows():
    """One layer, no attention, C = M = 1 (each group's GEMMs 0.5, a whole dispatch 0.5): with
    equal chunks the first dispatch (0.25) is exposed and the last combine (0.25) too, 1.5 in
    all; with 3/4 of the rows in the first chunk both exposed pieces grow to 0.375: 1.75."""
    assert joined_step_ms(1, 2, 1, 1.0, 1.0, 0.0) == pytest.approx(1.5)
    assert joined_step_ms(1, 2, 1, 1.0, 1.0, 0.0, chunk_shares=[0.5, 0.5]) == pytest.approx(1.5)
    assert joined_step_ms(1, 2, 1, 1.0, 1.0, 0.0, chunk_shares=[0.75, 0.25]) == pytest.approx(1.75)
    for bad in ([1.0], [0.6, 0.6], [1.2, -0.2]):
        with pytest.raises(ValueError, match="chunk_shares must be 2"):
            joined_step_ms(1, 2, 1, 1.0, 1.0, 0.0, chunk_shares=bad)


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
    assert r["ubatched_comm_ms"] > 0 and r["comm_stretch"] == pytest.approx(
        r["ubatched_comm_ms"] / r["comm_ms"], rel=1e-2
    )
    if graphs:  # the ranks' kernels gathered: transfer is NCCL time less waiting
        assert (
            0 < r["transfer_ms"] <= r["comm_ms"] * 1.001
            and 0 < r["ubatched_transfer_ms"] <= r["ubatched_comm_ms"] * 1.001
        )
        assert r["speedup_bound"] == pytest.approx(
            r["baseline_ms"] / max(r["ubatched_compute_ms"], r["ubatched_transfer_ms"]), rel=1e-2
        )
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
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)  # 64 MB, touched, freed at once
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The heap settles in the first three calls (in 30 runs two of them faulted). After that, the
# fewest of six: with the heap kept a later call can still refault (at least 3 of 6 did in one CI run;
# the heap's history decides where the next block lands), where glibc's default refaults in
# every call.
print(min(faults[3:]))
"""


def test_cpu_runs_reuse_freed_large_buffers_instead_of_faulting_them_in_again():
    """With glibc's defaults a freed 64 MB tensor goes back to the OS and the next one faults in
    16k fresh pages; the bench keeps it, so CPU timings do not reward smaller (split) buffers.
    Fresh interpreters: how a long-lived heap serves one allocation depends on its history."""
    import subprocess
    import sys

    def faults(mode: str) -> int:
        result = subprocess.run(
            [sys.executable, "-c", _FAULTS_OF_A_REALLOCATED_BUFFER, mode], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return int(result.stdout.split()[-1])

    assert faults("default") > 10_000
    assert faults("keep") < 1_000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-len", "0"], "argument --prompt-len: expected a positive integer, got '0'"),
        (["--context-len", "-1"], "argument --context-len: expected an integer >= 0, got '-1'"),
        (["--repeats", "0"], "argument --repeats: expected a positive integer, got '0'"),
        (["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got '-1'"),
        (["--warmup", "two"], "argument --warmup: expected an integer >= 0, got 'two'"),
        (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["--preset", "tiny"], "preset 'tiny' is a dense model but --model moe was given"),
        (["--num-experts", "1"], "--preset tiny-moe with these overrides: top_k must be in [1, num_experts=1], got 2"),
        (["--quick", "--num-experts", "3"], "3 experts cannot be split evenly over 2 ranks"),
        (["--link", "host::w8"], "4 experts cannot be split evenly over the host::w8 stand-in's 8 ranks"),
        (["--tokens", "2", "--num-ubatches", "3"], "--tokens 2 cannot be split into 3 ubatches"),
        (["--policy", "auto", "--calibrate-tokens", "64,64"], "--calibrate-tokens needs two or more different sizes"),
        (["--workload", "generate", "--nproc", "2"], "--workload generate runs in one process"),
        (["--out", "/nonexistent/report.json"], "--out '/nonexistent/report.json' cannot be written: No such file"),
        (["--plot", "/nonexistent/plot.png"], "--plot '/nonexistent/plot.png' cannot be written: No such file"),
        (["--chrome-trace", "/"], "--chrome-trace '/' is a directory, not a file"),
        (["--prefill-graphs", "full"], "--prefill-graphs full applies to --graphs --workload prefill"),
        (
            ["--graphs", "--workload", "prefill", "--prefill-graphs", "full", "--tokens", "512,1000"],
            "--prefill-graphs full replays prompts of one length: --tokens 1000 is not a multiple of --prompt-len 128",
        ),
        (
            ["--graphs", "--workload", "prefill", "--modes", "split2+join"],
            "--modes split2+join: joined experts run eagerly or from FULL graphs (decode, or --prefill-graphs full)",
        ),
    ],
)
def test_bad_flags_end_in_a_usage_error_before_the_run(argv, message, capsys, monkeypatch):
    import ubatch.bench.cli as cli

    monkeypatch.setattr(cli, "run", lambda args: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["--device", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ubatch-bench") and f"ubatch-bench: error: {message}" in err


def test_plot_needs_matplotlib_before_the_run(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--plot", str(tmp_path / "timeline.png")])
    assert "--plot needs matplotlib: pip install 'ubatch[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "timeline.png").exists(), "the write check leaves no file behind"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where torch sees no GPU")
def test_device_cuda_without_a_gpu_is_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--device", "cuda"])
    assert "--device cuda was given, but torch sees no CUDA GPU" in capsys.readouterr().err


def test_nproc_is_refused_under_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parse_args(["--device", "cpu", "--quick"]).launched == "torchrun"
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--nproc", "2"])
    assert "under torchrun, its --nproc-per-node decides" in capsys.readouterr().err


def test_timed_rounds_run_each_call_once_and_take_turns_going_first():
    from ubatch.bench.measure import interleaved_samples_ms

    calls = []
    samples = interleaved_samples_ms(
        [lambda: calls.append("a"), lambda: calls.append("b")], torch.device("cpu"), warmup=1, repeats=3
    )
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert [len(s) for s in samples] == [3, 3] and all(t >= 0 for s in samples for t in s)


def test_the_console_script_names_the_cli_main():
    from importlib import import_module
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    module, name = pyproject["project"]["scripts"]["ubatch-bench"].split(":")
    assert getattr(import_module(module), name) is main


def test_a_report_names_the_code_it_measured(monkeypatch, tmp_path):
    """From the checkout's git history, or from UBATCH_CODE_VERSION where a copied tree has none."""
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    monkeypatch.delenv(CODE_VERSION_ENV, raising=False)
    if head.returncode == 0:
        assert code_version().startswith(head.stdout.strip()[:7])
    monkeypatch.setenv(CODE_VERSION_ENV, "abc1234")
    assert code_version() == "abc1234"
    monkeypatch.delenv(CODE_VERSION_ENV)
    # an installed package inside someone else's repository: that repository's commit is not ours
    git = ["git", "-C", str(tmp_path), "-c", "user.name=u", "-c", "user.email=u@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "another project"], check=True)
    (tmp_path / "site-packages").mkdir()
    monkeypatch.setattr(report_module.os.path, "abspath", lambda path: str(tmp_path / "site-packages" / "x.py"))
    assert report_module.code_version() is None, "outside its own checkout it says nothing rather than guess"


def test_a_reports_code_tree_is_the_tree_id_git_gives_the_package(tmp_path):
    """Computed from the files alone, it equals ``git rev-parse HEAD:pkg`` for the committed
    package: nested folders, a folder without Python files and bytecode caches left out."""
    import subprocess

    package = tmp_path / "pkg"
    (package / "models" / "deep").mkdir(parents=True)
    (package / "__pycache__").mkdir()
    (package / "data").mkdir()
    (package / "__init__.py").write_text("")
    (package / "b.py").write_text("x = 1\n")
    (package / "models" / "a.py").write_bytes(b"y = 2\n")
    (package / "models" / "deep" / "c.py").write_text("z = 3\n")
    (package / "models.py").write_text("# git sorts the folder of the same name as models/, after this\n")
    (package / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\0")
    (package / "data" / "notes.txt").write_text("not code")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=u", "-c", "user.email=u@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "pkg/__init__.py", "pkg/b.py", "pkg/models", "pkg/models.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "pkg"], check=True)
    want = subprocess.run([*git, "rev-parse", "HEAD:pkg"], capture_output=True, text=True, check=True).stdout.strip()
    assert report_module.code_tree(str(package)) == want
    (package / "b.py").write_text("x = 2\n")
    assert report_module.code_tree(str(package)) != want


def test_prefill_replays_from_full_graphs_only_where_asked():
    from ubatch.bench.graphs import graph_mode_for

    assert graph_mode_for("decode") == graph_mode_for("decode", "full") == CUDAGraphMode.FULL
    assert graph_mode_for("prefill") == graph_mode_for("mixed", "full") == CUDAGraphMode.PIECEWISE
    assert graph_mode_for("prefill", "full") == CUDAGraphMode.FULL
    with pytest.raises(ValueError, match="prefill_graphs must be one of piecewise, full, got 'FULL'"):
        graph_mode_for("prefill", "FULL")


def test_a_graph_rows_queued_speedup_is_its_median_rounds_and_shows_where_measured():
    """Rounds of queued replays (per step, unsplit and ubatched) give the median round's ratio and
    its efficiency against the same ideal (1.25x: C 8, M 2); the table shows them only where a
    row has them (rows from before, and eager rows, have none)."""
    import statistics

    queued = [(9.0, 8.0), (9.5, 7.6), (9.2, 8.0)]  # ratios 1.125, 1.25, 1.15
    m = Measurement(10.0, 8.2, 8.0, 2.0, 0.5, [], eager_baseline_ms=12.0, graphs=True, queued_rounds_ms=queued)
    row = {"tokens_per_rank": 256, "num_ubatches": 2, "world_size": 1, **m.as_dict()}
    assert row["queued_speedup"] == pytest.approx(1.15, abs=1e-4)
    assert row["queued_efficiency"] == pytest.approx(0.15 / 0.25, abs=1e-3)
    assert row["queued_baseline_ms"] == 9.2 and row["queued_ubatched_ms"] == statistics.median([8.0, 7.6, 8.0])
    plain = _rows()
    assert plain["queued_speedup"] is None and "queued" not in format_table([plain]).splitlines()[0]
    table = format_table([plain, row]).splitlines()
    head = table[0].split()
    assert "queued" in head and "1.15x" in table[2].split() and "-" in table[1].split()
