"""ubatch-bench --quick on CPU writes a consistent report and a timeline plot."""

import json

from ubatch.bench import main


def test_quick_run_writes_report_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "report.json", tmp_path / "timeline.png"
    main(["--quick", "--device", "cpu", "--out", str(out), "--plot", str(plot)])
    report = json.loads(out.read_text())
    assert report["environment"]["torch"] and report["results"]
    for r in report["results"]:
        assert abs(r["speedup"] - r["baseline_ms"] / r["ubatched_ms"]) < 1e-2
        assert r["ideal_speedup"] >= 1.0 and r["compute_ms"] > 0
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
