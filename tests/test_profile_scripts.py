"""The profiling and schedule-model scripts: kernel records from a Chrome trace, why the compute
lane sat idle, kernel families that grow when split, the schedule bound's limits, the
first-use cost probe, the policy replay, the sweep at a communication-to-compute ratio, the
expert-group bench's routed rows, skewed rows per expert and the padding of a dispatch
cut by expert group."""

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from ubatch.bench.kernels import kernel_family
from ubatch.bench.skew import expert_counts, spread_fields, tile_fill

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


profile_step = _load("profile_step")
profile_table = _load("profile_table")
comm_waits = _load("comm_waits")
schedule_bound = _load("schedule_bound")
first_use_cost = _load("first_use_cost")
replay_policy = _load("replay_policy")
modes_table = _load("modes_table")
sweep_at_ratio = _load("sweep_at_ratio")
bench_expert_groups = _load("bench_expert_groups")
chunk_padding = _load("chunk_padding")


def _trace():
    launch = [
        ("cudaLaunchKernel", 100, 1),
        ("cudaLaunchKernel", 110, 2),
        ("cuLaunchKernelEx", 120, 3),
        ("cudaLaunchKernel", 400, 4),
    ]
    kernels = [
        ("void gemm<float>(int)", 105, 100, 1, 7),
        ("ncclDevKernel_SendRecv(args)", 205, 150, 3, 9),
        ("void gemm<float>(int)", 360, 100, 2, 7),
        ("void add<half>(int)", 470, 10, 4, 7),
    ]
    events = [
        {
            "cat": "cuda_driver" if n.startswith("cu") and not n.startswith("cuda") else "cuda_runtime",
            "name": n,
            "ph": "X",
            "ts": ts,
            "dur": 5,
            "args": {"correlation": c},
        }
        for n, ts, c in launch
    ]
    events += [
        {"cat": "kernel", "name": n, "ph": "X", "ts": ts, "dur": d, "args": {"correlation": c, "stream": s}}
        for n, ts, d, c, s in kernels
    ]
    events.append({"cat": "gpu_memcpy", "name": "Memcpy", "ph": "X", "ts": 90, "dur": 1, "args": {}})
    return {"traceEvents": events}


def test_kernel_records_keep_kernels_with_their_launch_times():
    names = {}
    rows = profile_step.kernel_records(_trace(), names)
    assert list(names) == ["void gemm<float>(int)", "ncclDevKernel_SendRecv(args)", "void add<half>(int)"]
    assert [r[:3] for r in rows] == [[0, 0, 7], [1, 1, 9], [0, 0, 7], [2, 0, 7]]
    assert rows[0][3:] == [5, 105, 0] and rows[3][3:] == [370, 380, 300]


def test_trace_origin_is_the_first_launch_or_kernel():
    assert profile_step.trace_origin(_trace()) == 100
    assert profile_step.trace_origin({"traceEvents": []}) == 0.0


def _config(n, comm, origin=0.0):
    """A profiled configuration whose NCCL kernels are ``comm`` (start, end) pairs, beside a gemm."""
    kernels = [[0, 0, 7, 0, 50, 0], [0, 0, 8, 40, 80, 0]] + [[1, 1, 9, a, b, 0] for a, b in comm]
    return {
        "mode": "green:16",
        "num_ubatches": n,
        "wall_ms": 0.3 if n == 1 else 0.25,
        "origin_us": origin,
        "kernels": kernels,
    }


def test_comm_waits_split_kernel_time_into_transfer_and_waiting():
    # unsplit: both ranks enter together, 100 us each. Split: rank 1 reaches the first
    # collective 30 us late (rank 0 spins) and the second takes 60 us on both ranks
    rank0 = {"configs": [_config(1, [(100, 200)]), _config(2, [(100, 190), (200, 260)], origin=1000.0)]}
    rank1 = {"configs": [_config(1, [(100, 200)]), _config(2, [(125, 185), (195, 255)], origin=1005.0)]}
    unsplit, split = comm_waits.waits_table([rank0, rank1])
    assert unsplit["transfer_ms"] == pytest.approx(0.1) and unsplit["waiting_ms"] == [0.0, 0.0]
    assert split["comm_kernels"] == 2 and split["busy_ms"] == [0.15, 0.12]
    assert split["transfer_ms"] == pytest.approx(0.12) and split["waiting_ms"] == [0.03, 0.0]
    assert split["transfer_stretch"] == pytest.approx(1.2) and split["busy_stretch"] == pytest.approx(1.35)
    assert split["end_skew_us_median"] == 0.0
    # compute lane busy 0.08 ms (overlapping kernels count once); unsplit C 0.08, M 0.1: ideal 1.8
    assert unsplit["compute_busy_ms"] == pytest.approx(0.08) and "efficiency" not in unsplit
    assert split["speedup"] == pytest.approx(1.2) and split["ideal_speedup"] == pytest.approx(1.8)
    assert split["bound_speedup"] == pytest.approx(2.5) and split["efficiency"] == pytest.approx(0.25)
    assert split["efficiency_bound"] == pytest.approx(1.875)


def test_comm_waits_refuse_ranks_that_disagree():
    rank0 = {"configs": [_config(1, [(0, 10), (20, 30)])]}
    with pytest.raises(ValueError, match=r"different numbers of communication kernels: \[2, 1\]"):
        comm_waits.waits_table([rank0, {"configs": [_config(1, [(0, 10)])]}])
    with pytest.raises(ValueError, match="N=2 is missing from the report of rank"):
        comm_waits.waits_table([{"configs": [_config(2, [(0, 10)])]}, rank0])


