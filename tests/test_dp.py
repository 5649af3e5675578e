"""Data parallelism: the per-step vote, DP=EP generation on 2 and 4 gloo ranks (8 with
--run-slow) equal to one process holding the whole model and every request (ubatching on and
off, unequal loads, an idle rank), torchrun on 2 and 4 processes, and a peer that crashes or
hangs mid-run surfacing as a clear error within a bounded time."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist_utils import run_distributed, torchrun
from ubatch.context import CUDAGraphMode
from ubatch.dp import DPBatchDecision, coordinate_batch_across_dp, dp_cpu_group, local_batch_decision
from ubatch.models import ModelConfig, build_model
from ubatch.policy import SplitPolicy
from ubatch.runner import ModelRunner

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
RUNNER = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)


# ----- the vote ---------------------------------------------------------------------------------

# (per-rank (unpadded, padded, wants_ubatch, mode)) -> (should_ubatch, num_tokens_across_dp, mode)
VOTE_CASES = [
    pytest.param([(10, 10, True, NONE), (7, 8, True, NONE)], (True, [10, 10], NONE), id="both-split"),
    pytest.param([(10, 10, True, NONE), (9, 9, False, NONE)], (False, [10, 9], NONE), id="one-refuses"),
    pytest.param([(10, 16, True, FULL), (9, 12, False, PIECEWISE)], (False, [16, 16], PIECEWISE), id="modes-differ"),
    pytest.param([(100, 100, True, NONE), (3, 3, True, NONE)], (False, [100, 3], NONE), id="all-padding-ubatch"),
    pytest.param([(100, 104, True, FULL), (53, 56, True, FULL)], (True, [104, 104], FULL), id="just-enough"),
    pytest.param([(12, 12, True, NONE), (0, 0, True, NONE)], (False, [12, 0], NONE), id="idle-rank"),
]


def vote_body(rank: int, world_size: int, cases: list[tuple[list[tuple], tuple]]) -> None:
    """Every case on both ranks; also: one collective per vote, the gloo group is cached, ranks
    that disagree on num_ubatches all raise, and an EP runner without a DP group is refused."""
    gathers = 0
    gather = dist.all_gather

    def counting_gather(*args: Any, **kwargs: Any) -> Any:
        nonlocal gathers
        gathers += 1
        return gather(*args, **kwargs)

    dist.all_gather = counting_gather
    for votes, (should_ubatch, across, mode) in cases:
        unpadded, padded, wants, rank_mode = votes[rank]
        decision = coordinate_batch_across_dp(unpadded, padded, wants_ubatch=wants, cudagraph_mode=rank_mode)
        assert decision == DPBatchDecision(should_ubatch, across, mode), (votes, decision)
    assert gathers == len(cases)
    dist.all_gather = gather

    group = dp_cpu_group(timeout_s=30)
    assert group is dp_cpu_group(timeout_s=30) and dist.get_backend(group) == "gloo"
    with pytest.raises(ValueError, match=r"disagree on num_ubatches: \[2, 3\]"):
        coordinate_batch_across_dp(8, 8, wants_ubatch=True, cudagraph_mode=NONE, num_ubatches=2 + rank, group=group)
    config = ModelConfig.preset("tiny-moe")
    model = build_model(config, device="cpu", ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"expert-parallel over 2 ranks: pass dp_group"):
        ModelRunner(model, config, device="cpu", **RUNNER)
    singles = [dist.new_group([r]) for r in range(world_size)]
    with pytest.raises(ValueError, match=rf"includes ranks \[{1 - rank}\] outside dp_group \(ranks \[{rank}\]\)"):
        ModelRunner(model, config, device="cpu", dp_group=singles[rank], **RUNNER)


def test_dp_cpu_group_survives_a_new_default_group(tmp_path, monkeypatch):
    """A cached gloo group belongs to the default group it was made under: after tearing the
    default group down and initialising a new one whose id is the same (forced here; CPython
    may reuse a freed object's id), the vote gets a live group."""
    import ubatch.dp

    monkeypatch.setattr(ubatch.dp, "id", lambda obj: 7, raising=False)
    for attempt in range(2):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous{attempt}", rank=0, world_size=1)
        try:
            decision = coordinate_batch_across_dp(
                3, 4, wants_ubatch=False, cudagraph_mode=NONE, group=dp_cpu_group(timeout_s=5)
            )
            assert decision.num_tokens_across_dp == [4]
        finally:
            dist.destroy_process_group()


def test_dp_cpu_group_cache_keeps_no_group_alive_after_teardown(tmp_path):
    """The cache holds its groups weakly: once the process group is torn down and the caller
    lets go, the gloo group is gone (one left for interpreter exit can abort the process)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        group = dp_cpu_group(timeout_s=5)
        assert dp_cpu_group(timeout_s=5) is group, "a group in use is reused"
        alive = weakref.ref(group)
        del group
    finally:
        dist.destroy_process_group()
    assert alive() is None


def test_vote_rules_two_ranks_gloo():
    cases = [(p.values[0], p.values[1]) for p in VOTE_CASES]
    run_distributed(vote_body, 2, cases)


@pytest.mark.parametrize(("votes", "expected"), VOTE_CASES)
def test_local_decision_is_each_ranks_own(votes, expected):
    """With one rank (no process group) the rules apply to that rank alone."""
    for unpadded, padded, wants, mode in votes:
        decision = coordinate_batch_across_dp(unpadded, padded, wants_ubatch=wants, cudagraph_mode=mode)
        expected_ubatch = wants and unpadded > padded // 2
        assert decision == DPBatchDecision(expected_ubatch, [padded], mode)
        assert decision == local_batch_decision(unpadded, padded, wants_ubatch=wants, cudagraph_mode=mode)


def test_one_ubatch_never_splits():
    decision = coordinate_batch_across_dp(64, 64, wants_ubatch=True, cudagraph_mode=NONE, num_ubatches=1)
    assert not decision.should_ubatch


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_tokens_unpadded=-1), r"num_tokens_unpadded must be an integer >= 0, got -1"),
        (dict(num_tokens_padded=3), r"num_tokens_padded \(3\) is less than num_tokens_unpadded \(4\)"),
        (dict(num_tokens_padded=4.0), r"num_tokens_padded must be an integer >= 0, got 4.0"),
        (dict(num_ubatches=0), r"num_ubatches must be an integer >= 1, got 0"),
        (dict(wants_ubatch=1), r"wants_ubatch must be a bool, got 1"),
        (dict(cudagraph_mode=7), r"cudagraph_mode must be a CUDAGraphMode .*got 7"),
    ],
)
def test_bad_vote_inputs(kwargs, match):
    args = dict(num_tokens_unpadded=4, num_tokens_padded=4, wants_ubatch=True, cudagraph_mode=NONE)
    with pytest.raises(ValueError, match=match):
        coordinate_batch_across_dp(**{**args, **kwargs})


# ----- generation -------------------------------------------------------------------------------

# Per world size, per scenario, per rank: (prompt lengths, max_new_tokens). The last rank
# finishes early (then runs padding steps); in "idle-rank" it has no request at all.
LOADS = {
    2: {
        "unequal": [((3, 17, 40, 9), (6, 4, 6, 5)), ((12, 9, 2), (2, 3, 2))],
        "idle-rank": [((11, 26, 1), (5, 6, 4)), ((), ())],
        "lockstep": [((2, 3, 2, 3), (7, 7, 7, 7)), ((3, 2, 2, 2), (5, 5, 5, 5))],
    },
    4: {
        "unequal": [
            ((3, 17, 40, 9), (6, 4, 6, 5)),
            ((12, 9, 2), (2, 3, 2)),
            ((25, 4, 6), (5, 6, 3)),
            ((7, 1, 5), (2, 2, 1)),
        ],
        "idle-rank": [((11, 26, 1), (5, 6, 4)), ((9, 4), (3, 5)), ((14, 3), (4, 2)), ((), ())],
        "lockstep": [
            ((2, 3, 2, 3), (7, 7, 7, 7)),
            ((3, 2, 2, 2), (7, 7, 7, 7)),
            ((2, 2, 3, 3), (6, 7, 7, 6)),
            ((3, 2, 2, 2), (5, 5, 5, 5)),
        ],
    },
}
# Two copies of the 4-rank loads (every rank's prompts still differ: they are seeded by rank).
LOADS[8] = {name: loads * 2 for name, loads in LOADS[4].items()}


def make_prompts(config: ModelConfig, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def record_steps(runner: ModelRunner) -> list[tuple[int, DPBatchDecision]]:
    """Keep (real tokens of this rank, decision) of every step."""
    steps: list[tuple[int, DPBatchDecision]] = []
    decide = type(runner).decide
    owner = weakref.ref(runner)  # a strong reference would make a cycle that holds the process groups

    def recording(num_tokens: int, **kwargs: Any) -> DPBatchDecision:
        decision = decide(owner(), num_tokens, **kwargs)
        steps.append((num_tokens, decision))
        return decision

    runner.decide = recording
    return steps


def moe_config(world_size: int) -> ModelConfig:
    """tiny-moe, with one expert per rank on worlds larger than its 4 experts (which the MoE
    refuses to split unevenly)."""
    return ModelConfig.preset("tiny-moe", num_experts=max(4, world_size))


def generation_body(rank: int, world_size: int, device_kind: str, num_ubatches: int, graphs: bool = False) -> None:
    """DP+EP generation on every rank vs one runner holding the whole model and all requests."""
    device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    config = moe_config(world_size)
    reference_runner = ModelRunner(
        build_model(config, device=device),
        config,
        device=device,
        **dict(RUNNER, num_kv_blocks=RUNNER["num_kv_blocks"] * world_size),
    )
    model = build_model(config, device=device, ep_group=dist.group.WORLD)
    graph_options = dict(cudagraph_capture_sizes=[4, 8, 16], max_model_len=64) if graphs else {}
    runner = ModelRunner(
        model,
        config,
        device=device,
        num_ubatches=num_ubatches,
        dp_group=dist.group.WORLD,
        timeout_s=60,
        **RUNNER,
        **graph_options,
    )
    replayed = []
    if graphs:
        runner.capture_graphs()
        replay = weakref.WeakMethod(runner.graphs.replay)
        runner.graphs.replay = lambda desc, *a: replayed.append(desc) or replay()(desc, *a)
    for name, loads in LOADS[world_size].items():
        prompts = [make_prompts(config, lengths, seed=r) for r, (lengths, _) in enumerate(loads)]
        limits = [list(limit) for _, limit in loads]
        reference = reference_runner.generate(sum(prompts, []), sum(limits, []))
        first = sum(len(p) for p in prompts[:rank])
        steps = record_steps(runner)
        assert runner.generate(prompts[rank], limits[rank]) == reference[first : first + len(prompts[rank])], name
        assert runner.block_pool.num_free == RUNNER["num_kv_blocks"]
        ran = steps[:-1]  # the last step is the all-idle one that ends generate() everywhere
        assert not any(steps[-1][1].num_tokens_across_dp)
        assert all(len(set(d.num_tokens_across_dp)) == 1 for _, d in ran), "EP ranks must run equal counts"
        if rank == world_size - 1:
            assert any(real == 0 for real, _ in ran), f"{name}: rank {rank} never ran a padding-only step"
        ubatched = [d.should_ubatch for _, d in ran]
        assert any(ubatched) == (num_ubatches > 1 and name != "idle-rank"), (name, ubatched)
        assert not all(ubatched), f"{name}: steps with a nearly idle rank must not split"
    if graphs:  # lockstep decodes replay FULL graphs (ubatched when allowed); mixed steps PIECEWISE
        assert any(d.cg_mode == CUDAGraphMode.FULL and d.num_ubatches == num_ubatches for d in replayed), replayed
        assert any(d.cg_mode == CUDAGraphMode.PIECEWISE for d in replayed), replayed
    runner.close()  # else destroy_process_group hangs on the graphs' NCCL references


@pytest.mark.parametrize("num_ubatches", [1, 2])
@pytest.mark.parametrize("world_size", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_dp_ep_generation_equals_single_process_gloo(world_size, num_ubatches):
    run_distributed(generation_body, world_size, "cpu", num_ubatches)


def test_local_ubatched_generation_equals_unsplit():
    """Without DP the runner splits locally whenever every ubatch gets a real token."""
    config = ModelConfig.preset("tiny-moe")
    model = build_model(config, device="cpu")
    prompts = make_prompts(config, (3, 17, 40, 9, 1), seed=0)
    expected = ModelRunner(model, config, device="cpu", **RUNNER).generate(prompts, 5)
    runner = ModelRunner(model, config, device="cpu", num_ubatches=3, **RUNNER)
    steps = record_steps(runner)
    assert runner.generate(prompts, 5) == expected
    assert any(d.should_ubatch for _, d in steps) and not all(d.should_ubatch for _, d in steps)
    assert all(d.num_tokens_across_dp == [real] for real, d in steps)


def test_split_policy_keeps_the_runner_s_small_steps_whole():
    """With a policy the runner splits only the steps it picks; the tokens stay the unsplit ones."""
    config = ModelConfig.preset("tiny-moe")
    model = build_model(config, device="cpu")
    prompts = make_prompts(config, (3, 17, 40, 9, 1), seed=0)
    expected = ModelRunner(model, config, device="cpu", **RUNNER).generate(prompts, 5)
    runner = ModelRunner(
        model, config, device="cpu", num_ubatches=2, split_policy=SplitPolicy(threshold_tokens=12), **RUNNER
    )
    steps = record_steps(runner)
    assert runner.generate(prompts, 5) == expected
    assert [d.should_ubatch for _, d in steps] == [real >= 12 for real, _ in steps]
    assert any(d.should_ubatch for _, d in steps) and not all(d.should_ubatch for _, d in steps)
    with pytest.raises(ValueError, match="split_policy needs num_ubatches >= 2, got 1"):
        ModelRunner(model, config, device="cpu", split_policy=SplitPolicy(), **RUNNER)
    with pytest.raises(TypeError, match="split_policy must have a decide"):
        ModelRunner(model, config, device="cpu", num_ubatches=2, split_policy="auto", **RUNNER)


def policy_body(rank: int, world_size: int) -> None:
    """Rank 1's policy never splits, rank 0's splits from 12 tokens: the vote keeps every step
    whole on both ranks (a split on one alone would mismatch the all-to-alls) and the tokens are
    the single-process ones."""
    config = moe_config(world_size)
    prompts = [make_prompts(config, (3, 17, 40), seed=r) for r in range(world_size)]
    reference_runner = ModelRunner(
        build_model(config, device="cpu"),
        config,
        device="cpu",
        **dict(RUNNER, num_kv_blocks=RUNNER["num_kv_blocks"] * world_size),
    )
    reference = reference_runner.generate(sum(prompts, []), 4)
    model = build_model(config, device="cpu", ep_group=dist.group.WORLD)
    policy = SplitPolicy(threshold_tokens=12 if rank == 0 else 10**9)
    runner = ModelRunner(
        model,
        config,
        device="cpu",
        num_ubatches=2,
        dp_group=dist.group.WORLD,
        timeout_s=60,
        split_policy=policy,
        **RUNNER,
    )
    steps = record_steps(runner)
    assert runner.generate(prompts[rank], 4) == reference[3 * rank : 3 * rank + 3]
    assert not any(d.should_ubatch for _, d in steps)
    assert any(real >= 12 for real, _ in steps), "rank 0 had steps its policy would have split"


def test_split_policies_that_disagree_across_dp_ranks_keep_every_step_whole():
    run_distributed(policy_body, 2)


@pytest.mark.multigpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("num_ubatches", [1, 2])
def test_dp2_ep2_generation_equals_single_process_nccl(num_ubatches, graphs):
    run_distributed(generation_body, 2, "cuda", num_ubatches, graphs, backend="nccl")


# ----- a peer that fails ------------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], results: Any) -> None:
    """Run ``fn`` and report (rank, result or error text); exit without tearing the group down,
    since a peer may be gone."""
    torch.set_num_threads(1)  # OMP_NUM_THREADS set here would come after torch's import: ignored
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        results.put((rank, fn(rank)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "".join(traceback.format_exception(exc))))
    os._exit(0)


def run_until_rank0_reports(fn: Callable[[int], Any], timeout_s: float) -> dict[int, Any]:
    """Run ``fn(rank)`` on 2 gloo ranks; wait for rank 0 only, then kill whatever is left."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main, args=(r, 2, init_file, fn, results), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        procs[0].join(timeout_s)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        reported = {}
        while not results.empty():
            rank, value = results.get()
            reported[rank] = value
        return reported


def failing_peer_body(rank: int, failure: str) -> Any:
    """Rank 1 crashes inside its third model call, or hangs before its third vote; rank 0 returns
    how long it took from its last good step to the error, and the error."""
    config = ModelConfig.preset("tiny-moe")
    model = build_model(config, device="cpu", ep_group=dist.group.WORLD)
    runner = ModelRunner(model, config, device="cpu", dp_group=dist.group.WORLD, timeout_s=2, **RUNNER)
    prompts = make_prompts(config, (20, 7, 13), seed=rank)
    calls = 0
    if rank == 1:
        seam = "execute_model" if failure == "crash" else "schedule"
        original = getattr(runner, seam)

        def failing(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 3:
                if failure == "crash":
                    os._exit(1)
                time.sleep(60)
            return original(*args, **kwargs)

        setattr(runner, seam, failing)
        runner.generate(prompts, 8)
        return "rank 1 finished although it should have failed"
    last_good = time.monotonic()
    step = runner.step

    def timed_step() -> Any:
        nonlocal last_good
        out = step()
        last_good = time.monotonic()
        return out

    runner.step = timed_step
    try:
        runner.generate(prompts, 8)
    except RuntimeError as exc:
        return time.monotonic() - last_good, "".join(traceback.format_exception_only(exc))
    return "rank 0 finished although its peer failed"


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        ("crash", r"(Connection reset|Connection closed)"),
        ("hang", r"data-parallel step vote failed on rank 0 of 2: a peer rank failed, exited, timed out"),
    ],
)
def test_failed_peer_makes_others_exit_with_clear_error(failure, message):
    reported = run_until_rank0_reports(functools.partial(failing_peer_body, failure=failure), timeout_s=60)
    assert 0 in reported, "rank 0 hung instead of raising"
    assert isinstance(reported[0], tuple), reported[0]
    elapsed, error = reported[0]
    assert re.search(message, error), error
    assert "on data-parallel rank 0 of 2, step" in error
    # The runner's 2 s timeout, not the default 300 s, bounds it; 30 s leaves a loaded machine room.
    assert elapsed < 30, f"rank 0 took {elapsed:.1f} s to notice"
    assert 1 not in reported, reported.get(1)


