"""ubatch.bench.gaps: a profiled step's idle time per lane, host-bound or waiting, from synthetic
traces and from the committed ones."""

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ubatch.bench.gaps import Activity, lane_activities, lane_gaps, step_gaps

ROOT = Path(__file__).resolve().parents[1]


def test_a_gap_ended_by_a_just_launched_activity_is_host_bound():
    acts = [Activity(0, 10, 1), Activity(50, 60, 2)]
    assert lane_gaps(acts, {1: -5, 2: 45}) == pytest.approx((0.060, 0.020, 0.040, 0.0))


def test_a_gap_ended_by_an_activity_queued_long_before_is_waiting():
    acts = [Activity(0, 10, 1), Activity(50, 60, 2)]
    assert lane_gaps(acts, {1: -5, 2: 3}) == pytest.approx((0.060, 0.020, 0.0, 0.040))


def test_only_the_first_activity_of_a_launch_can_be_host_bound():
    """A graph's kernels share its launch's correlation: the third waited on the graph, not the
    host, even though the launch call returned just before it started."""
    acts = [Activity(0, 10, 7), Activity(10, 20, 7), Activity(40, 50, 7)]
    assert lane_gaps(acts, {7: 35}) == pytest.approx((0.050, 0.030, 0.0, 0.020))


def test_an_activity_without_a_known_launch_ends_a_waiting_gap():
    acts = [Activity(0, 10), Activity(30, 40, 9)]
    assert lane_gaps(acts, {}) == pytest.approx((0.040, 0.020, 0.0, 0.020))


def test_overlapping_activities_count_once_and_an_empty_lane_is_zero():
    acts = [Activity(0, 30, 1), Activity(10, 20, 2), Activity(25, 40, 3)]
    assert lane_gaps(acts, {}) == pytest.approx((0.040, 0.040, 0.0, 0.0))
    assert lane_gaps([], {}) == (0.0, 0.0, 0.0, 0.0)


@given(
    st.lists(
        st.tuples(st.floats(0, 1e4), st.floats(0, 500), st.integers(0, 20), st.floats(-100, 100)),
        min_size=1,
        max_size=40,
    )
)
def test_span_is_busy_plus_idle(spec):
    acts = [Activity(start, start + dur, corr) for start, dur, corr, _ in spec]
    returns = {corr: start + lag for start, _, corr, lag in spec}
    g = lane_gaps(acts, returns)
    assert g.span_ms == pytest.approx(g.busy_ms + g.host_bound_ms + g.waiting_ms, abs=1e-9)
    assert min(g) >= 0


def _event(cat, name, ts, dur, correlation):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def test_lanes_split_compute_from_communication_and_skip_other_copies():
    trace = {
        "traceEvents": [
            _event("kernel", "void gemm_kernel<float>(...)", 0, 10, 1),
            _event("kernel", "ncclDevKernel_AllToAll", 5, 10, 2),
            _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 20, 5, 3),
            _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 30, 5, 4),
            _event("cuda_runtime", "cudaLaunchKernel", -10, 2, 1),
        ]
    }
    lanes = lane_activities(trace)
    assert [a.correlation for a in lanes["compute"]] == [1]
    assert [a.correlation for a in lanes["comm"]] == [2, 3]
    assert step_gaps(trace)["comm"] == pytest.approx((0.020, 0.015, 0.0, 0.005))


def test_the_committed_dense_split_trace_reads_host_bound():
    """RESULTS says dense TP prefill split in two over the stand-in is bound by the host: most of
    its compute lane's idle time ends with a kernel launched just then."""
    path = ROOT / "benchmarks/h200/traces_dense_prefill4096_link/split2_4096.json.gz"
    with gzip.open(path, "rt") as f:
        compute = step_gaps(json.load(f))["compute"]
    assert compute.span_ms == pytest.approx(compute.busy_ms + compute.host_bound_ms + compute.waiting_ms)
    assert compute.host_bound_ms > 5 * compute.waiting_ms