def test_summary_splits_compute_idle_time_into_host_and_waiting():
    summary = profile_step.summarize(profile_step.kernel_records(_trace(), {}))
    assert summary["compute_kernels"] == 3 and summary["comm_kernels"] == 1
    assert summary["compute_sum_ms"] == pytest.approx(0.21) and summary["comm_busy_ms"] == pytest.approx(0.15)
    # gemm #2 was launched long before the lane went idle: waiting (on the collective), not host
    assert summary["compute_idle_waiting_ms"] == pytest.approx(0.165)
    assert summary["compute_idle_host_ms"] == 0.0


def test_summary_blames_the_host_for_a_late_launch():
    rows = [[0, 0, 7, 0, 100, 0], [0, 0, 7, 300, 400, 280]]  # launched 180 us after the lane idled
    summary = profile_step.summarize(rows)
    assert summary["compute_idle_host_ms"] == pytest.approx(0.18)
    assert summary["compute_idle_waiting_ms"] == pytest.approx(0.02)


def test_table_lists_kernel_families_that_grow(tmp_path, capsys, monkeypatch):
    names = ["void gemm<float>(int)", "ncclDevKernel_SendRecv(args)"]
    unsplit = [[0, 0, 7, 0, 1000, 0], [1, 1, 9, 1000, 3000, 0]]
    split = [[0, 0, 7, 0, 900, 0], [0, 0, 8, 900, 1800, 0], [1, 1, 9, 900, 2000, 0], [1, 1, 9, 2000, 3100, 0]]
    report = {
        "kernel_names": names,
        "configs": [
            {"mode": "green:16", "num_ubatches": 1, "wall_ms": 3.0, "kernels": unsplit},
            {"mode": "green:16", "num_ubatches": 2, "wall_ms": 3.1, "kernels": split},
        ],
    }
    assert kernel_family("void gemm<float>(int)") == "gemm"
    assert profile_table.family_totals(report["configs"][1], names) == {
        "gemm": (2, 1.8),
        "ncclDevKernel_SendRecv": (2, 2.2),
    }
    text = profile_table.table(report, "green:16", top=5)
    assert "unsplit -> N=2" in text and "gemm" in text.splitlines()[-1]
    with pytest.raises(ValueError, match="no unsplit"):
        profile_table.table(report, "none", top=5)
    path = tmp_path / "p.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(report, f)
    monkeypatch.setattr(sys, "argv", ["profile_table.py", str(path)])
    profile_table.main()
    assert "ncclDevKernel_SendRecv" in capsys.readouterr().out


def test_schedule_bound_unsplit_is_the_serial_sum_and_splits_approach_the_ideal():
    c, m = 71.0, 126.0
    assert schedule_bound.step_ms(1, 8, c, m, 0.2) == pytest.approx(c + m)
    times = [schedule_bound.step_ms(n, 8, c, m, 0.2) for n in (2, 3, 4)]
    assert all(max(c, m) <= t < c + m for t in times)
    assert times[1] <= times[0] + 1e-9  # more ubatches, less fill and drain in this model


def test_schedule_bound_with_little_attention_leaves_comm_exposed_when_compute_bound():
    # compute-bound, tiny attention: after the experts, only attention can cover the next collective
    two = schedule_bound.step_ms(2, 8, 122.0, 73.0, 0.05)
    assert two > 122.0 + 0.3 * 73.0


def test_schedule_bound_comm_stretch_slows_only_split_collectives():
    c, m = 71.0, 126.0
    assert schedule_bound.step_ms(1, 8, c, m, 0.2, comm_stretch=1.5) == pytest.approx(c + m)
    stretched = schedule_bound.step_ms(2, 8, c, m, 0.2, comm_stretch=1.08)
    assert 1.08 * m <= stretched < 1.08 * m + c / 8, "comm-bound: the stretched link plus some fill and drain"
    assert stretched > schedule_bound.step_ms(2, 8, c, m, 0.2)


def test_token_chunks_by_hand_and_beside_a_split():
    # one layer, C = 10 (attention 2, experts 8), M = 4: two chunks' dispatches (1 ms each) land at
    # 3 and 4; chunk 0's experts run 3-7, its combine 7-8; chunk 1's experts 7-11, its combine 11-12
    assert schedule_bound.step_ms(1, 1, 10.0, 4.0, 0.2, token_chunks=2) == pytest.approx(12.0)
    assert schedule_bound.step_ms(1, 1, 10.0, 4.0, 0.2) == pytest.approx(14.0)
    # moe-bench's 4096-token prefill as one rank of eight (run 18): two chunks per ubatch of a
    # two-way split come closer to max(C, M) than the split alone, or than two more ubatches
    c, m = 22.53, 20.63
    split2, split2_tokens2 = (schedule_bound.step_ms(2, 4, c, m, 0.2, token_chunks=k) for k in (1, 2))
    assert max(c, m) < split2_tokens2 < 0.85 * split2
    with pytest.raises(ValueError, match="token_chunks must be a positive int, got 0"):
        schedule_bound.step_ms(2, 4, c, m, 0.2, token_chunks=0)


