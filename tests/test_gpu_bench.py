"""ubatch-bench --graphs on one GPU: the profiler records the kernels of a graph replay (and only
of the call it is meant to record), and a decode run of the tiny MoE writes a consistent report."""

import json

import pytest
import torch

from ubatch.bench.cli import main
from ubatch.bench.kernels import hidden_kernel_fraction, kernels_in_trace, profile_kernels
from ubatch.bench.measure import event_times_ms


def _elementwise_graph():
    """Three elementwise kernels (no library handles to create inside the capture), warmed up
    eagerly first so that no kernel module loads during the capture."""
    x = torch.randn(4096, device="cuda")
    (x * 2).sin_().add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (x * 2).sin_().add_(1)
    return graph


@pytest.mark.cuda
def test_event_times_are_the_device_time_of_each_timed_call():
    """A kernel held ~1 ms on the device (while the host returns at once) is timed at about that,
    once per repeat, after the warm-up calls."""
    calls = []

    def held():
        calls.append(1)
        torch.cuda._sleep(2_000_000)

    times = event_times_ms(held, warmup=2, repeats=4)
    assert len(calls) == 6 and len(times) == 4
    assert all(0.2 < t < 50 for t in times)


@pytest.mark.cuda
def test_profiler_records_the_kernels_of_a_graph_replay():
    graph, device = _elementwise_graph(), torch.device("cuda")
    kernels = profile_kernels(graph.replay, device)
    assert len(kernels) >= 3 and all(k.end_us >= k.start_us for k in kernels)
    assert not any(k.is_comm for k in kernels) and hidden_kernel_fraction(kernels) is None
    calls = []

    def replay_first_call_only():
        calls.append(None)
        if len(calls) == 1:
            graph.replay()

    assert profile_kernels(replay_first_call_only, device) == []  # the first call is a discarded warm-up
    assert len(calls) == 2


@pytest.mark.cuda
def test_graphs_decode_report_on_one_gpu(tmp_path, capsys):
    out, trace = tmp_path / "report.json", tmp_path / "trace.json"
    main(
        [
            "--graphs",
            "--workload",
            "decode",
            "--quick",
            "--preset",
            "tiny-moe",
            "--policy",
            "auto",
            "--out",
            str(out),
            "--chrome-trace",
            str(trace),
        ]
    )
    report = json.loads(out.read_text())
    assert report["environment"]["device"].startswith("cuda")
    (r,) = report["results"]  # --quick: 256 tokens, N=2
    assert (r["tokens_per_rank"], r["num_ubatches"], r["world_size"]) == (256, 2, 1)
    assert r["graphs"] is True
    assert r["baseline_ms"] > 0 and r["ubatched_ms"] > 0 and r["eager_baseline_ms"] > 0 and r["compute_ms"] > 0
    assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["ubatched_ms"], abs=1e-2)
    assert r["comm_ms"] >= 0 and r["ideal_speedup"] >= 1.0
    assert r["hidden_comm_fraction"] is None and r["comm_stretch"] is None  # one rank: no NCCL kernels
    assert r["ubatched_compute_ms"] > 0 and r["ubatched_comm_ms"] == 0
    (point,) = report["auto"]["points"]
    assert point["choice"] in (1, 2) and point["best"] in (1, 2) and set(r["capture_time_ms"]) == {"1", "2"}
    kernels = kernels_in_trace(json.loads(trace.read_text()))
    assert kernels and not any(k.is_comm for k in kernels)
    assert "eager ms" in capsys.readouterr().out


@pytest.mark.cuda
def test_generate_workload_eager_and_graphs_on_one_gpu(tmp_path):
    out = tmp_path / "gen.json"
    main(["--workload", "generate", "--graphs", "--quick", "--model", "dense", "--preset", "small", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["graphs"], r["drafter"]) for r in rows] == [
        (g, d) for g in (False, True) for d in (None, "self", "truncated")
    ]
    assert all(r["tokens_per_s"] > 0 and r["generated_tokens"] == 4 * 8 for r in rows)
    assert all(r["acceptance_rate"] > 0.9 for r in rows if r["drafter"] == "self")
