"""The executor on CUDA: per-ubatch compute streams, a comm stream, NCCL across two GPUs.

Run on the GPU machine: ``python -m pytest -m "cuda or multigpu"``. Tolerance on CUDA float32:
atol = rtol = 1e-4 (cuBLAS picks other kernels for other row counts).
"""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_ubatch_models import MODELS, check_ubatched_equals_unsplit, parallel_body
from ubatch import set_forward_context
from ubatch.bench.workload import make_step
from ubatch.models import ModelConfig, build_model
from ubatch.scheduler import UBatchScheduler, current_ubatch, yield_ubatch
from ubatch.sm import SMPartition
from ubatch.wrapper import UBatchWrapper

GPU_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
@pytest.mark.parametrize("model_kind", list(MODELS))
def test_ubatched_equals_unsplit_on_cuda(model_kind, num_ubatches, kind):
    model = build_model(ModelConfig(**MODELS[model_kind]), device="cuda")
    for seed in range(3):
        check_ubatched_equals_unsplit(model, kind, seed, num_ubatches, pad=seed % 2, tol=GPU_TOL)


@pytest.mark.cuda
def test_each_ubatch_runs_on_its_own_stream_and_the_callers_is_restored():
    sched = UBatchScheduler(3, "cuda")
    sched.prepare()
    seen = []

    def task():
        state = current_ubatch()
        seen.append(torch.cuda.current_stream() == state.compute_stream)
        x = torch.randn(256, 256, device="cuda")
        yield_ubatch()
        seen.append(torch.cuda.current_stream() == state.compute_stream)
        return (x @ x).sum()

    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        results = sched.run([task] * 3)
        assert torch.cuda.current_stream() == caller
    assert all(seen) and len(seen) == 6
    assert len({s.cuda_stream for s in sched.compute_streams + [sched.comm_stream]}) == 4
    torch.cuda.synchronize()
    assert all(torch.isfinite(r) for r in results)


@pytest.mark.cuda
def test_one_task_computes_on_the_callers_stream_and_its_collective_still_goes_to_the_comm_stream():
    sched = UBatchScheduler(3, "cuda")
    sched.prepare()
    seen = []

    def task():
        seen.append(torch.cuda.current_stream())
        x = torch.randn(512, 512, device="cuda")
        out = torch.empty_like(x)
        current_ubatch().run_collective("copy", lambda _: out.copy_(x @ x), None)
        seen.append(torch.cuda.current_stream())
        return x, out

    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        ((x, out),) = sched.run([task])
        expected = x @ x  # queued on the caller's stream after the wait for the comm stream
    torch.cuda.synchronize()
    assert seen == [caller, caller]
    torch.testing.assert_close(out, expected)
    with torch.cuda.stream(caller):  # two tasks still get their own streams
        sched.run([task] * 2)
    first, second = sched.compute_streams[:2]
    assert seen[2:] == [first, second, first, second]  # round-robin around the collectives


@pytest.mark.cuda
def test_one_task_keeps_handed_in_compute_streams():
    """An SM partition's compute streams are on its compute SMs: a lone task must stay there."""
    given = [torch.cuda.Stream(), torch.cuda.Stream()]
    sched = UBatchScheduler(2, "cuda", compute_streams=given, comm_stream=torch.cuda.Stream())
    seen = []
    sched.run([lambda: seen.append(torch.cuda.current_stream())])
    assert seen == [given[0]]


@pytest.mark.cuda
def test_ubatched_equals_unsplit_with_a_green_sm_partition():
    model = build_model(ModelConfig(**MODELS["moe"]), device="cuda")
    partition = SMPartition("green", 16, "cuda")
    step, _ = make_step(model, [5, 9, 3, 7], [0, 4, 2, 0])
    wrapper = UBatchWrapper(model, num_ubatches=2, device="cuda", sm_partition=partition)
    with torch.inference_mode(), set_forward_context(step.attn_metadata, no_compile_layers=model.attention_layers):
        expected = model(step.input_ids, step.positions)
    with (
        torch.inference_mode(),
        set_forward_context(step.attn_metadata, no_compile_layers=model.attention_layers, ubatch_slices=step.slices(2)),
    ):
        got = wrapper(step.input_ids, step.positions)
    torch.testing.assert_close(got, expected, **GPU_TOL)
    assert partition.effective_mode == "green", partition.reason


@pytest.mark.multigpu
@pytest.mark.parametrize("model_kind", list(MODELS))
def test_ubatched_equals_unsplit_two_gpus_nccl(model_kind):
    run_distributed(parallel_body, 2, model_kind, "cuda", GPU_TOL, backend="nccl", timeout_s=300)