def test_own_rows_first_by_hand_and_where_it_hides_prefill_dispatches():
    """One layer, C = 4 (attention 2, experts 2), M = 2: attention 0-2, dispatch 2-3 beside the
    own rows' half of the experts (2-3), the rest 3-4, combine 4-5."""
    step_ms = schedule_bound.step_ms
    assert step_ms(1, 1, 4.0, 2.0, 0.5, local_share=0.5) == pytest.approx(5.0)
    assert step_ms(1, 1, 4.0, 2.0, 0.5, local_share=0.0) == pytest.approx(6.0)
    # moe-bench's 4096-token prefill over the link stand-in (benchmarks/RESULTS.md): a dispatch
    # hides only under the other ubatch's attention, unless the own rows run beside it
    assert step_ms(2, 4, 26.07, 20.87, 0.2) == pytest.approx(31.94, abs=0.01)
    assert step_ms(2, 4, 26.07, 20.87, 0.2, local_share=0.5) == pytest.approx(27.38, abs=0.01)
    with pytest.raises(ValueError, match="local_share must be in"):
        step_ms(2, 4, 26.07, 20.87, 0.2, local_share=1.5)


def test_joined_schedule_by_hand_and_its_costs():
    """One layer, C = 4 (attention 2, experts 2), M = 2 (dispatch 1, combine 1), by hand."""
    joined = schedule_bound.joined_step_ms
    assert joined(1, 1, 1, 4.0, 2.0, 0.5) == pytest.approx(6.0), "unsplit: the serial sum"
    # attention A 0-1, its dispatch 1-1.5; B 1-2, its dispatch 2-2.5; experts 2.5-4.5; combines to 5.5
    assert joined(2, 1, 1, 4.0, 2.0, 0.5) == pytest.approx(5.5)
    # attention 0-2; group dispatches 2-2.5, 2.5-3; GEMMs 2.5-3.5, 3.5-4.5; last combine 4.5-5
    assert joined(1, 2, 1, 4.0, 2.0, 0.5) == pytest.approx(5.0)
    assert joined(1, 2, 1, 4.0, 2.0, 0.5, group_cost_ms=0.25) == pytest.approx(5.5)
    assert joined(2, 1, 1, 4.0, 2.0, 0.5, ubatch_cost_ms=0.1) == pytest.approx(5.7)
    assert joined(1, 1, 1, 4.0, 2.0, 0.5, comm_stretch=1.5) == pytest.approx(6.0), "an uncut transfer"
    assert joined(1, 2, 1, 4.0, 2.0, 0.5, comm_stretch=1.5) == pytest.approx(5.5)  # 0.75 ms per group
    # a small first ubatch: its dispatch hides, the large one's lands at 2.75, experts to 4.75
    assert joined(2, 1, 1, 4.0, 2.0, 0.5, shares=[0.25, 0.75]) == pytest.approx(5.75)
    with pytest.raises(ValueError, match="shares must be 2 positive numbers summing to 1"):
        joined(2, 1, 1, 4.0, 2.0, 0.5, shares=[0.5, 0.6])


def test_schedule_bound_routing_gives_each_group_a_uniform_routers_rows(monkeypatch, capsys):
    """Top-8 of 64 as one rank of eight, two groups of four experts: a row travels in the first
    group's chunk if any of its experts is there (1 - C(60,8)/C(64,8) of the tokens), in the
    second's only if none is and one of the other four is."""
    from math import comb

    first = 1 - comb(60, 8) / comb(64, 8)
    second = comb(60, 8) / comb(64, 8) - comb(56, 8) / comb(64, 8)
    assert schedule_bound.routing_shares("64:8:8", 2) == pytest.approx(
        [first / (first + second), second / (first + second)]
    )
    for bad in ("64:8", "64:x:8", "64:80:8", "64:8:3"):
        with pytest.raises(ValueError, match="--routing"):
            schedule_bound.routing_shares(bad, 2)
    argv = ["schedule_bound.py", "--compute-ms", "4", "--comm-ms", "2", "--layers", "1", "--attention-share", "0.5"]
    monkeypatch.setattr(
        sys, "argv", [*argv, "--join", "--expert-chunks", "2", "--num-ubatches", "1", "--routing", "64:8:8"]
    )
    schedule_bound.main()
    uneven = float(capsys.readouterr().out.split(": ")[1].split(" ms")[0])
    shares = schedule_bound.routing_shares("64:8:8", 2)
    assert uneven == pytest.approx(schedule_bound.joined_step_ms(1, 2, 1, 4.0, 2.0, 0.5, chunk_shares=shares), abs=5e-3)
    assert uneven > 5.0, "the larger first chunk is exposed longer than an equal one (5.0 ms by hand)"


def test_schedule_bound_prints_joined_modes(monkeypatch, capsys):
    argv = ["schedule_bound.py", "--compute-ms", "4", "--comm-ms", "2", "--layers", "1", "--attention-share", "0.5"]
    monkeypatch.setattr(sys, "argv", [*argv, "--join", "--expert-chunks", "1,2", "--num-ubatches", "2"])
    schedule_bound.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("N=2 joined, K=1: 5.50 ms") and out[1].startswith("N=2 joined, K=2:")


