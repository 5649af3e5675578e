"""How a report reads: the machine it ran on, its table, and the sentences that say what the
figures mean. The table, the notes and the plot's title all take a row's speedup from
``speedup_text``, so they never disagree."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import psutil
import torch

from ubatch.attention.backends import AttentionBackend, describe_backend

_GIB = 1 << 30
CODE_VERSION_ENV = "UBATCH_CODE_VERSION"  # set where the checkout has no git history (a copied tree)


def code_version() -> str | None:
    """The code a report measured: ``$UBATCH_CODE_VERSION`` if set, else ``git describe --always
    --dirty`` of the checkout this package runs from; None where neither says (an installed wheel,
    a copy without its history)."""
    if os.environ.get(CODE_VERSION_ENV):
        return os.environ[CODE_VERSION_ENV]
    here = os.path.dirname(os.path.abspath(__file__))
    top = _git(here, "rev-parse", "--show-toplevel")
    mine = None if top is None else os.path.join(top, "ubatch", "bench")
    if mine is None or not os.path.isdir(mine) or not os.path.samefile(mine, here):
        return None  # not this package's own checkout (e.g. site-packages inside another repo)
    return _git(here, "describe", "--always", "--dirty")


def code_tree(root: str | None = None) -> str:
    """The id git gives the package's tree of ``.py`` files (``git rev-parse COMMIT:ubatch``),
    computed from the files themselves: it names the code a report measured where ``code`` cannot,
    as in a copied tree whose git history is stale (the GPU machine's copy once reported its
    history's commit while running later files). ``root`` defaults to this package's folder."""
    return _tree_id(root or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tree_id(folder: str) -> str:
    entries = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and name != "__pycache__":
            if _holds_python(path):
                entries.append((name + "/", b"40000 " + name.encode() + b"\0" + bytes.fromhex(_tree_id(path))))
        elif name.endswith(".py") and os.path.isfile(path):
            with open(path, "rb") as f:
                blob = _git_object(b"blob", f.read())
            entries.append((name, b"100644 " + name.encode() + b"\0" + bytes.fromhex(blob)))
    return _git_object(b"tree", b"".join(entry for _, entry in sorted(entries)))


def _holds_python(folder: str) -> bool:
    return any(name.endswith(".py") for _, _, names in os.walk(folder) for name in names)


def _git_object(kind: bytes, body: bytes) -> str:
    return hashlib.sha1(kind + b" %d\0" % len(body) + body).hexdigest()


def _git(cwd: str, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def environment(device: torch.device, world: int, attention: AttentionBackend) -> dict[str, Any]:
    """Where the figures come from: versions, device, ranks, and the host's cores, memory and load
    average (this run's own ranks included) with this process's resident memory when the report
    was made: another process on the cores, or a host short of memory, shows in the timings."""
    memory = psutil.virtual_memory()
    env = {
        "machine": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "attention": describe_backend(attention),
        "world_size": world,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "code": code_version(),
        "code_tree": code_tree(),
        "host_cores": psutil.cpu_count(logical=True),
        "host_physical_cores": psutil.cpu_count(logical=False),
        "host_memory_gib": round(memory.total / _GIB, 2),
        "host_memory_available_gib": round(memory.available / _GIB, 2),
        "process_rss_gib": round(psutil.Process().memory_info().rss / _GIB, 3),
        "host_load_1m": round(psutil.getloadavg()[0], 2),
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def _num(value: float) -> str:
    """Three significant figures, without an exponent."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _with_range(row: dict[str, Any], key: str, low: str, high: str, unit: str = "") -> str:
    if row.get(key) is None:
        return "-"
    if row.get(low) is None or row.get(high) is None:
        return _num(row[key]) + unit
    return f"{_num(row[key])}{unit} ({_num(row[low])}-{_num(row[high])})"


def speedup_text(row: dict[str, Any]) -> str:
    """A row's speedup with its spread over the timed rounds ("1.2x (1.1-1.3)"), or "ruled out"."""
    if row.get("ruled_out"):
        return "ruled out"
    return _with_range(row, "speedup", "speedup_min", "speedup_max", unit="x")


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """The step rows as a fixed-width table: medians with (min-max) over the timed rounds."""
    graphs = any(r["graphs"] for r in results)
    columns = [
        ("tokens", lambda r: str(r["tokens_per_rank"])),
        ("N", lambda r: str(r["num_ubatches"])),
        *([("eager ms", lambda r: _cell(r.get("eager_baseline_ms")))] if graphs else []),
        (
            "graph ms" if graphs else "unsplit ms",
            lambda r: _with_range(r, "baseline_ms", "baseline_min_ms", "baseline_max_ms"),
        ),
        (
            "graph N ms" if graphs else "ubatched ms",
            lambda r: _with_range(r, "ubatched_ms", "ubatched_min_ms", "ubatched_max_ms"),
        ),
        ("speedup", speedup_text),
        ("C ms", lambda r: _cell(r.get("compute_ms"))),
        ("M ms", lambda r: _cell(r.get("comm_ms"))),
        ("ideal", lambda r: _cell(r.get("ideal_speedup"))),
        ("effic.", lambda r: _cell(r.get("efficiency"))),
        *(
            [
                ("queued", lambda r: "-" if r.get("queued_speedup") is None else f"{_num(r['queued_speedup'])}x"),
                ("queued effic.", lambda r: _cell(r.get("queued_efficiency"))),
            ]
            if _any(results, "queued_speedup")
            else []
        ),
        *([("bound", lambda r: _cell(r.get("efficiency_bound")))] if graphs else []),
        *([("ceiling", lambda r: _cell(r.get("efficiency_ceiling")))] if _any(results, "efficiency_ceiling") else []),
        ("hidden", lambda r: _cell(r.get("hidden_comm_fraction"))),
        ("hideable", lambda r: _cell(r.get("hideable_comm_fraction"))),
        ("M stretch", lambda r: _cell(r.get("comm_stretch"))),
        ("model ms", lambda r: _cell(r.get("schedule_model_stretched_ms"))),
    ]
    rows = [[cell(r) for _, cell in columns] for r in results]
    widths = [max(len(head), *(len(row[i]) for row in rows)) for i, (head, _) in enumerate(columns)]
    lines = ["  ".join(head.rjust(w) for (head, _), w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _padded(results: Sequence[dict[str, Any]]) -> bool:
    """Whether any mode's dispatches sent other than the unsplit step's rows (``payload_ratio``)."""
    return any(r.get("payload_ratio") not in (None, 1.0) for r in results)


def _any(results: Sequence[dict[str, Any]], key: str) -> bool:
    """Whether any row has ``key`` set (a column only where a report measured it)."""
    return any(r.get(key) is not None for r in results)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def row_note(row: dict[str, Any]) -> str:
    """One plain sentence on what a row's speedup says."""
    where = f"{row['tokens_per_rank']} tokens, N={row['num_ubatches']}"
    rounds = f"over {row['repeats']} rounds" if row.get("repeats") else "one timing"
    ideal = row["ideal_speedup"]
    if row.get("ruled_out"):
        return (
            f"{where}: measured {_num(row['measured_speedup'])}x, yet every round beat the ideal "
            f"{_num(ideal)}x that this run's own C and M allow: a measurement error (noise, another "
            f"process on the cores), not a speedup; rerun it, with more --repeats"
        )
    low, high = row.get("speedup_min"), row.get("speedup_max")
    figure = f"{speedup_text(row)} {rounds}"
    if row["comm_ms"] <= 0:
        return f"{where}: {figure}; no communication, so a split can only add cost"
    if high is not None and high < 1:
        return f"{where}: {figure}: the split cost more than it hid, in every round"
    if low is not None and low > 1:
        return f"{where}: {figure} of an ideal {_num(ideal)}x: the split hid communication in every round"
    faster = "faster" if row["measured_speedup"] >= 1 else "slower"
    return f"{where}: {figure}: {faster} at the median, but the rounds straddle 1x (ideal {_num(ideal)}x)"


def policy_sentence(point: dict[str, Any], results: Sequence[dict[str, Any]]) -> str:
    """The policy's pick beside the measured best at one sweep point, in words."""
    tokens, choice, best = point["tokens_per_rank"], point["choice"], point["best"]
    rows = [r for r in results if r["tokens_per_rank"] == tokens]
    times = (
        f"{_num(point['best_ms'])} ms"
        if choice == best
        else (f"{_num(point['best_ms'])} ms vs {_num(point['auto_ms'])} ms for auto's pick")
    )
    if choice == 1 and all(r["comm_ms"] <= 0 for r in rows):
        return (
            f"auto keeps the {tokens}-token step whole: nothing to hide (no communication); measured best is "
            f"{best} ({times})"
        )
    pick = f"keeps the {tokens}-token step whole" if choice == 1 else f"splits the {tokens}-token step in {choice}"
    sentence = f"auto {pick}: measured best is {best} ({times})"
    doubtful = [r["num_ubatches"] for r in rows if r.get("ruled_out")]
    if doubtful:
        sentence += f"; N={', '.join(map(str, doubtful))} ruled out by its ideal, so this comparison is noise"
    return sentence


def plot_title(row: dict[str, Any], *, preset: str, workload: str, world: int, label: str) -> str:
    """The timeline's title, with the speedup as the table prints it (or why it prints none)."""
    ideal = f"{_num(row['ideal_speedup'])}x"
    figure = (
        f"measured {_num(row['measured_speedup'])}x, ruled out by its ideal {ideal}"
        if row.get("ruled_out")
        else f"speedup {speedup_text(row)} of ideal {ideal}"
    )
    return (
        f"{preset} {workload}, {row['tokens_per_rank']} tokens/rank, N={row['num_ubatches']}, world {world}"
        f"{' ' + label if label else ''}: {figure}"
    )


LEGEND = """\
What the columns mean:
  unsplit / ubatched ms  one step run whole / split in N ubatches: the median over the timed rounds (each round
                         runs both), (min-max) beside it
  speedup                unsplit over ubatched; "ruled out" where every round beat the ideal (a measurement error)
  C ms, M ms             the step's compute and communication, timed apart in a serial run of this same process
  ideal                  (C + M) / max(C, M): the speedup if the shorter of the two hid entirely under the other
  effic.                 (speedup - 1) / (ideal - 1): the share of the ideal gain reached
  hidden                 the share of communication that ran while another ubatch computed"""

CPU_NOTE = (
    "On a CPU, gloo moves the data on the same cores the ranks compute on, so what a split hides is "
    "partly paid again: the ideal assumes communication costs no compute."
)


def run_summary(report: dict[str, Any]) -> str:
    """What the run measured, in one sentence."""
    setup, env, rows = report["setup"], report["environment"], report["results"]
    world = env["world_size"]
    model = f"{setup['preset']} ({setup['num_layers']} layers" + (
        f", {setup['num_experts']} experts)" if setup["num_experts"] else ")"
    )
    if world == 1:
        ranks = "in one process, so nothing is sent between ranks"
    else:
        how = {"here": "started by this run", "torchrun": "started by torchrun"}[setup["launched"]]
        parallel = "expert-parallel" if setup["kind"] == "moe" else "tensor-parallel"
        backend = "NCCL" if env["device"].startswith("cuda") else "gloo"
        ranks = f"{parallel} over {world} {backend} ranks {how}"
    cores = (
        f" on {env['host_cores']} CPU cores (load average {env['host_load_1m']:g}, this run included)"
        if env["device"] == "cpu"
        else f" on {env['device']}"
    )
    sizes = ", ".join(str(t) for t in dict.fromkeys(r["tokens_per_rank"] for r in rows))
    return (
        f"{model} {ranks}{cores}: one {rows[0]['workload']} step of {sizes} tokens per rank, "
        f"{rows[0]['repeats']} timed rounds"
    )


def format_modes_table(results: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """One row per (tokens, overlap mode): median (min-max), speedup over the same run's
    unsplit step (of the medians, and of rounds timed back to back), its ideal and efficiency, the
    most efficiency the weights the mode reads again leave it (``ubatch.bench.ceiling``), the
    efficiency the schedule model allows it (where it describes the mode; ``ubatch.bench.schedule``) and
    the rows its dispatches send over the unsplit step's (where any mode's differ), the
    dropped share, the roofline, (where measured) the host's time to issue one run, and (where
    measured) the same with steps queued (``ubatch.bench.modes``: per-step ms, paired speedup,
    efficiency, roofline share); aligned text, or a markdown table (``markdown``, as
    benchmarks/RESULTS.md shows a report)."""
    columns = [
        ("tokens", lambda r: str(r["tokens_per_rank"])),
        ("mode", lambda r: r["mode"]),
        ("ms", lambda r: _with_range(r, "median_ms", "min_ms", "max_ms")),
        ("speedup", lambda r: "ruled out" if r["above_ideal"] else f"{_num(r['speedup'])}x"),
        ("paired", lambda r: _paired_cell(r, "paired")),
        ("C ms", lambda r: _cell(r.get("compute_ms"))),
        ("M ms", lambda r: _cell(r.get("comm_ms"))),
        ("ideal", lambda r: _cell(r.get("ideal_speedup"))),
        ("effic.", lambda r: _cell(r.get("efficiency"))),
        ("paired effic.", lambda r: _cell(r.get("paired_efficiency"))),
        ("ceiling", lambda r: _cell(r.get("efficiency_ceiling"))),
        *(
            [("model effic.", lambda r: _cell(r.get("schedule_model_efficiency")))]
            if _any(results, "schedule_model_ms")
            else []
        ),
        *(
            [("taxed model", lambda r: _cell(r.get("schedule_model_taxed_efficiency")))]
            if _any(results, "schedule_model_taxed_ms")
            else []
        ),
        *([("rows sent", lambda r: f"{r['payload_ratio']:.3g}x")] if _padded(results) else []),
        ("dropped", lambda r: _cell(r.get("dropped_fraction"))),
        (
            "roofline",
            lambda r: (
                "-"
                if r.get("roofline_fraction") is None
                else f"{100 * r['roofline_fraction']:.0f}% of {r['roofline_ms']:.3g}"
            ),
        ),
    ]
    if _any(results, "host_ms"):  # reports from before 2026-12-02 have none
        columns.append(("host ms", lambda r: _cell(r.get("host_ms"))))
    if _any(results, "queued_ms"):  # reports from before 2026-12-06 have none
        columns += [
            ("queued ms", lambda r: _cell(r.get("queued_ms"))),
            ("queued paired", lambda r: _paired_cell(r, "queued")),
            ("queued effic.", lambda r: _cell(r.get("queued_efficiency"))),
            ("queued roofline", lambda r: _percent(r.get("queued_roofline_fraction"))),
        ]
    rows = [[cell(r) for _, cell in columns] for r in results]
    if markdown:
        lines = ["| " + " | ".join(head for head, _ in columns) + " |", "|" + " - |" * len(columns)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(head), *(len(row[i]) for row in rows)) for i, (head, _) in enumerate(columns)]
    lines = ["  ".join(head.rjust(w) for (head, _), w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _paired_cell(row: dict[str, Any], kind: str) -> str:
    """The speedup timed round by round against the kept baseline (``kind`` "paired", or "queued"
    for steps queued), with its middle half of rounds (reports before 2026-12-05 have none; the
    baseline's row neither)."""
    if row.get(f"{kind}_speedup") is None:
        return "-"
    q1, q3 = row[f"{kind}_speedup_iqr"]
    return f"{row[f'{kind}_speedup']:.3f}x ({q1:.3f}-{q3:.3f})"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def modes_policy_sentence(point: dict[str, Any]) -> str:
    """The mode policy's pick at one size, beside the best measured mode."""
    where = f"at {point['tokens_per_rank']} tokens"
    if point["choice"] == point["best"]:
        sentence = f"auto {where} picks {point['choice']} ({_num(point['auto_ms'])} ms), the measured best"
    else:
        sentence = (
            f"auto {where} picks {point['choice']} ({_num(point['auto_ms'])} ms); measured best is "
            f"{point['best']} ({_num(point['best_ms'])} ms): {point['auto_vs_best']:.3f}x of best"
        )
    paired = point.get("paired")  # reports from before 2026-12-02 have none; None where nothing was paired
    if paired:
        sentence += (
            f"; timed back to back against {paired['against']} ({paired['rounds']} rounds): "
            f"{paired['auto_vs_best']:.3f}x"
        )
    return sentence