# ----- torchrun ---------------------------------------------------------------------------------


def torchrun_generate(nproc: int, *args: str) -> subprocess.CompletedProcess:
    result = torchrun(nproc, "scripts/torchrun_generate.py", "--device", "cpu", *args)
    assert "outlived destroy_process_group" not in result.stderr, result.stderr[-3000:]
    return result


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_generate_prints_throughput(nproc):
    result = torchrun_generate(nproc, "--prompts-per-rank", "3", "--max-new-tokens", "4", "--num-ubatches", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    expected = (
        rf"tiny-moe on {nproc} x cpu, num_ubatches=2, split policy always: {3 * nproc} requests, "
        rf"{12 * nproc} tokens in .* tokens/s"
    )
    assert re.search(expected, result.stdout)


def test_torchrun_generate_calibrates_the_split_policy_on_every_rank_first():
    result = torchrun_generate(
        2,
        "--prompts-per-rank",
        "3",
        "--max-new-tokens",
        "4",
        "--num-ubatches",
        "2",
        "--split-policy",
        "auto",
        "--calibrate-tokens",
        "32,96",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "split policy calibrated: StepCosts(" in result.stderr
    assert re.search(r"num_ubatches=2, split policy auto: 6 requests, 24 tokens in .* tokens/s", result.stdout)
    refused = torchrun_generate(1, "--split-policy", "auto")
    assert refused.returncode != 0 and "--split-policy auto needs --num-ubatches >= 2, got 1" in refused.stderr


def test_torchrun_generate_names_a_world_size_that_does_not_fit():
    result = torchrun_generate(3, "--model", "moe")
    assert result.returncode != 0
    assert "4 experts, which cannot be split evenly over world size 3" in result.stderr


def test_torchrun_generate_num_experts_fits_the_preset_to_the_world_size():
    result = torchrun_generate(3, "--num-experts", "6", "--prompts-per-rank", "2", "--max-new-tokens", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"tiny-moe on 3 x cpu, num_ubatches=1, split policy always: 6 requests, 18 tokens", result.stdout)


@pytest.mark.slow
def test_torchrun_generate_on_8_cpu_ranks_with_8_experts():
    result = torchrun_generate(
        8, "--num-experts", "8", "--prompts-per-rank", "2", "--max-new-tokens", "3", "--num-ubatches", "2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"tiny-moe on 8 x cpu, num_ubatches=2, split policy always: 16 requests, 48 tokens", result.stdout)