def test_schedule_bound_split_tax_slows_splits_and_token_chunks_only(monkeypatch, capsys):
    argv = ["schedule_bound.py", "--compute-ms", "16", "--comm-ms", "18", "--layers", "4", "--attention-share", "0.25"]
    monkeypatch.setattr(sys, "argv", [*argv, "--num-ubatches", "1,4", "--token-chunks", "1,2", "--split-tax", "1.2"])
    schedule_bound.main()
    out = capsys.readouterr().out.splitlines()
    times = [float(line.split(": ")[1].split(" ms")[0]) for line in out]
    assert out[0].startswith("N=1:") and times[0] == pytest.approx(34.0), "the unsplit step pays no tax"
    assert out[1].startswith("N=1, 2 token chunks, tax 1.2") and out[2].startswith("N=4, tax 1.2")
    assert times[1] == pytest.approx(schedule_bound.step_ms(1, 4, 19.2, 18.0, 0.25, token_chunks=2), abs=5e-3)
    assert times[2] == pytest.approx(schedule_bound.step_ms(4, 4, 19.2, 18.0, 0.25), abs=5e-3)
    for extra, message in [
        (["--split-tax", "0.9"], "--split-tax must be >= 1"),
        (["--split-tax", "1.1", "--join"], "--split-tax models plain splits"),
    ]:
        monkeypatch.setattr(sys, "argv", [*argv, *extra])
        with pytest.raises(SystemExit):
            schedule_bound.main()
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--expert-chunks", "2"], ["--group-cost-ms", "0.1"], ["--ubatch-cost-ms", "0.1"]])
def test_schedule_bound_refuses_joined_costs_without_join(monkeypatch, capsys, flag):
    argv = ["schedule_bound.py", "--compute-ms", "4", "--comm-ms", "2", "--layers", "1", *flag]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        schedule_bound.main()
    assert f"{flag[0]} model joined expert stages: add --join" in capsys.readouterr().err


@pytest.mark.parametrize("num_ubatches", [1, 2])
def test_first_use_cost_serves_the_same_requests_twice(capsys, num_ubatches):
    row = first_use_cost.main(
        [
            "--device",
            "cpu",
            "--requests",
            "5",
            "--prompt-len",
            "12",
            "--max-new-tokens",
            "6",
            "--num-ubatches",
            str(num_ubatches),
        ]
    )
    assert json.loads(capsys.readouterr().out) == row
    assert row["attention"] == "builtin_flash" and row["path"] == "sdpa", "no built-in flash kernel on CPU"
    assert row["num_ubatches"] == num_ubatches
    assert row["cold_tokens"] == row["warm_tokens"] > 5
    assert row["cold_tokens_per_s"] > 0 and row["warm_tokens_per_s"] > 0
    _, limits = first_use_cost.staggered_requests(
        first_use_cost.parse_args(["--requests", "5", "--max-new-tokens", "6"]), 64
    )
    assert sum(limits) == row["cold_tokens"], "every request generates its own drawn length"


def test_first_use_cost_math_choice_leaves_only_the_math_path():
    import torch

    with first_use_cost.sdpa_choice("math"):
        assert torch.backends.cuda.math_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled(), "the choice ends with the block"


@pytest.mark.parametrize(
    "choice, supported, path",
    [
        ("builtin_flash", True, "builtin_flash"),
        ("sdpa", True, "sdpa"),
        ("math", True, "sdpa_math"),
        ("builtin_flash", False, "sdpa"),
    ],
)
def test_first_use_cost_rows_name_the_attention_path_that_ran(monkeypatch, choice, supported, path):
    import torch

    from ubatch.attention import TorchBackend
    from ubatch.models import ModelConfig

    monkeypatch.setattr(first_use_cost, "builtin_flash_supports", lambda q: supported)
    backend = TorchBackend(builtin_flash=choice == "builtin_flash")
    assert first_use_cost.attention_path(backend, ModelConfig.preset("tiny"), torch.device("cpu"), choice) == path


def test_first_use_cost_warms_up_on_other_requests_first(capsys):
    row = first_use_cost.main(
        ["--device", "cpu", "--requests", "4", "--prompt-len", "12", "--max-new-tokens", "4", "--warmup-requests", "3"]
    )
    assert row["warmup_requests"] == 3 and row["warmup_s"] > 0 and row["cold_tokens"] == row["warm_tokens"]


def test_first_use_cost_flash_names_the_flash_attn_version_and_needs_cuda():
    import torch

    from ubatch.attention import FlashAttentionBackend
    from ubatch.models import ModelConfig

    backend = FlashAttentionBackend("fa4", lambda *args, **kwargs: None)
    assert (
        first_use_cost.attention_path(backend, ModelConfig.preset("tiny"), torch.device("cpu"), "flash")
        == "flash_attn_fa4"
    )
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        first_use_cost.make_backend("flash", torch.device("cpu"))


