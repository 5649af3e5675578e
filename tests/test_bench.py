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
