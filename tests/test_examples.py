"""The examples run as documented, under torchrun over gloo and as one plain process: each checks
that the wrapped model equals the unwrapped one (float32, rtol = atol = 1e-5) and, with two ranks,
that its layers ran interleaved across ubatches; it exits non-zero otherwise."""

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.dist_utils import REPO, torchrun


def _python(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


def _check(result: subprocess.CompletedProcess, interleaved: bool) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    for n in (2, 3):
        assert f"N={n}: equals the unwrapped" in result.stdout, result.stdout
    if interleaved:
        assert result.stdout.count("interleaved: True") == 2, result.stdout


@pytest.mark.parametrize("example", ["own_module", "expert_parallel"])
def test_example_under_torchrun(example):
    _check(torchrun(2, f"examples/{example}.py"), interleaved=True)


@pytest.mark.parametrize("example", ["own_module", "expert_parallel"])
def test_example_in_one_process(example):
    _check(_python(f"examples/{example}.py"), interleaved=True)  # a group of one rank still yields


def test_joined_stage_example_runs_the_wide_part_once_per_layer():
    result = _python("examples/joined_stage.py")
    assert result.returncode == 0, result.stdout + result.stderr
    for n in (2, 3):
        assert f"N={n}: equals the unwrapped model: True; rows per wide call, per layer: [[10], [10], [10]]" in (
            result.stdout
        ), result.stdout


def test_transformers_tp_example_under_torchrun():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' tp_plan loading needs it
    result = torchrun(2, "examples/transformers_tp.py", timeout_s=300)
    _check(result, interleaved=True)
    assert "equals the unwrapped and the single-process model: True" in result.stdout


def test_transformers_tp_example_in_one_process():
    pytest.importorskip("transformers")
    _check(_python("examples/transformers_tp.py", timeout_s=300), interleaved=False)


@pytest.mark.cuda
def test_transformers_tp_example_on_cuda_runs_each_ubatch_on_its_own_stream():
    pytest.importorskip("transformers")
    result = _python("examples/transformers_tp.py", "--device", "cuda", timeout_s=300)
    _check(result, interleaved=False)
    for line in result.stdout.splitlines():
        if "streams per ubatch" in line:
            streams = ast.literal_eval(line.split("streams per ubatch ", 1)[1])  # {ubatch: [stream ids]}
            ids = [s for per_ubatch in streams.values() for s in per_ubatch]
            assert all(len(v) == 1 for v in streams.values()) and len(set(ids)) == len(ids), line


@pytest.mark.parametrize("nproc", [1, 2])
def test_runner_loop_serves_arrivals_equal_to_unsplit_greedy(nproc):
    result = torchrun(nproc, "examples/runner_loop.py", timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # the ranks print concurrently, so their lines may run together: count the verdicts
    assert result.stdout.count("equals unsplit greedy decoding: True") == nproc, result.stdout
    assert "equals unsplit greedy decoding: False" not in result.stdout, result.stdout


def test_runner_loop_under_a_calibrated_mode_policy_serves_equal_to_unsplit_greedy():
    """Both ranks calibrate one policy (each mode's time the slower rank's), which the runner
    accepts only if it is the same on every rank, and pick the same mode every step."""
    result = torchrun(2, "examples/runner_loop.py", "--modes", "pipeline2,split2+join", timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("equals unsplit greedy decoding: True") == 2, result.stdout
    served = re.findall(r"steps per mode (\{[^}]*\})", result.stdout)  # the ranks' lines may run together
    assert len(served) == 2 and served[0] == served[1], result.stdout