def test_first_use_cost_summary_gives_medians_ranges_and_the_ratio_to_sdpa(tmp_path, capsys):
    def row(path, n, cold, warm):
        return {"path": path, "num_ubatches": n, "cold_tokens_per_s": cold, "warm_tokens_per_s": warm}

    rows = [row("builtin_flash", 1, c, w) for c, w in ((900.0, 1800.0), (1200.0, 2000.0), (1000.0, 2100.0))]
    rows += [row("sdpa", 1, 200.0, 2000.0), row("sdpa", 1, 300.0, 1600.0), row("sdpa_math", 2, 500.0, 700.0)]
    rows.append({**row("builtin_flash", 1, 1500.0, 2000.0), "warmup_requests": 8})
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = first_use_cost.main(["--summarize", str(rows_file)])
    flash, sdpa, math_two, warmed = summary
    assert (warmed["warmup_requests"], warmed["runs"], warmed["cold_vs_sdpa"]) == (8, 1, None), "a group of its own"
    assert (flash["runs"], flash["cold"], flash["warm"]) == (3, (1000.0, 900.0, 1200.0), (2000.0, 1800.0, 2100.0))
    assert sdpa["cold"][0] == 250.0 and flash["cold_vs_sdpa"] == 4.0 and flash["warm_vs_sdpa"] == 2000.0 / 1800.0
    assert math_two["cold_vs_sdpa"] is None, "no SDPA row at N=2 to compare with"
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and "4.00x" in out[1] and "500.0" in out[3] and out[3].rstrip().endswith("-")


def test_replay_policy_prints_every_committed_pick_and_fails_below_the_floor(capsys, monkeypatch):
    reports = replay_policy.auto_reports(ROOT / "benchmarks")
    monkeypatch.setattr(sys, "argv", ["replay_policy.py"])
    assert replay_policy.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) > len(reports) + 1 and out[-1].endswith(f"over {len(reports)} reports")
    monkeypatch.setattr(sys, "argv", ["replay_policy.py", str(reports[0]), "--floor", "1.01"])
    assert replay_policy.main() == 1


def test_mode_kernels_summarises_a_replay_and_groups_families():
    mode_kernels = _load("mode_kernels")
    from ubatch.bench.kernels import Kernel

    kernels = [
        Kernel("void gemm<float>(int)", 0.0, 100.0),
        Kernel("void gemm<bf16>(int)", 110.0, 210.0),
        Kernel("add_kernel", 260.0, 270.0),
        Kernel("ncclDevKernel_AllToAll", 250.0, 350.0),
    ]
    # the transfer runs 0.1 ms, 0.01 of it under add_kernel: 0.09 ms exposed
    assert mode_kernels.summary(kernels) == {
        "kernels": 3,
        "span_ms": 0.35,
        "compute_sum_ms": 0.21,
        "compute_idle_ms": 0.14,
        "comm_ms": 0.1,
        "exposed_comm_ms": 0.09,
    }
    assert mode_kernels.families(kernels[:3]) == {"gemm": (2, 0.2), "add_kernel": (1, 0.01)}


def test_mode_kernels_splits_a_traced_replays_idle_time(tmp_path):
    """The summary's gap fields come from the Chrome trace the profile kept, gzipped or not: here
    the second kernel starts just as its launch returns (the host left the gap), the copy after a
    launch long before (it waited)."""
    mode_kernels = _load("mode_kernels")

    rows = [  # (category, name, start us, duration us, correlation)
        ("kernel", "gemm", 0, 100, 1),
        ("kernel", "gemm", 150, 100, 2),
        ("cuda_runtime", "cudaLaunchKernel", 140, 5, 2),
        ("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 10, 3),
        ("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 40, 10, 4),
        ("cuda_runtime", "cudaMemcpyAsync", 0, 5, 4),
    ]
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": c, "name": n, "ts": ts, "dur": dur, "args": {"correlation": k}}
            for c, n, ts, dur, k in rows
        ]
    }
    expected = {
        "compute_host_bound_ms": 0.05,
        "compute_waiting_ms": 0.0,
        "comm_host_bound_ms": 0.0,
        "comm_waiting_ms": 0.03,
    }
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    plain.write_text(json.dumps(trace))
    with gzip.open(packed, "wt") as f:
        json.dump(trace, f)
    assert mode_kernels.gap_fields(str(plain)) == mode_kernels.gap_fields(str(packed)) == expected


def test_modes_table_renders_a_committed_report_as_results_shows_it():
    committed = ROOT / "benchmarks/history/modes_deepseek_decode_link33_measured_capacity_b78bbcd.json"
    report = json.loads(committed.read_text())
    text = modes_table.render(report)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 + len(report["results"]), "a header, its rule and one row per (tokens, mode)"
    assert "| 256 | pipeline2 | 8.06 (8.01-8.16) | 1.14x |" in text
    assert "capacity factors measured: 1.5 (dispatch), 2.2 (experts)" in text
    assert "- auto at 256 tokens picks pipeline2 (8.06 ms), the measured best" in text
    assert "KV pages" not in text, "a report from before the page size was recorded"
    report["setup"]["capacity"]["chunk_dispatch"] = {"2": [1.35, 2.1]}  # as measured since per-chunk factors
    assert "2.2 (experts), 1.35 / 2.1 (dispatch chunks of 2 expert groups)" in modes_table.render(report)
    paged = json.loads((ROOT / "benchmarks/h200/modes_moe_decode_nocomm_kv128.json").read_text())
    assert "; KV pages of 128 tokens" in modes_table.render(paged)
    split_report = json.loads((ROOT / "benchmarks/h200x2/dense_tp_prefill_graphs_nvlink_green.json").read_text())
    with pytest.raises(ValueError, match="not an overlap-modes report"):
        modes_table.render(split_report)


def test_sweep_at_ratio_scales_the_probes_bandwidth_to_the_asked_ratio():
    # M 6 ms at 10 GB/s against C 4 ms: M / C 0.5 needs M 2 ms, three times the bandwidth
    probe = [sweep_at_ratio.Probe(10.0, 4.0, 6.0)]
    assert sweep_at_ratio.link_for_ratio(0.5, probe, copy_gbps=None) == "host:30"
    assert sweep_at_ratio.link_for_ratio(0.5, probe, copy_gbps=100.0) == "host:30"
    assert sweep_at_ratio.link_for_ratio(0.5, probe, copy_gbps=32.0) == "host:", "past the copy engines"


def test_sweep_at_ratio_fits_the_copies_fixed_part_through_two_probes():
    """M = 1 ms + 20 / GBps against C 10 ms: one probe at 10 GB/s (M 3) takes M as 30 / GBps and
    asks 15 GB/s for M / C 0.2, where M is 2.33; the fit through both finds the fixed ms and asks
    20. Where the fixed part alone is the asked share, no bandwidth reaches it; where M did not
    fall between the probes (noise), the last one is read as 1 / bandwidth again."""
    probes = [sweep_at_ratio.Probe(10.0, 10.0, 3.0)]
    assert sweep_at_ratio.link_for_ratio(0.2, probes, None) == "host:15"
    probes.append(sweep_at_ratio.Probe(15.0, 10.0, 1 + 20 / 15))
    assert sweep_at_ratio.link_for_ratio(0.2, probes, None) == "host:20"
    assert sweep_at_ratio.link_for_ratio(0.08, probes, None) == "host:", "the fixed 1 ms alone is M / C 0.1"
    flat = [sweep_at_ratio.Probe(10.0, 10.0, 3.0), sweep_at_ratio.Probe(15.0, 10.0, 3.0)]
    assert sweep_at_ratio.link_for_ratio(0.2, flat, None) == "host:22.5"


def fake_bench(calls, latency_ms, transfer, compute_ms):
    """ubatch-bench's report for a link whose M is ``latency_ms + transfer / GBps``."""

    def bench(flags, out):
        calls.append(flags)
        gbps = float(flags[flags.index("--link") + 1].split(":")[1])
        row = {"mode": "unsplit", "compute_ms": compute_ms, "comm_ms": latency_ms + transfer / gbps}
        return {"results": [row], "setup": {"link": {"copy_engine_gbps": 50.0}}, "args": {}}

    return bench


@pytest.mark.parametrize(
    "probe_gbps, links",
    [(10.0, ["host:10:w8", "host:15:w8", "host:20:w8"]), (20.0, ["host:20:w8", "host:20:w8"])],
)
def test_sweep_at_ratio_probes_again_only_where_the_first_probe_missed(tmp_path, monkeypatch, probe_gbps, links):
    """Over M = 1 ms + 20 / GBps against C 10 ms: a probe that misses M / C 0.2 is followed by one
    more, and the sweep runs where the two put it; a probe that hits it sets the sweep's link."""
    calls = []
    monkeypatch.setattr(sweep_at_ratio, "bench", fake_bench(calls, 1.0, 20.0, 10.0))
    out = tmp_path / "sweep.json"
    argv = ["--ratio", "0.2", "--world", "8", "--probe-gbps", str(probe_gbps), "--out", str(out)]
    sweep_at_ratio.main([*argv, "--", "--modes", "split2"])
    assert [flags[flags.index("--link") + 1] for flags in calls] == links
    recorded = json.loads(out.read_text())["setup"]["link_ratio"]
    assert recorded["link"] == "host:20:w8" and len(recorded["probes"]) == len(links) - 1
    assert recorded["reached"] == 0.2


def test_sweep_at_ratio_says_where_the_sweep_missed_the_asked_ratio(tmp_path, monkeypatch, capsys):
    """The probes fit M = 1 ms + 20 / GBps, but the sweep's own process measures M 20% longer."""
    calls = []
    probe_link = fake_bench(calls, 1.0, 20.0, 10.0)

    def bench(flags, out):
        report = probe_link(flags, out)
        if "--repeats" not in flags:  # the sweep, not a probe
            report["results"][0]["comm_ms"] *= 1.2
        return report

    monkeypatch.setattr(sweep_at_ratio, "bench", bench)
    out = tmp_path / "sweep.json"
    sweep_at_ratio.main(["--ratio", "0.2", "--probe-gbps", "20", "--out", str(out), "--", "--modes", "split2"])
    assert json.loads(out.read_text())["setup"]["link_ratio"]["reached"] == 0.24
    assert "the sweep reached M / C 0.24 (asked 0.2): the link ran otherwise" in capsys.readouterr().out


def test_sweep_at_ratio_says_when_the_copy_engines_full_speed_is_still_too_slow():
    """deepseek-bench's 4096-token prefill as one rank of eight took M / C 1.46 at the copy
    engines' full speed (run 19): no setting of the stand-in reaches 0.9 there."""
    assert sweep_at_ratio.miss_reason(0.9, 1.46, "host::w8").startswith(": at the copy engines' full speed")
    assert sweep_at_ratio.miss_reason(0.9, 1.2, "host:20:w8") == (
        ": the link ran otherwise in the sweep's process than in the probe's"
    )
    assert sweep_at_ratio.miss_reason(0.9, 0.5, "host::w8").startswith(": the link ran otherwise")
    assert sweep_at_ratio.miss_reason(0.9, 0.92, "host::w8") == ""


def test_sweep_at_ratio_probes_the_unsplit_step_of_the_sweeps_flags():
    flags = ["--workload", "decode", "--modes", "split2,split2+join", "--tokens", "256"]
    assert sweep_at_ratio.probe_flags(flags, "host:10:w8") == [
        *["--workload", "decode", "--modes", "overlap", "--tokens", "256"],
        *["--repeats", "3", "--link", "host:10:w8"],
    ]
    with pytest.raises(SystemExit, match="--modes"):
        sweep_at_ratio.probe_flags(["--workload", "decode"], "host:10")


def test_sweep_at_ratio_runs_the_sweep_at_the_probes_bandwidth_and_records_it(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["--ratio", "0.5", "--world", "4", "--probe-gbps", "1", "--out", str(out), "--"]
    sweep_at_ratio.main([*argv, "--preset", "tiny-moe", "--tokens", "16", "--modes", "split2", "--repeats", "1"])
    report = json.loads(out.read_text())
    recorded = report["setup"]["link_ratio"]
    probes = [sweep_at_ratio.Probe(**probe) for probe in recorded["probes"]]
    assert 1 <= len(probes) <= sweep_at_ratio.MAX_PROBES and probes[0].gbps == 1.0
    assert recorded["link"] == report["args"]["link"] and recorded["link"].endswith(":w4")
    assert [row["mode"] for row in report["results"]] == ["unsplit", "split2"]
    assert f"asks --link {recorded['link']}" in capsys.readouterr().out


def test_sweep_at_ratio_sets_the_link_itself(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sweep_at_ratio.main(
            ["--ratio", "0.9", "--out", str(tmp_path / "x.json"), "--", "--modes", "split2", "--link", "host"]
        )
    assert "the script sets --link" in capsys.readouterr().err


def test_the_expert_group_bench_routes_every_token_to_top_k_experts():
    import torch

    ends = bench_expert_groups.routed_offsets(1024, 8, 2, torch.Generator().manual_seed(0))
    counts = [b - a for a, b in zip([0, *ends], ends)]
    assert len(ends) == 8 and ends[-1] == 2048 and min(counts) > 0
    assert max(counts) < 2 * 2048 / 8, f"a random router this uneven is not the presets' routing: {counts}"


def test_skewed_rows_keep_their_total_and_fewer_rows_fill_tiles_worse():
    import torch

    generator = torch.Generator().manual_seed(0)
    assert expert_counts(4, 100, 0.0, generator) == [100] * 4
    counts = expert_counts(16, 512, 0.35, generator)
    assert len(counts) == 16 and sum(counts) == 16 * 512 and max(counts) > 512 > min(counts)
    assert tile_fill([128, 256], 128) == 1.0
    assert tile_fill([129, 1], 64) == pytest.approx(256 / 130)
    assert tile_fill([], 128) == 1.0
    assert spread_fields([129, 1], 65) == {
        "fullest": round(129 / 65, 3),
        "tile_fill_64": round(256 / 130, 4),
        "tile_fill_128": round(384 / 130, 4),
    }

    def mean_fill(rows):
        draws = [expert_counts(16, rows, 0.35, generator) for _ in range(40)]
        return sum(tile_fill(c, 128) for c in draws) / len(draws)

    assert mean_fill(512) > mean_fill(2048) + 0.05  # a quarter of the rows: about 1.12x against 1.03x
    with pytest.raises(ValueError, match="skew must be >= 0, got -0.1"):
        expert_counts(4, 100, -0.1, generator)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variants", "same,fast"], "unknown variants ['fast']"),
        (["--hosts", "pageable"], "unknown host memory kinds ['pageable']"),
        (["--chunks", "0"], "--mib and --chunks must be positive"),
    ],
)
def test_conditional_copy_probe_refuses_bad_arguments_before_touching_a_gpu(argv, message, monkeypatch, capsys):
    probe = _load("probe_conditional_copy")
    monkeypatch.setattr(sys, "argv", ["probe_conditional_copy.py", *argv])
    with pytest.raises(SystemExit) as exc:
        probe.main()
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_router_bench_refuses_to_run_without_a_gpu(monkeypatch, capsys):
    bench_router = _load("bench_router")
    monkeypatch.setattr(bench_router.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_router.py", "--rows", "8"])
    with pytest.raises(SystemExit) as exc:
        bench_router.main()
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_chunk_padding_rows_follow_the_uniform_router_and_groups_pad_more_than_the_call(capsys):
    from ubatch.models.dispatch import balanced_chunk_rows

    counts = chunk_padding.group_rows(64, 32, 4, 4, 4, samples=300)
    assert counts.shape == (300, 4)
    expected = balanced_chunk_rows(64, 32, 4, 4, 4)
    assert counts.double().mean(dim=0).tolist() == pytest.approx(expected, rel=0.15)
    report = chunk_padding.padding(counts, 0.99, 3.0)
    assert 1.0 < report["call_capacity"] < report["groups_sum"]
    assert all(c > 1.0 for c in report["group_capacities"])
    ends = report["run_ends"]
    assert ends == sorted(ends) and 0 < ends[0] and ends[-1] <= 1.0
    assert all(0.0 <= share <= 0.05 for share in report["spill"])
    with pytest.raises(ValueError, match="30 experts do not split into 4 ranks of 4 groups"):
        chunk_padding.group_rows(64, 30, 4, 4, 4, samples=1)
    with pytest.raises(ValueError, match="samples must be an integer >= 1, got 0"):
        chunk_padding.group_rows(64, 32, 4, 4, 4, samples=0)
    with pytest.raises(ValueError, match="top_k=40 is more than the 32 experts"):
        chunk_padding.group_rows(64, 32, 40, 4, 4, samples=1)
    with pytest.raises(ValueError, match="quantile must lie between 0 and 1, got 1.5"):
        chunk_padding.padding(counts, 1.5, 3.0)
    chunk_padding.main("--tokens 32 --experts 16 --top-k 2 --world 2 --groups 2 --samples 50".split())
    assert "in all" in capsys.readouterr().out


def test_mode_kernels_refuses_a_trace_dir_it_cannot_make_before_any_work(monkeypatch, tmp_path, capsys):
    mode_kernels = _load("mode_kernels")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setattr(sys, "argv", ["mode_kernels.py", "--trace-dir", str(blocker / "traces")])
    with pytest.raises(SystemExit):
        mode_kernels.main()
    assert f"--trace-dir '{blocker / 'traces'}' cannot be made" in capsys.readouterr().err


def test_the_probes_triton_grouped_gemm_matches_per_expert_products_under_the_interpreter():
    """Experts with no rows, rows that end mid-tile, N and K that end mid-block: each expert's rows
    times its weights, as ``torch._grouped_mm`` computes them, by pointer loads and by descriptors.
    In float32 only: Triton 3.9's interpreter multiplies bf16 blocks wrongly in ``tl.dot`` (1e10 off
    on 16x16 randn); the probe checks its bf16 results against torch's on the GPU."""
    from tests.interpreted import run_interpreted

    run_interpreted(
        f"""
import importlib.util, torch
spec = importlib.util.spec_from_file_location("probe", {str(ROOT / "scripts" / "probe_grouped_gemm.py")!r})
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
g = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-4),):
    cases = (([5, 0, 17], 48, 40, (16, 32, 16)), ([0, 33, 1, 0], 20, 24, (32, 16, 8)), ([0, 0], 8, 8, (16, 16, 8)))
    for counts, n, k, config in cases:
        w = torch.randn(len(counts), n, k, generator=g).to(dtype)
        x = torch.randn(sum(counts), k, generator=g).to(dtype)
        ends = torch.tensor(counts).cumsum(0).to(torch.int32)
        for tma in (False, True):
            out = probe.grouped_gemm(x, w, ends, config, tma=tma)
            assert out.shape == (sum(counts), n)
            start = 0
            for e, rows in enumerate(counts):
                want = x[start : start + rows].float() @ w[e].float().T
                got = out[start : start + rows].float()
                assert torch.allclose(got, want, atol=tol * k, rtol=tol), (tma, counts, e, (got - want).abs().max())
                start += rows
print("interpreted kernel ok")
""",
        timeout=300,
    )


def test_proxy_link_probe_refuses_to_run_without_a_gpu(monkeypatch, capsys):
    probe = _load("probe_proxy_link")
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["probe_proxy_link.py"])
    with pytest.raises(SystemExit) as exc:
        probe.main()
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_proxy_link_host_thread_waits_the_links_time_for_the_bytes_it_is_given():
    import ctypes
    import time

    probe = _load("probe_proxy_link")
    library = probe._c_proxy()
    if library is None:
        pytest.skip("no C compiler")
    doorbell, done, nbytes = (ctypes.c_uint32 * 2)(), (ctypes.c_uint32 * 2)(), ctypes.c_uint64(0)
    state = probe._Proxy(
        doorbell=ctypes.addressof(doorbell),
        done=ctypes.addressof(done),
        bytes=ctypes.addressof(nbytes),
        bytes_per_ns=1.0,  # 1 GB/s
        latency_ns=0.0,
    )
    assert library.proxy_start(ctypes.byref(state)) == 0
    try:
        for size in (0, 20_000_000):  # 20 ms at 1 GB/s
            nbytes.value, done[0] = size, 0
            start = time.perf_counter()
            doorbell[0] = 1
            while done[0] != 1:
                assert time.perf_counter() - start < 5, "the host thread never completed the transfer"
            elapsed = time.perf_counter() - start
            assert doorbell[0] == 0 and elapsed >= size / 1e9
    finally:
        library.proxy_stop(ctypes.byref(state))
    assert state.seen == 2


def test_sweep_at_ratio_proxy_links_have_no_copy_engine_cap():
    probe = [sweep_at_ratio.Probe(10.0, 10.0, 15.0)]  # 150 ms * GB/s of bytes
    assert sweep_at_ratio.link_for_ratio(0.5, probe, copy_gbps=32.0, kind="proxy") == "proxy:30"
    assert sweep_at_ratio.link_for_ratio(0.001, probe, None, kind="proxy") == "proxy:1e+03"


def test_sweep_at_ratio_says_how_late_a_proxy_links_flags_were_taken_back():
    """A proxy-paced link's report carries how late the GPU took its flags back; the sweep's last
    line says it (a warp that waited for an SM stretched its transfers), and nothing for any other
    link."""
    lag = {"mean": 2.5, "max": 40.0, "transfers": 960}
    assert sweep_at_ratio.flag_lag_note({"flag_lag_us": lag}) == (
        "; the GPU took the link's flags back 2.5 us late on average, 40 at most"
    )
    assert sweep_at_ratio.flag_lag_note({"copy_engine_gbps": 50.0}) == ""
